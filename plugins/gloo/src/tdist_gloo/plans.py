"""How a reduction runs on gloo (:class:`Plan`: natively, on the real view of complex
tensors, widened to a dtype gloo has, or uint64 as int64), and the views gloo carries
for dtypes it lacks (their bytes)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from tdist.plugin import ReduceOp, Reduction, check_reduction, plan_reduction, premul_factor

from .torch_gloo import R, c10d

__all__ = [
    "BROADCAST_DTYPES",
    "GLOO_DTYPES",
    "NATIVE",
    "Plan",
    "chain",
    "flat_view",
    "input_buffer",
    "io_buffer",
    "make_plan",
    "output_buffer",
    "rows_view",
]

_TORCH_OP = {
    ReduceOp.SUM: R.SUM,
    ReduceOp.PRODUCT: R.PRODUCT,
    ReduceOp.MIN: R.MIN,
    ReduceOp.MAX: R.MAX,
    ReduceOp.BAND: R.BAND,
    ReduceOp.BOR: R.BOR,
    ReduceOp.BXOR: R.BXOR,
    ReduceOp.AVG: R.AVG,
    ReduceOp.PREMUL_SUM: R.SUM,  # after multiplying by the factor
}
_MINMAX = (ReduceOp.MIN, ReduceOp.MAX)

#: dtypes gloo reduces and moves itself.
_GLOO_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_GLOO_INTS = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64})
GLOO_DTYPES = _GLOO_FLOATS | _GLOO_INTS | {torch.bool}
#: torch's gloo broadcast also takes complex64/128 (as their real view).
BROADCAST_DTYPES = GLOO_DTYPES | {torch.complex64, torch.complex128}
#: integers gloo lacks, reduced as int64 and cast back (wrap-around is preserved).
_WIDENED_INTS = frozenset(d for d in (torch.int16, getattr(torch, "uint16", None), getattr(torch, "uint32", None)) if d)
_UINT64 = getattr(torch, "uint64", None)
_SIGN_BIT = -(2**63)

# plan kinds
NATIVE, REAL, WIDEN, U64 = range(4)


class Plan:
    """How one (reduction, dtype) runs on gloo."""

    __slots__ = ("kind", "torch_op", "compute", "prescale", "flip", "divide", "ar_opts", "rs_opts")

    def __init__(
        self,
        kind: int,
        torch_op: Any,
        compute: Any = None,
        prescale: bool = False,
        flip: bool = False,
        divide: bool = False,
    ):
        self.kind = kind
        self.torch_op = torch_op
        self.compute = compute
        self.prescale = prescale
        self.flip = flip
        self.divide = divide  # integer AVG: gloo sums, the result is divided afterwards
        self.ar_opts = c10d.AllreduceOptions()
        self.ar_opts.reduceOp = torch_op
        self.rs_opts = c10d.ReduceScatterOptions()
        self.rs_opts.reduceOp = torch_op


#: dtypes gloo has no arithmetic for, reduced in a wider one it has (and cast back):
#: integers as int64 (wrap-around is preserved), narrow floats (float8, ...) as float32.
_WIDER = {
    **{d: torch.int64 for d in _WIDENED_INTS},
    **{
        d: torch.float32
        for d in vars(torch).values()
        if isinstance(d, torch.dtype) and d.is_floating_point and d.itemsize <= 4 and d not in _GLOO_FLOATS
    },
}


def make_plan(op: ReduceOp, dtype: Any, operation: str, factor: Any) -> Plan:
    """Choose how to run reduction ``op`` on ``dtype``, or raise TypeError (nothing sent yet)."""
    reduction = Reduction(op, factor)
    if _UINT64 is not None and dtype == _UINT64:  # as int64, MIN/MAX with the sign bit flipped
        check_reduction(reduction, dtype, f"{operation}: backend 'gloo'")
        avg = op is ReduceOp.AVG
        torch_op = _TORCH_OP[ReduceOp.SUM if avg else op]
        return Plan(
            U64, torch_op, compute=torch.int64, prescale=op is ReduceOp.PREMUL_SUM, flip=op in _MINMAX, divide=avg
        )
    plan = plan_reduction(
        reduction, dtype, GLOO_DTYPES, widen=_WIDER, complex_as_real=True, backend="gloo", operation=operation
    )
    kind = REAL if plan.as_real else WIDEN if plan.widened else NATIVE
    compute = plan.compute if kind == WIDEN else None
    return Plan(kind, _TORCH_OP[plan.op], compute=compute, prescale=plan.prescale, divide=plan.divide)


def io_buffer(plan: Plan, tensor: Any, factor: Any) -> tuple:
    """(buffer gloo reduces in place, finish step or None) for a tensor that is both
    this rank's contribution and the place of the result (all_reduce, reduce)."""
    kind = plan.kind
    if kind == NATIVE or kind == REAL:
        if plan.prescale:
            tensor.mul_(premul_factor(factor, tensor))
        return (torch.view_as_real(tensor) if kind == REAL else tensor), None
    if kind == WIDEN:
        buffer = tensor.to(plan.compute)
        if plan.prescale:
            buffer.mul_(premul_factor(factor, buffer))
        return buffer, lambda: tensor.copy_(buffer)
    # U64: the int64 view of the same bits
    buffer = tensor.view(torch.int64)
    if plan.prescale:
        buffer.mul_(premul_factor(factor, buffer))
    if plan.flip:
        buffer.bitwise_xor_(_SIGN_BIT)
        return buffer, lambda: buffer.bitwise_xor_(_SIGN_BIT)
    return buffer, None


def input_buffer(plan: Plan, tensor: Any, factor: Any) -> Any:
    """A buffer with this rank's contribution ``tensor`` (left unchanged)."""
    kind = plan.kind
    if kind == NATIVE or kind == REAL:
        if plan.prescale:
            tensor = tensor * premul_factor(factor, tensor)
        return torch.view_as_real(tensor) if kind == REAL else tensor
    if kind == WIDEN:
        buffer = tensor.to(plan.compute)
        if plan.prescale:
            buffer.mul_(premul_factor(factor, buffer))
        return buffer
    buffer = tensor.view(torch.int64)
    if plan.prescale:
        buffer = buffer * premul_factor(factor, buffer)
    if plan.flip:
        buffer = buffer ^ _SIGN_BIT
    return buffer


def output_buffer(plan: Plan, tensor: Any) -> tuple:
    """(buffer gloo writes the result to, finish step or None) for an output tensor."""
    kind = plan.kind
    if kind == NATIVE:
        return tensor, None
    if kind == REAL:
        return torch.view_as_real(tensor), None
    if kind == WIDEN:
        buffer = torch.empty(tensor.shape, dtype=plan.compute, device=tensor.device)
        return buffer, lambda: tensor.copy_(buffer)
    buffer = tensor.view(torch.int64)
    if plan.flip:
        return buffer, lambda: buffer.bitwise_xor_(_SIGN_BIT)
    return buffer, None


# ------------------------------------------------------------ data movement
def flat_view(tensor: Any) -> Any:
    """A 1-D view gloo can carry: the tensor itself for gloo's dtypes, else its bytes."""
    flat = tensor.view(-1)
    return flat if tensor.dtype in GLOO_DTYPES else flat.view(torch.uint8)


def rows_view(tensor: Any) -> Any:
    """A 2-D (dim 0 × rest) view gloo can carry, for alltoall_base's row splits."""
    if tensor.dtype in GLOO_DTYPES:
        return tensor
    rest = 1
    for extent in tensor.shape[1:]:
        rest *= extent
    return tensor.view(tensor.shape[0], rest).view(torch.uint8)


def chain(*steps: Optional[Callable[[], Any]]) -> Optional[Callable[[], None]]:
    todo = [step for step in steps if step is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run
