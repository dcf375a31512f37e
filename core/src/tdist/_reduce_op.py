"""Reduction operators: :class:`ReduceOp`, the deprecated ``reduce_op`` alias and
:class:`Reduction`, the normalised form a backend receives."""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import Any, Union

__all__ = ["ReduceOp", "Reduction", "reduce_op", "make_premul_sum", "as_reduction", "supports_complex"]


class ReduceOp(enum.Enum):
    """Element-wise reduction applied by ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    ``PREMUL_SUM`` multiplies every rank's input by a factor before summing;
    build it with :func:`make_premul_sum` (``ReduceOp.PREMUL_SUM`` alone has no factor).
    ``AVG`` divides the sum by the group size (integers: truncated toward zero, as
    NCCL's average; not defined for bool).
    """

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"
    PREMUL_SUM = "premul_sum"

    def __repr__(self) -> str:
        return f"<ReduceOp.{self.name}>"


@dataclass(frozen=True)
class Reduction:
    """A reduction as a backend receives it: the operator and, for PREMUL_SUM, its factor.

    ``factor`` is a Python number or a one-element tensor; it is ``None`` for every
    operator but PREMUL_SUM.
    """

    op: ReduceOp
    factor: Any = None

    @property
    def name(self) -> str:
        return self.op.name


def make_premul_sum(factor: Union[float, Any]) -> Reduction:
    """Return the PREMUL_SUM reduction: ``sum(factor * x_i)`` over the ranks.

    ``factor`` is a Python number or a one-element tensor (the same on every rank).
    """
    if hasattr(factor, "numel") and factor.numel() != 1:
        raise ValueError(f"PREMUL_SUM: factor must be a scalar or one-element tensor, got {factor.numel()} elements")
    return Reduction(ReduceOp.PREMUL_SUM, factor)


def as_reduction(op: Any) -> Reduction:
    """Normalise what a user passed as ``op=`` into a :class:`Reduction`.

    Accepts a :class:`ReduceOp`, a :class:`Reduction` (from :func:`make_premul_sum`)
    or the deprecated ``reduce_op`` members.
    """
    plain = _PLAIN_BY_ID.get(id(op))  # the common case; hashing an enum member runs Python code
    if plain is not None:
        return plain
    if isinstance(op, Reduction):
        return op
    if isinstance(op, ReduceOp):
        if op is ReduceOp.PREMUL_SUM:
            raise ValueError("ReduceOp.PREMUL_SUM needs a factor: use tdist.make_premul_sum(factor)")
        return _PLAIN[op]
    raise TypeError(f"op must be a tdist.ReduceOp, got {op!r}")


_PLAIN = {op: Reduction(op) for op in ReduceOp if op is not ReduceOp.PREMUL_SUM}
_PLAIN_BY_ID = {id(op): reduction for op, reduction in _PLAIN.items()}


class _DeprecatedReduceOp:
    """``reduce_op``: the pre-1.0 name of :class:`ReduceOp`; warns once per access."""

    def __getattr__(self, name: str) -> ReduceOp:
        try:
            member = ReduceOp[name]
        except KeyError:
            raise AttributeError(f"reduce_op has no member {name!r}") from None
        warnings.warn("tdist.reduce_op is deprecated, use tdist.ReduceOp", FutureWarning, stacklevel=2)
        return member

    def __dir__(self) -> list[str]:
        return [op.name for op in ReduceOp]


reduce_op = _DeprecatedReduceOp()


def supports_complex(reduceOp: Any) -> bool:
    """Whether ``reduceOp`` can reduce complex tensors (not MIN, MAX, PRODUCT or a bitwise op)."""
    code = reduceOp if isinstance(reduceOp, ReduceOp) else as_reduction(reduceOp).op
    return code not in (
        ReduceOp.MIN,
        ReduceOp.MAX,
        ReduceOp.PRODUCT,
        ReduceOp.BAND,
        ReduceOp.BOR,
        ReduceOp.BXOR,
    )
