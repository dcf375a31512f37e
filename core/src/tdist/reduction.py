"""Helpers for backend authors who reduce torch tensors in Python.

A backend that moves bytes itself (like ``tdist-tcp``) reduces what it receives
with these four functions, so every backend gives every :class:`ReduceOp` the
same meaning:

- :func:`check_reduction` rejects an operator/dtype combination *before* any
  communication (``TypeError`` for a dtype the operator cannot handle,
  ``ValueError`` for a bad ``PREMUL_SUM`` factor);
- :func:`prescale_` / :func:`prescaled` multiply a rank's contribution by the
  ``PREMUL_SUM`` factor (a no-op for every other operator);
- :func:`combine_` folds one contribution into an accumulator, in place;
- :func:`finalize_` finishes the result (``AVG`` divides by the group size).

A reduction is then ``prescale_`` on every contribution, ``combine_`` pairwise
(in any fixed order), and ``finalize_`` once on the result. On ``bool`` tensors
``SUM``/``MAX`` are a logical or and ``PRODUCT``/``MIN`` a logical and.

torch is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Optional

from ._reduce_op import ReduceOp, Reduction

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_reduction",
    "combine_",
    "prescale_",
    "prescaled",
    "finalize_",
    "premul_factor",
    "ReductionPlan",
    "plan_reduction",
]

_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def _kind(dtype: Any) -> str:
    """'bool', 'int', 'float' or 'complex' for a torch dtype."""
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "bool" if str(dtype) == "torch.bool" else "int"


def _factor_kind(factor: Any) -> str:
    """The kind of a PREMUL_SUM factor: a Python number or a one-element tensor."""
    if factor is None:
        raise ValueError("PREMUL_SUM needs a factor: build it with tdist.make_premul_sum(factor)")
    if hasattr(factor, "numel") and hasattr(factor, "dtype"):
        if factor.numel() != 1:
            raise ValueError(
                f"PREMUL_SUM factor must be a number or a one-element tensor, got {factor.numel()} elements"
            )
        kind = _kind(factor.dtype)
        return "int" if kind == "bool" else kind
    if isinstance(factor, bool):
        return "int"
    if isinstance(factor, numbers.Integral):
        return "int"
    if isinstance(factor, numbers.Real):
        return "float"
    if isinstance(factor, numbers.Complex):
        return "complex"
    raise TypeError(f"PREMUL_SUM factor must be a number or a one-element tensor, got {type(factor).__name__}")


_RANK = {"int": 0, "float": 1, "complex": 2}


def check_reduction(op: Reduction, dtype: Any, backend_name: str = "reduce") -> None:
    """Raise if ``op`` cannot reduce tensors of ``dtype``; call it before communicating.

    ``backend_name`` (a backend or operation name) prefixes the message. Rules:
    BAND/BOR/BXOR need an integer or bool dtype; AVG any but bool (integers: the sum
    divided by the group size, truncated toward zero, as NCCL defines it);
    MIN/MAX/PRODUCT are not supported on complex tensors (as in torch.distributed);
    PREMUL_SUM needs a factor (a number or one-element tensor) that the dtype can
    hold (no float factor for integers, no complex factor for real tensors) and is
    not defined on bool.
    Raises ``TypeError`` for an unsupported dtype, ``ValueError`` for a bad factor.
    Valid (operator, dtype) pairs are remembered, so a repeated check costs one lookup
    (PREMUL_SUM's validity depends on its factor: it is always checked).
    """
    if type(op) is Reduction and (id(op.op), dtype) in _VALID:  # members are singletons, slow to hash
        return
    _check_reduction(op, dtype, backend_name)
    if type(op) is Reduction and op.op is not ReduceOp.PREMUL_SUM and len(_VALID) < 4096:
        _VALID.add((id(op.op), dtype))


#: (id of a ReduceOp member, dtype) pairs that passed :func:`check_reduction`.
_VALID: set = set()


def _check_reduction(op: Reduction, dtype: Any, backend_name: str) -> None:
    if not isinstance(op, Reduction):
        if isinstance(op, ReduceOp):
            op = Reduction(op)
        else:
            raise TypeError(f"{backend_name}: op must be a tdist.Reduction or ReduceOp, got {op!r}")
    code = op.op
    kind = _kind(dtype)
    if code in _BITWISE:
        if kind not in ("int", "bool"):
            raise TypeError(f"{backend_name}: ReduceOp.{code.name} needs an integer or bool tensor, got {dtype}")
    elif code is ReduceOp.AVG:
        if kind == "bool":
            raise TypeError(f"{backend_name}: ReduceOp.AVG is not defined for bool tensors (use SUM or MAX)")
    elif code in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
        if kind == "complex":  # as in torch.distributed (supports_complex): complex is reduced as real pairs
            raise TypeError(f"{backend_name}: ReduceOp.{code.name} is not supported for complex tensors ({dtype})")
    elif code is ReduceOp.PREMUL_SUM:
        try:
            fkind = _factor_kind(op.factor)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{backend_name}: {exc}") from None
        if kind == "bool":
            raise TypeError(f"{backend_name}: ReduceOp.PREMUL_SUM is not defined for bool tensors")
        if _RANK[fkind] > _RANK[kind]:
            raise TypeError(
                f"{backend_name}: ReduceOp.PREMUL_SUM factor {op.factor!r} ({fkind}) cannot scale a {dtype} tensor"
            )


# ------------------------------------------------------------------ combining
def _or(acc: "torch.Tensor", other: "torch.Tensor") -> None:
    acc.logical_or_(other)


def _and(acc: "torch.Tensor", other: "torch.Tensor") -> None:
    acc.logical_and_(other)


def _min(acc: "torch.Tensor", other: "torch.Tensor") -> None:
    import torch

    torch.minimum(acc, other, out=acc)


def _max(acc: "torch.Tensor", other: "torch.Tensor") -> None:
    import torch

    torch.maximum(acc, other, out=acc)


_COMBINE: dict[ReduceOp, Callable[[Any, Any], None]] = {
    ReduceOp.SUM: lambda a, b: a.add_(b),
    ReduceOp.AVG: lambda a, b: a.add_(b),
    ReduceOp.PREMUL_SUM: lambda a, b: a.add_(b),
    ReduceOp.PRODUCT: lambda a, b: a.mul_(b),
    ReduceOp.MIN: _min,
    ReduceOp.MAX: _max,
    ReduceOp.BAND: lambda a, b: a.bitwise_and_(b),
    ReduceOp.BOR: lambda a, b: a.bitwise_or_(b),
    ReduceOp.BXOR: lambda a, b: a.bitwise_xor_(b),
}
_COMBINE_BOOL: dict[ReduceOp, Callable[[Any, Any], None]] = {
    **_COMBINE,
    ReduceOp.SUM: _or,
    ReduceOp.MAX: _or,
    ReduceOp.PRODUCT: _and,
    ReduceOp.MIN: _and,
}


def combine_(acc: "torch.Tensor", other: "torch.Tensor", op: Reduction) -> "torch.Tensor":
    """Fold ``other`` into ``acc`` in place (``acc = acc <op> other``) and return ``acc``.

    SUM/AVG/PREMUL_SUM add (contributions are prescaled, AVG is finalized later),
    PRODUCT multiplies, MIN/MAX take the element-wise minimum/maximum, BAND/BOR/BXOR
    are bitwise; on bool tensors SUM/MAX are a logical or, PRODUCT/MIN a logical and.
    ``acc`` and ``other`` have the same dtype and number of elements.
    """
    import torch

    table = _COMBINE_BOOL if acc.dtype == torch.bool else _COMBINE
    table[op.op](acc, other)
    return acc


# ---------------------------------------------------------- scaling, finishing
def premul_factor(factor: Any, like: "torch.Tensor") -> Any:
    """PREMUL_SUM's factor, ready to multiply ``like``: a Python number as is, a one-element
    tensor as a 0-dim tensor on ``like``'s device (a 0-dim tensor never promotes ``like``'s
    dtype; a shape-[1] one would)."""
    if hasattr(factor, "numel") and hasattr(factor, "reshape"):
        return factor.reshape(()).to(device=like.device)
    return factor


def prescale_(tensor: "torch.Tensor", op: Reduction) -> "torch.Tensor":
    """Multiply ``tensor`` in place by the PREMUL_SUM factor (no-op for other operators)."""
    if op.op is ReduceOp.PREMUL_SUM:
        tensor.mul_(premul_factor(op.factor, tensor))
    return tensor


def prescaled(tensor: "torch.Tensor", op: Reduction) -> "torch.Tensor":
    """``tensor`` times the PREMUL_SUM factor as a new tensor; for every other operator
    ``tensor`` itself (not a copy): copy it yourself before modifying it."""
    if op.op is ReduceOp.PREMUL_SUM:
        return tensor.mul(premul_factor(op.factor, tensor)).to(tensor.dtype)
    return tensor


def finalize_(tensor: "torch.Tensor", op: Reduction, world_size: int) -> "torch.Tensor":
    """Finish a reduction in place: AVG divides by ``world_size`` (integers: truncated
    toward zero, as NCCL's integer average); others are unchanged."""
    if op.op is ReduceOp.AVG:
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(world_size)
        else:
            tensor.div_(world_size, rounding_mode="trunc")
    return tensor


# ------------------------------------------------------------------ planning
@dataclass(frozen=True)
class ReductionPlan:
    """How a library that reduces some dtypes natively runs one valid reduction.

    ``op``: the operator the library applies (SUM for PREMUL_SUM, and for AVG when it
    has no AVG of its own); ``compute``: the dtype the library reduces: ``dtype`` itself,
    a wider one to copy into and back (:attr:`widened`), or, with ``as_real``, the real
    dtype of a complex tensor's ``view_as_real``; ``prescale``: multiply every
    contribution by the PREMUL_SUM factor first (:func:`prescale_`); ``divide``: divide
    the result by the group size afterwards (:func:`finalize_` does it for AVG).
    """

    op: ReduceOp
    dtype: Any
    compute: Any
    as_real: bool = False
    prescale: bool = False
    divide: bool = False

    @property
    def widened(self) -> bool:
        """The library reduces a copy in :attr:`compute`, copied back afterwards."""
        return not self.as_real and self.compute != self.dtype


def plan_reduction(
    reduction: Reduction,
    dtype: Any,
    native: Collection[Any],
    *,
    widen: Optional[Mapping[Any, Any]] = None,
    complex_as_real: bool = False,
    native_avg: bool = True,
    native_int_avg: bool = False,
    backend: str = "backend",
    operation: str = "reduce",
) -> ReductionPlan:
    """Check ``reduction`` on ``dtype`` (:func:`check_reduction`'s rules) and say how a
    library that reduces the dtypes in ``native`` runs it: complex tensors as their real
    view (``complex_as_real``), other dtypes in the wider dtype ``widen`` maps them to,
    AVG as SUM then a division unless ``native_avg`` (integers: always, unless
    ``native_int_avg``), PREMUL_SUM as a prescale then SUM.
    Raises ``TypeError`` (``ValueError`` for a bad factor) before anything is sent, naming
    ``operation`` and ``backend``."""
    check_reduction(reduction, dtype, f"{operation}: backend {backend!r}")
    op = reduction.op
    compute, as_real = dtype, False
    if complex_as_real and dtype.is_complex:
        import torch

        compute, as_real = torch.empty(0, dtype=dtype).real.dtype, True
    if compute not in native:
        wider = (widen or {}).get(compute)
        if wider is None:
            raise TypeError(
                f"{operation}: backend {backend!r} cannot reduce {dtype} tensors with ReduceOp.{op.name} "
                "(it has no arithmetic for that dtype)"
            )
        compute = wider
    integer = not (dtype.is_floating_point or dtype.is_complex)
    divide = op is ReduceOp.AVG and not (native_int_avg if integer else native_avg)
    applied = ReduceOp.SUM if op is ReduceOp.PREMUL_SUM or divide else op
    return ReductionPlan(applied, dtype, compute, as_real, op is ReduceOp.PREMUL_SUM, divide)
