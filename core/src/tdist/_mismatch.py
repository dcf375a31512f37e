"""The optional collective check, done once for every backend in the dispatch path.

With ``TDIST_CHECK_COLLECTIVES=1``, or for the groups of a backend that asks for it
(:attr:`tdist.Backend.check_collectives`, e.g. gloo's ``gloo_check_collectives``), the
ranks compare what they are about to issue before each collective: one all-gather of a
row of five integers (operation, dtype, elements, root, reduce operator) through the
group's own backend. Ranks that disagree all raise :class:`DistBackendError` naming who
issued what, instead of hanging or returning corrupted data. It costs one extra
collective per collective: a debugging aid, off by default.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._backend import OPERATION_CODES, Backend
from ._errors import DistBackendError
from ._flags import flag
from ._reduce_op import ReduceOp

if TYPE_CHECKING:
    import torch

    from ._groups import ProcessGroup

__all__ = ["CHECK_ENV", "check_collective", "checks_collectives", "signature", "mismatch"]

CHECK_ENV = "TDIST_CHECK_COLLECTIVES"
#: A field that does not apply to the operation (no tensor, no root, no reduction).
MISSING = -1
#: Operations whose ranks legitimately pass different sizes.
_UNEVEN = frozenset({"all_to_all", "all_to_all_single"})
_REDUCE_CODES = {op: code for code, op in enumerate(ReduceOp, start=1)}


def checks_collectives(backends: Sequence[Backend]) -> bool:
    """Whether a group served by ``backends`` checks its collectives first."""
    return flag(CHECK_ENV) or any(backend.check_collectives for backend in backends)


def _dtype_code(dtype: Any) -> int:
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def signature(operation: str, tensors: Sequence["torch.Tensor"], reduction: Any, root: Optional[int]) -> list[int]:
    """This rank's row: operation, dtype, elements, root (group rank), reduce operator."""
    first = tensors[0] if tensors else None
    elements = MISSING if first is None or operation in _UNEVEN else sum(t.numel() for t in tensors)
    return [
        OPERATION_CODES[operation],
        _dtype_code(first.dtype) if first is not None else MISSING,
        elements,
        MISSING if root is None else root,
        _REDUCE_CODES[reduction.op] if reduction is not None else MISSING,
    ]


def _describe(row: Sequence[int]) -> str:
    """A row in words: "all_reduce, torch.float32, 8 elements, ReduceOp.SUM"."""
    import torch

    operations = {code: name for name, code in OPERATION_CODES.items()}
    dtypes = {_dtype_code(v): str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)}
    reduces = {code: op.name for op, code in _REDUCE_CODES.items()}
    parts = [operations.get(row[0], f"operation #{row[0]}")]
    if row[1] != MISSING:
        parts.append(dtypes.get(row[1], f"dtype #{row[1]}"))
    if row[2] != MISSING:
        parts.append(f"{row[2]} elements")
    if row[3] != MISSING:
        parts.append(f"root {row[3]}")
    if row[4] != MISSING:
        parts.append(f"ReduceOp.{reduces.get(row[4], row[4])}")
    return ", ".join(parts)


def mismatch(operation: str, group: str, ranks: Sequence[int], rows: Sequence[Sequence[int]]) -> Optional[str]:
    """None when every rank's row is the same, else the message naming who issued what
    (``ranks``: the group's global ranks, in the rows' order)."""
    if all(list(r) == list(rows[0]) for r in rows):
        return None
    issued: dict[tuple, list[int]] = {}
    for rank, row in zip(ranks, rows):
        issued.setdefault(tuple(row), []).append(rank)
    who = "; ".join(f"rank(s) {members}: {_describe(row)}" for row, members in issued.items())
    return (
        f"{operation}: the ranks of group {group!r} issued different collectives ({who}); "
        f"checked because of {CHECK_ENV} or the backend's collective check"
    )


def check_collective(
    pg: "ProcessGroup",
    backend: Backend,
    operation: str,
    device: str,
    tensors: Sequence["torch.Tensor"],
    reduction: Any,
    root: Optional[int],
) -> None:
    """Compare this collective with the other ranks' through ``backend``; raise
    :class:`DistBackendError` on every rank when they differ."""
    import torch

    row = signature(operation, tensors, reduction, root)
    where = tensors[0].device if tensors else torch.device(device)
    mine = torch.tensor(row, dtype=torch.int64, device=where)
    table = torch.empty(pg.size * len(row), dtype=torch.int64, device=where)
    backend.run_blocking(lambda b: b.all_gather_into_tensor(table, mine), None)
    message = mismatch(operation, pg.name, pg.ranks, table.view(pg.size, len(row)).tolist())
    if message is not None:
        raise DistBackendError(message)
