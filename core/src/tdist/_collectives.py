"""Collective operations with torch.distributed's signatures.

Each function validates its arguments (no communication on bad input), resolves
the group, stages non-contiguous tensors and hands the work to the group's
backend. With ``async_op=True`` it returns a :class:`tdist.Work`, else None.
Ranks (``src``, ``dst``) are global ranks; ``group_src``/``group_dst`` name a
rank within ``group`` instead. A rank that is not in ``group`` does nothing.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._dispatch import contiguous_view, device_of, device_type, issue
from ._errors import DistBackendError, DistBackendTimeoutError, DistStoreTimeoutError
from ._groups import resolve_group, warn_not_member
from ._observe import rejected, run_observed
from ._reduce_op import ReduceOp, as_reduction
from ._validate import (
    check_all_to_all_splits,
    check_gather_tensor,
    check_same_dtype,
    check_tensor,
    check_tensor_list,
    check_whole,
    peer_rank,
)
from ._work import Work
from .reduction import check_reduction

if TYPE_CHECKING:
    import torch

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "gather_single",
    "gather_into_tensor",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
]


@rejected("broadcast")
def broadcast(
    tensor: "torch.Tensor",
    src: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Copy ``tensor`` from rank ``src`` to every rank of the group."""
    check_tensor("broadcast", "tensor", tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("broadcast")
        return None
    root = peer_rank("broadcast", pg, "src", src, group_src)
    copies: list = []
    t = contiguous_view(tensor, copies, output=True)
    return issue(
        pg, "broadcast", device_type(tensor), lambda b: b.broadcast(t, root), async_op, copies, (tensor,), root=root
    )


@rejected("all_reduce")
def all_reduce(
    tensor: "torch.Tensor", op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Optional[Work]:
    """Reduce ``tensor`` across the group with ``op``; every rank gets the result in place."""
    check_tensor("all_reduce", "tensor", tensor)
    reduction = as_reduction(op)
    check_reduction(reduction, tensor.dtype, "all_reduce")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_reduce")
        return None
    copies: list = []
    t = contiguous_view(tensor, copies, output=True)
    return issue(
        pg,
        "all_reduce",
        device_type(tensor),
        lambda b: b.all_reduce(t, reduction),
        async_op,
        copies,
        (tensor,),
        reduction=reduction,
    )


@rejected("reduce")
def reduce(
    tensor: "torch.Tensor",
    dst: Optional[int] = None,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Reduce ``tensor`` across the group into ``tensor`` on rank ``dst``."""
    check_tensor("reduce", "tensor", tensor)
    reduction = as_reduction(op)
    check_reduction(reduction, tensor.dtype, "reduce")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("reduce")
        return None
    root = peer_rank("reduce", pg, "dst", dst, group_dst)
    copies: list = []
    t = contiguous_view(tensor, copies, output=True)
    return issue(
        pg,
        "reduce",
        device_type(tensor),
        lambda b: b.reduce(t, root, reduction),
        async_op,
        copies,
        (tensor,),
        reduction=reduction,
        root=root,
    )


@rejected("all_gather")
def all_gather(
    tensor_list: list["torch.Tensor"], tensor: "torch.Tensor", group: Any = None, async_op: bool = False
) -> Optional[Work]:
    """``tensor_list[i]`` receives rank i's ``tensor`` on every rank."""
    check_tensor("all_gather", "tensor", tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_gather")
        return None
    outputs = check_tensor_list("all_gather", "tensor_list", tensor_list, pg.size, like=tensor)
    copies: list = []
    staged = [contiguous_view(t, copies, output=True) for t in outputs]
    t = contiguous_view(tensor, None, output=False)
    return issue(pg, "all_gather", device_type(tensor), lambda b: b.all_gather(staged, t), async_op, copies, (tensor,))


@rejected("all_gather_into_tensor")
def all_gather_into_tensor(
    output_tensor: "torch.Tensor", input_tensor: "torch.Tensor", group: Any = None, async_op: bool = False
) -> Optional[Work]:
    """``output_tensor`` (group size × input's elements) receives every rank's input, in rank order."""
    check_tensor("all_gather_into_tensor", "output_tensor", output_tensor)
    check_tensor("all_gather_into_tensor", "input_tensor", input_tensor)
    check_same_dtype("all_gather_into_tensor", "output_tensor", output_tensor, "input_tensor", input_tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_gather_into_tensor")
        return None
    check_whole("all_gather_into_tensor", "output_tensor", output_tensor, input_tensor, pg.size)
    copies: list = []
    out = contiguous_view(output_tensor, copies, output=True)
    inp = contiguous_view(input_tensor, None, output=False)
    return issue(
        pg,
        "all_gather_into_tensor",
        device_type(input_tensor),
        lambda b: b.all_gather_into_tensor(out, inp),
        async_op,
        copies,
        (input_tensor,),
    )


@rejected("gather")
def gather(
    tensor: "torch.Tensor",
    gather_list: Optional[list["torch.Tensor"]] = None,
    dst: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """On rank ``dst`` (default 0), ``gather_list[i]`` receives rank i's ``tensor``;
    other ranks pass no ``gather_list``."""
    check_tensor("gather", "tensor", tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("gather")
        return None
    root = peer_rank("gather", pg, "dst", dst, group_dst, default=0)
    copies: list = []
    staged: Optional[list] = None
    if pg.rank == root:
        outputs = check_tensor_list("gather", "gather_list", gather_list, pg.size, like=tensor)
        staged = [contiguous_view(t, copies, output=True) for t in outputs]
    elif gather_list:
        raise ValueError(
            f"gather: gather_list must be empty on non-destination ranks (this is rank {pg.ranks[pg.rank]})"
        )
    t = contiguous_view(tensor, None, output=False)
    return issue(
        pg, "gather", device_type(tensor), lambda b: b.gather(t, staged, root), async_op, copies, (tensor,), root=root
    )


@rejected("gather_single")
def gather_single(
    tensor: "torch.Tensor",
    gather_tensor: Optional["torch.Tensor"] = None,
    dst: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """On rank ``dst`` (default 0), ``gather_tensor`` (contiguous, group size ×
    ``tensor``'s elements: flat or stacked) receives every rank's ``tensor`` in rank
    order; other ranks need no ``gather_tensor`` (it is not used there)."""
    check_tensor("gather_single", "tensor", tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("gather_single")
        return None
    root = peer_rank("gather_single", pg, "dst", dst, group_dst, default=0)
    out: Optional["torch.Tensor"] = None
    if pg.rank == root:
        out = check_gather_tensor("gather_single", gather_tensor, tensor, pg.size)
    t = contiguous_view(tensor, None, output=False)
    call = lambda b: b.gather_into_tensor(t, out, root)  # noqa: E731
    return issue(pg, "gather", device_type(tensor), call, async_op, (), (tensor,), root=root)


#: torch's earlier name of :func:`gather_single`.
gather_into_tensor = gather_single


@rejected("scatter")
def scatter(
    tensor: "torch.Tensor",
    scatter_list: Optional[list["torch.Tensor"]] = None,
    src: Optional[int] = None,
    group: Any = None,
    async_op: bool = False,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Rank i's ``tensor`` receives ``scatter_list[i]`` of rank ``src`` (default 0)."""
    check_tensor("scatter", "tensor", tensor)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("scatter")
        return None
    root = peer_rank("scatter", pg, "src", src, group_src, default=0)
    inputs: Optional[list] = None
    if pg.rank == root:
        checked = check_tensor_list("scatter", "scatter_list", scatter_list, pg.size, like=tensor)
        inputs = [contiguous_view(t, None, output=False) for t in checked]
    elif scatter_list:
        raise ValueError(f"scatter: scatter_list must be empty on non-source ranks (this is rank {pg.ranks[pg.rank]})")
    copies: list = []
    t = contiguous_view(tensor, copies, output=True)
    return issue(
        pg, "scatter", device_type(tensor), lambda b: b.scatter(t, inputs, root), async_op, copies, (tensor,), root=root
    )


@rejected("reduce_scatter")
def reduce_scatter(
    output: "torch.Tensor",
    input_list: list["torch.Tensor"],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Rank i's ``output`` receives the reduction over ranks of their ``input_list[i]``."""
    check_tensor("reduce_scatter", "output", output)
    reduction = as_reduction(op)
    check_reduction(reduction, output.dtype, "reduce_scatter")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("reduce_scatter")
        return None
    inputs = check_tensor_list("reduce_scatter", "input_list", input_list, pg.size, like=output)
    copies: list = []
    out = contiguous_view(output, copies, output=True)
    staged = [contiguous_view(t, None, output=False) for t in inputs]
    return issue(
        pg,
        "reduce_scatter",
        device_type(output),
        lambda b: b.reduce_scatter(out, staged, reduction),
        async_op,
        copies,
        (output,),
        reduction=reduction,
    )


@rejected("reduce_scatter_tensor")
def reduce_scatter_tensor(
    output: "torch.Tensor", input: "torch.Tensor", op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Optional[Work]:
    """Rank i's ``output`` receives the reduction of chunk i (of ``output``'s size) of every rank's ``input``."""
    check_tensor("reduce_scatter_tensor", "output", output)
    check_tensor("reduce_scatter_tensor", "input", input)
    check_same_dtype("reduce_scatter_tensor", "output", output, "input", input)
    reduction = as_reduction(op)
    check_reduction(reduction, output.dtype, "reduce_scatter_tensor")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("reduce_scatter_tensor")
        return None
    check_whole("reduce_scatter_tensor", "input", input, output, pg.size)
    copies: list = []
    out = contiguous_view(output, copies, output=True)
    inp = contiguous_view(input, None, output=False)
    return issue(
        pg,
        "reduce_scatter_tensor",
        device_type(output),
        lambda b: b.reduce_scatter_tensor(out, inp, reduction),
        async_op,
        copies,
        (input,),
        reduction=reduction,
    )


@rejected("all_to_all")
def all_to_all(
    output_tensor_list: list["torch.Tensor"],
    input_tensor_list: list["torch.Tensor"],
    group: Any = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Rank i's ``output_tensor_list[j]`` receives rank j's ``input_tensor_list[i]``
    (tensors may differ in size per peer)."""
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_to_all")
        return None
    inputs = check_tensor_list("all_to_all", "input_tensor_list", input_tensor_list, pg.size, same_numel=False)
    outputs = check_tensor_list(
        "all_to_all", "output_tensor_list", output_tensor_list, pg.size, like=inputs[0], same_numel=False
    )
    device = device_of(inputs + outputs, "all_to_all")
    copies: list = []
    staged_out = [contiguous_view(t, copies, output=True) for t in outputs]
    staged_in = [contiguous_view(t, None, output=False) for t in inputs]
    return issue(pg, "all_to_all", device, lambda b: b.all_to_all(staged_out, staged_in), async_op, copies, inputs)


@rejected("all_to_all_single")
def all_to_all_single(
    output: "torch.Tensor",
    input: "torch.Tensor",
    output_split_sizes: Optional[Sequence[int]] = None,
    input_split_sizes: Optional[Sequence[int]] = None,
    group: Any = None,
    async_op: bool = False,
) -> Optional[Work]:
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``) and send piece j
    to rank j; rank j's piece i lands in piece i of ``output`` (split by ``output_split_sizes``)."""
    check_tensor("all_to_all_single", "output", output)
    check_tensor("all_to_all_single", "input", input)
    check_same_dtype("all_to_all_single", "output", output, "input", input)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_to_all_single")
        return None
    out_splits, in_splits = check_all_to_all_splits(output, input, output_split_sizes, input_split_sizes, pg.size)
    copies: list = []
    out = contiguous_view(output, copies, output=True)
    inp = contiguous_view(input, None, output=False)
    return issue(
        pg,
        "all_to_all_single",
        device_type(input),
        lambda b: b.all_to_all_single(out, inp, out_splits, in_splits),
        async_op,
        copies,
        (input,),
    )


@rejected("barrier")
def barrier(
    group: Any = None,
    async_op: bool = False,
    device_ids: Optional[list[int]] = None,
    timeout: Optional[timedelta] = None,
) -> Optional[Work]:
    """Block until every rank of the group has entered the barrier. ``timeout`` (blocking
    calls only) bounds the wait instead of the group's timeout: past it, a
    :class:`DistBackendTimeoutError`."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"barrier: timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("barrier")
        return None
    device = "cuda" if device_ids else ("cpu" if "cpu" in pg.backends else next(iter(pg.backends)))
    return issue(pg, "barrier", device, lambda b: b.barrier(), async_op, wait_timeout=timeout)


@rejected("monitored_barrier")
def monitored_barrier(group: Any = None, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False) -> None:
    """A barrier through the store that, when some rank does not arrive within
    ``timeout``, raises on rank 0 naming the missing rank (all of them with
    ``wait_all_ranks``) and makes the other ranks raise too. Works with every backend;
    the work hooks see it as the operation ``monitored_barrier``."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(f"monitored_barrier: timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("monitored_barrier")
        return None
    limit = (timeout or pg.timeout).total_seconds()
    seq = pg.next_seq()
    run_observed(
        pg, "monitored_barrier", seq, lambda: _monitored_barrier(pg, f"monitored_barrier/{seq}", limit, wait_all_ranks)
    )
    return None


def _monitored_barrier(pg: Any, key: str, limit: float, wait_all_ranks: bool) -> None:
    """Rank 0 waits for every other rank's arrival key, then releases them with "ok" or
    with the message naming the missing ranks."""
    store = pg.store
    if pg.rank != 0:
        store.set(f"{key}/arrived/{pg.rank}", b"1")
        try:
            verdict = store.get(f"{key}/release", timeout=limit + 5.0)
        except DistStoreTimeoutError:
            raise DistBackendTimeoutError(
                f"monitored_barrier: rank {pg.ranks[pg.rank]} was not released by rank {pg.ranks[0]} within {limit:g} s"
            ) from None
        if verdict != b"ok":
            raise DistBackendError(verdict.decode())
        return
    deadline = time.monotonic() + limit
    missing: list[int] = []
    for member in range(1, pg.size):
        try:
            store.wait([f"{key}/arrived/{member}"], timeout=max(deadline - time.monotonic(), 0.001))
        except DistStoreTimeoutError:
            missing.append(member)
            if not wait_all_ranks:
                break
    if missing:
        names = [pg.ranks[m] for m in missing]
        message = f"monitored_barrier: rank(s) {names} did not reach the barrier within {limit:g} s (group {pg.name!r})"
        store.set(f"{key}/release", message.encode())
        raise DistBackendTimeoutError(message)
    store.set(f"{key}/release", b"ok")


#: torch.distributed's other names for the single-tensor forms.
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor
