"""The shared-memory engine's optional C part, :mod:`tdist_tcp.shared._shmfast`.

Built with the distribution when a C compiler is at hand (an optional extension: the
install never fails for want of one). It runs a one-step collective -- barrier, a
broadcast or an all_reduce/reduce of up to :data:`QUICK_BYTES` -- in a single call:
descriptor, data, post, a bounded spin, descriptor check, copy or reduction. When the
spin runs out the call returns ``WAIT`` with the step posted, and the engine waits in
Python as always (futex sleep, liveness, timeout) before ``finish()``. Everything else,
and everything when the extension is missing or ``$TDIST_TCP_NATIVE=0`` (or the group
option ``native=False``), runs in :mod:`tdist_tcp.shared.shm`'s Python, which follows the same
protocol step for step: ranks with and without it can share a group.

A queued all_reduce or reduce of up to :data:`QUICK_BYTES` (waited for through its
Work, as every call through torch's API is) makes the same call from the lane. The C
part also reduces a two-step all_reduce's or reduce_scatter's slice (``combine``: every
input in one pass, in cache-sized tiles, without the GIL).

Reductions done in C: float32/float64 with SUM, PRODUCT, MIN, MAX, AVG; int8, uint8,
int16, int32, int64 with SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR (wrapping like
torch). Every rank reduces the same buffers in rank order, so results are bitwise
identical across ranks and equal to the Python path's.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Optional

from tdist.plugin import ReduceOp, flag

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

__all__ = [
    "NATIVE_ENV",
    "QUICK_BYTES",
    "DONE",
    "WAIT",
    "MISMATCH",
    "BARRIER",
    "BROADCAST",
    "REDUCE",
    "native_module",
    "element_type",
    "operator",
]

NATIVE_ENV = "TDIST_TCP_NATIVE"
#: Largest message of a quick (one C call) broadcast or reduction.
QUICK_BYTES = 64 << 10
#: What a quick call returns: finished; posted, waiting for peers (call ``finish()`` once they
#: have posted); finished, but the ranks' descriptors differ (the caller raises).
DONE, WAIT, MISMATCH = 0, 1, 2
#: The kinds of collective ``Fast.run`` runs.
BARRIER, BROADCAST, REDUCE = 1, 2, 3

_ELEMENT_TYPES: Optional[dict] = None
_OPERATORS = {
    ReduceOp.SUM: 1,
    ReduceOp.PRODUCT: 2,
    ReduceOp.MIN: 3,
    ReduceOp.MAX: 4,
    ReduceOp.BAND: 5,
    ReduceOp.BOR: 6,
    ReduceOp.BXOR: 7,
    ReduceOp.AVG: 8,
}
_OPERATOR_CODES = {id(member): code for member, code in _OPERATORS.items()}
_FLOATS = (1, 2)


def native_module(options: Mapping[str, Any]) -> Optional[ModuleType]:
    """The extension, or None when it is not built or disabled (``options["native"]``,
    else ``$TDIST_TCP_NATIVE``, default on)."""
    if not flag(NATIVE_ENV, True, options.get("native")):
        return None
    try:
        from . import _shmfast  # type: ignore[attr-defined]
    except ImportError:
        return None
    return _shmfast


def element_type(dtype: "torch.dtype") -> int:
    """The extension's code for ``dtype``; 0 if it does not reduce it."""
    global _ELEMENT_TYPES
    if _ELEMENT_TYPES is None:
        import torch

        _ELEMENT_TYPES = {
            torch.float32: 1,
            torch.float64: 2,
            torch.int8: 3,
            torch.uint8: 4,
            torch.int16: 5,
            torch.int32: 6,
            torch.int64: 7,
        }
    return _ELEMENT_TYPES.get(dtype, 0)


def operator(op: "Reduction", etype: int) -> int:
    """The extension's code for ``op`` on element type ``etype``; 0 if it cannot apply it
    (PREMUL_SUM, AVG of integers, bitwise operators on floats, an unknown type)."""
    code = _OPERATOR_CODES.get(id(op.op), 0)
    if not etype or (code == 8 and etype not in _FLOATS) or (code >= 5 and code <= 7 and etype in _FLOATS):
        return 0
    return code
