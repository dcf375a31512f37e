"""The multi-GPU collectives of torch.distributed's 2017 docs: one tensor per local device.

A backend may implement them natively (NCCL group calls) by defining a method
of the same name; otherwise the core composes them from the single-tensor
collective: combine the local tensors, run one collective, copy the result to
every local tensor. The composed form works on every backend and device (CPU
tensor lists included); it runs synchronously, and with ``async_op=True``
returns an already completed Work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from . import _collectives as coll
from ._dispatch import issue
from ._groups import resolve_group, warn_not_member
from ._reduce_op import ReduceOp, Reduction, as_reduction
from ._validate import check_tensor_list
from ._work import Work
from .reduction import check_reduction, combine_, prescaled

if TYPE_CHECKING:
    import torch

__all__ = ["broadcast_multigpu", "all_reduce_multigpu", "reduce_multigpu", "all_gather_multigpu"]

_SUM = Reduction(ReduceOp.SUM)


def _native(pg: Any, name: str, device: str) -> Any:
    """The backend's own ``name`` method for ``device`` tensors, or None (compose instead).
    Support is checked once, by ``issue`` or by the composed collective."""
    return getattr(pg.backends.get(device), name, None)


def _done(async_op: bool, op: str) -> Optional[Work]:
    return Work.completed(op) if async_op else None


def _combine_local(tensors: list["torch.Tensor"], op: Reduction) -> tuple["torch.Tensor", Reduction]:
    """Reduce the local tensors into a new tensor; return it and the op to finish across ranks."""
    scaled = op.op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
    local = _SUM if scaled else op
    acc = prescaled(tensors[0], op).clone() if op.op is ReduceOp.PREMUL_SUM else tensors[0].clone()
    for t in tensors[1:]:
        combine_(acc, prescaled(t, op).to(acc.device), local)
    return acc, (_SUM if op.op is ReduceOp.PREMUL_SUM else op)


def all_reduce_multigpu(
    tensor_list: list["torch.Tensor"], op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Optional[Work]:
    """All-reduce over every tensor of every rank; each tensor of ``tensor_list`` gets the result."""
    tensors = check_tensor_list("all_reduce_multigpu", "tensor_list", tensor_list)
    reduction = as_reduction(op)
    check_reduction(reduction, tensors[0].dtype, "all_reduce_multigpu")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_reduce_multigpu")
        return None
    native = _native(pg, "all_reduce_multigpu", tensors[0].device.type)
    if native is not None:
        return issue(pg, "all_reduce", tensors[0].device.type, lambda b: native(tensors, reduction), async_op)
    acc, across = _combine_local(tensors, reduction)
    if across.op is ReduceOp.AVG:
        coll.all_reduce(acc, ReduceOp.SUM, group=group)
        acc /= pg.size * len(tensors)
    else:
        coll.all_reduce(acc, across, group=group)
    for t in tensors:
        t.copy_(acc)
    return _done(async_op, "all_reduce_multigpu")


def reduce_multigpu(
    tensor_list: list["torch.Tensor"], dst: int, op: Any = ReduceOp.SUM, group: Any = None,
    async_op: bool = False, dst_tensor: int = 0,
) -> Optional[Work]:
    """Reduce over every tensor of every rank into ``tensor_list[dst_tensor]`` on rank ``dst``."""
    tensors = check_tensor_list("reduce_multigpu", "tensor_list", tensor_list)
    if not 0 <= dst_tensor < len(tensors):
        raise ValueError(f"reduce_multigpu: dst_tensor={dst_tensor} out of range for {len(tensors)} tensors")
    reduction = as_reduction(op)
    check_reduction(reduction, tensors[0].dtype, "reduce_multigpu")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("reduce_multigpu")
        return None
    native = _native(pg, "reduce_multigpu", tensors[0].device.type)
    if native is not None:
        root = pg.group_rank(dst, "dst")
        return issue(
            pg, "reduce", tensors[0].device.type, lambda b: native(tensors, root, reduction, dst_tensor), async_op
        )
    acc, across = _combine_local(tensors, reduction)
    if across.op is ReduceOp.AVG:
        coll.reduce(acc, dst, ReduceOp.SUM, group=group)
        acc /= pg.size * len(tensors)
    else:
        coll.reduce(acc, dst, across, group=group)
    if pg.ranks[pg.rank] == dst:
        tensors[dst_tensor].copy_(acc)
    return _done(async_op, "reduce_multigpu")


def broadcast_multigpu(
    tensor_list: list["torch.Tensor"], src: int, group: Any = None, async_op: bool = False, src_tensor: int = 0
) -> Optional[Work]:
    """Broadcast ``tensor_list[src_tensor]`` of rank ``src`` into every tensor of every rank."""
    tensors = check_tensor_list("broadcast_multigpu", "tensor_list", tensor_list)
    if not 0 <= src_tensor < len(tensors):
        raise ValueError(f"broadcast_multigpu: src_tensor={src_tensor} out of range for {len(tensors)} tensors")
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("broadcast_multigpu")
        return None
    native = _native(pg, "broadcast_multigpu", tensors[0].device.type)
    if native is not None:
        root = pg.group_rank(src, "src")
        return issue(
            pg, "broadcast", tensors[0].device.type, lambda b: native(tensors, root, src_tensor), async_op
        )
    source = tensors[src_tensor] if pg.ranks[pg.rank] == src else tensors[0]
    coll.broadcast(source, src, group=group)
    for t in tensors:
        if t is not source:
            t.copy_(source)
    return _done(async_op, "broadcast_multigpu")


def all_gather_multigpu(
    output_tensor_lists: list[list["torch.Tensor"]], input_tensor_list: list["torch.Tensor"], group: Any = None,
    async_op: bool = False,
) -> Optional[Work]:
    """``output_tensor_lists[i][k * len(input_tensor_list) + j]`` receives
    ``input_tensor_list[j]`` of rank k, for every local tensor i."""
    inputs = check_tensor_list("all_gather_multigpu", "input_tensor_list", input_tensor_list)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member("all_gather_multigpu")
        return None
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != len(inputs):
        raise ValueError(
            f"all_gather_multigpu: output_tensor_lists must hold one list per input tensor ({len(inputs)})"
        )
    expected = pg.size * len(inputs)
    outputs = [
        check_tensor_list("all_gather_multigpu", f"output_tensor_lists[{i}]", out, expected, like=inputs[0])
        for i, out in enumerate(output_tensor_lists)
    ]
    native = _native(pg, "all_gather_multigpu", inputs[0].device.type)
    if native is not None:
        return issue(pg, "all_gather", inputs[0].device.type, lambda b: native(outputs, inputs), async_op)
    import torch

    local = torch.stack([t.to(inputs[0].device).reshape(-1) for t in inputs])
    gathered = local.new_empty((pg.size * len(inputs), local.shape[1]))
    coll.all_gather_into_tensor(gathered, local, group=group)
    for out in outputs:
        for k, t in enumerate(out):
            t.copy_(gathered[k].view(t.shape))
    return _done(async_op, "all_gather_multigpu")
