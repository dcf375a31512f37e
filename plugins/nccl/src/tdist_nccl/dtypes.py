"""torch dtypes and tdist reductions in NCCL's terms, checked before any communication.

Data that is only moved (broadcast, gathers, all-to-all, send/recv) travels as bytes,
so every dtype works. Reductions need an NCCL type: float16, bfloat16 (NCCL >= 2.10 and
a CuPy exposing ``NCCL_BFLOAT16``), float32, float64, int8, uint8, int32, int64 (and
uint32/uint64); bool reduces as uint8 with MAX (SUM, MAX: logical or) and MIN (PRODUCT,
MIN: logical and); complex tensors reduce as their real view for SUM, AVG and PREMUL_SUM.
NCCL has no bitwise reductions: BAND, BOR and BXOR are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tdist import ReduceOp, Reduction
from tdist.plugin import plan_reduction as core_plan

if TYPE_CHECKING:
    import torch

__all__ = [
    "AVG_MIN_VERSION",
    "BFLOAT16_MIN_VERSION",
    "BOOL_OPS",
    "BYTE_TYPE_NAME",
    "NCCL_OP_NAMES",
    "NCCL_TYPE_NAMES",
    "ReducePlan",
    "as_bytes",
    "average_",
    "nccl_type",
    "plan_reduction",
    "reduce_view",
]

#: torch dtype name -> the ``cupy.cuda.nccl`` constant used to reduce it.
NCCL_TYPE_NAMES: dict[str, str] = {
    "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "int64": "NCCL_INT64",
    "uint32": "NCCL_UINT32",
    "uint64": "NCCL_UINT64",
    "bool": "NCCL_UINT8",
}
#: complex dtype name -> the real dtype name of its ``view_as_real``.
COMPLEX_REAL: dict[str, str] = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}
#: tdist operator -> ``cupy.cuda.nccl`` constant (AVG: only with NCCL >= 2.10).
NCCL_OP_NAMES: dict[ReduceOp, str] = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.AVG: "NCCL_AVG",
    ReduceOp.PREMUL_SUM: "NCCL_SUM",  # after multiplying each contribution by the factor
}
#: On bool tensors (0/1 bytes): SUM and MAX are a logical or, PRODUCT and MIN a logical and.
BOOL_OPS: dict[ReduceOp, ReduceOp] = {
    ReduceOp.SUM: ReduceOp.MAX,
    ReduceOp.MAX: ReduceOp.MAX,
    ReduceOp.PRODUCT: ReduceOp.MIN,
    ReduceOp.MIN: ReduceOp.MIN,
}
BYTE_TYPE_NAME = "NCCL_UINT8"
AVG_MIN_VERSION = 21000  # ncclAvg: NCCL 2.10
BFLOAT16_MIN_VERSION = 21000  # ncclBfloat16: NCCL 2.10
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def nccl_type(nccl: Any, dtype: Any, version: int, operation: str) -> int:
    """The NCCL type code that reduces ``dtype``; a TypeError naming what NCCL lacks."""
    name = _name(dtype)
    const = NCCL_TYPE_NAMES.get(name)
    if const is None:
        supported = ", ".join(sorted(set(NCCL_TYPE_NAMES) | set(COMPLEX_REAL)))
        raise TypeError(f"nccl {operation}: NCCL cannot reduce {name} tensors (it reduces {supported})")
    if name == "bfloat16":
        if not hasattr(nccl, const):
            raise TypeError(
                f"nccl {operation}: this CuPy does not expose NCCL_BFLOAT16, so bfloat16 tensors cannot be "
                "reduced; upgrade CuPy (or reduce in float32)"
            )
        if 0 < version < BFLOAT16_MIN_VERSION:
            raise TypeError(f"nccl {operation}: bfloat16 reductions need NCCL >= 2.10 (this NCCL is older)")
    code = getattr(nccl, const, None)
    if code is None:
        raise TypeError(f"nccl {operation}: this CuPy does not expose {const}, needed to reduce {name} tensors")
    return int(code)


@dataclass(frozen=True)
class ReducePlan:
    """How to run one tdist reduction with NCCL.

    ``nccl_type``/``nccl_op``: the codes to pass; ``as_real``: reduce ``view_as_real``
    of a complex tensor; ``prescale``: multiply each contribution by ``factor`` first
    (PREMUL_SUM); ``divide``: divide the result by the number of NCCL ranks afterwards
    (AVG on an NCCL older than 2.10).
    """

    nccl_type: int
    nccl_op: int
    as_real: bool = False
    prescale: bool = False
    factor: Any = None
    divide: bool = False


def plan_reduction(nccl: Any, version: int, dtype: Any, reduction: Reduction, operation: str) -> ReducePlan:
    """Check ``reduction`` on ``dtype`` for NCCL and say how to run it (tdist's planner:
    complex tensors as their real view, AVG as SUM then a division before NCCL 2.10).
    Raises TypeError (or ValueError for a PREMUL_SUM without factor) before anything is
    communicated."""
    import torch

    op = reduction.op
    if op in _BITWISE:
        raise TypeError(
            f"nccl {operation}: ReduceOp.{op.name} is not supported: NCCL has no bitwise reductions "
            "(use SUM/PRODUCT/MIN/MAX, or a CPU backend such as gloo or tcp)"
        )
    name = _name(dtype)
    code = nccl_type(nccl, "torch." + COMPLEX_REAL.get(name, name), version, operation)  # or what NCCL lacks
    native_avg = version >= AVG_MIN_VERSION and hasattr(nccl, "NCCL_AVG")
    natives = {getattr(torch, n) for n in NCCL_TYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
    plan = core_plan(
        reduction,
        dtype,
        natives,
        complex_as_real=True,
        native_avg=native_avg,
        native_int_avg=native_avg,
        backend="nccl",
        operation=operation,
    )
    applied = BOOL_OPS[plan.op] if plan.compute is torch.bool else plan.op
    return ReducePlan(
        nccl_type=code,
        nccl_op=int(getattr(nccl, NCCL_OP_NAMES[applied])),
        as_real=plan.as_real,
        prescale=plan.prescale,
        factor=reduction.factor if plan.prescale else None,
        divide=plan.divide,
    )


def average_(tensor: torch.Tensor, count: int) -> torch.Tensor:
    """Divide a summed ``tensor`` by ``count`` in place (integers truncated toward zero, as
    ``ncclAvg`` does): AVG on an NCCL older than 2.10."""
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(count)
    return tensor.div_(count, rounding_mode="trunc")


def reduce_view(tensor: torch.Tensor, plan: ReducePlan) -> torch.Tensor:
    """The tensor NCCL reduces: ``tensor`` itself, or its real view for complex tensors."""
    import torch

    return torch.view_as_real(tensor) if plan.as_real else tensor


def as_bytes(tensor: torch.Tensor) -> int:
    """The number of bytes of a contiguous tensor (data moved as NCCL_UINT8)."""
    return tensor.numel() * tensor.element_size()
