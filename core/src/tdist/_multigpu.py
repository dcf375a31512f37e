"""The multi-GPU collectives of torch.distributed 1.x: one tensor per local device.

The core checks the arguments and issues the backend's ``*_multigpu`` operation
(:class:`tdist.Backend` declares them, with defaults that compose them from the
backend's single-tensor collective: combine the local tensors, run one collective,
copy the result to every local tensor, synchronously; NCCL runs them natively).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ._dispatch import issue
from ._groups import resolve_group, warn_not_member
from ._reduce_op import ReduceOp, as_reduction
from ._validate import check_tensor_list
from ._work import Work
from .reduction import check_reduction

if TYPE_CHECKING:
    import torch

__all__ = ["broadcast_multigpu", "all_reduce_multigpu", "reduce_multigpu", "all_gather_multigpu"]


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
    return issue(
        pg, "all_reduce", tensors[0].device.type, lambda b: b.all_reduce_multigpu(tensors, reduction), async_op
    )


def reduce_multigpu(
    tensor_list: list["torch.Tensor"],
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    dst_tensor: int = 0,
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
    root = pg.group_rank(dst, "dst")
    return issue(
        pg,
        "reduce",
        tensors[0].device.type,
        lambda b: b.reduce_multigpu(tensors, root, reduction, dst_tensor),
        async_op,
    )


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
    root = pg.group_rank(src, "src")
    return issue(
        pg, "broadcast", tensors[0].device.type, lambda b: b.broadcast_multigpu(tensors, root, src_tensor), async_op
    )


def all_gather_multigpu(
    output_tensor_lists: list[list["torch.Tensor"]],
    input_tensor_list: list["torch.Tensor"],
    group: Any = None,
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
    return issue(pg, "all_gather", inputs[0].device.type, lambda b: b.all_gather_multigpu(outputs, inputs), async_op)
