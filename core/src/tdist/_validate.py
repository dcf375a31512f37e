"""Argument checks run before any communication. Every failure is a ValueError or
TypeError whose message starts with the operation's name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._groups import ProcessGroup

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_tensor",
    "check_tensor_list",
    "peer_rank",
    "check_same_dtype",
    "check_whole",
    "check_root",
    "check_all_to_all_splits",
    "check_splits",
]


def _torch() -> Any:
    import torch

    return torch


_tensor_type: Any = None  # torch.Tensor, once torch is imported (importing it per call costs)


def check_tensor(operation: str, name: str, tensor: Any) -> "torch.Tensor":
    """``tensor`` if it is a dense torch tensor, else a TypeError."""
    global _tensor_type
    if _tensor_type is None:
        _tensor_type = _torch().Tensor
    if not isinstance(tensor, _tensor_type):
        raise TypeError(f"{operation}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError(f"{operation}: {name} is a sparse tensor; only dense tensors are supported")
    return tensor


def check_tensor_list(
    operation: str,
    name: str,
    tensors: Any,
    length: Optional[int] = None,
    like: Optional["torch.Tensor"] = None,
    same_numel: bool = True,
) -> list["torch.Tensor"]:
    """A non-empty list of tensors, of ``length`` items, each of ``like``'s dtype and
    device (and number of elements, when ``same_numel``)."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{operation}: {name} must be a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{operation}: {name} is empty")
    if length is not None and len(tensors) != length:
        raise ValueError(f"{operation}: {name} has {len(tensors)} tensors but the group has {length} ranks")
    checked = [check_tensor(operation, f"{name}[{i}]", t) for i, t in enumerate(tensors)]
    reference = like if like is not None else checked[0]
    for i, t in enumerate(checked):
        if t.dtype != reference.dtype:
            raise ValueError(f"{operation}: {name}[{i}] has dtype {t.dtype}, expected {reference.dtype}")
        if t.device.type != reference.device.type:
            raise ValueError(f"{operation}: {name}[{i}] is on {t.device}, expected {reference.device.type}")
        if same_numel and t.numel() != reference.numel():
            raise ValueError(
                f"{operation}: {name}[{i}] has {t.numel()} elements, expected {reference.numel()} "
                f"(shape {tuple(t.shape)} vs {tuple(reference.shape)})"
            )
    return checked


def check_same_dtype(operation: str, a_name: str, a: "torch.Tensor", b_name: str, b: "torch.Tensor") -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{operation}: {a_name} has dtype {a.dtype} but {b_name} has {b.dtype}")
    if a.device.type != b.device.type:
        raise ValueError(f"{operation}: {a_name} is on {a.device} but {b_name} is on {b.device}")


def check_whole(operation: str, whole_name: str, whole: "torch.Tensor", part: "torch.Tensor", size: int) -> None:
    """``whole`` (the gathered output / the input to scatter) holds ``size`` times ``part``'s elements."""
    if whole.numel() != size * part.numel():
        raise ValueError(
            f"{operation}: {whole_name} has {whole.numel()} elements, expected "
            f"{size} × {part.numel()} = {size * part.numel()}"
        )


def check_gather_tensor(
    operation: str, gather_tensor: Optional["torch.Tensor"], tensor: "torch.Tensor", size: int
) -> "torch.Tensor":
    """The destination's ``gather_tensor`` of :func:`tdist.gather_single`: given, a
    contiguous tensor of ``tensor``'s dtype holding ``size`` times its elements."""
    if gather_tensor is None:
        raise ValueError(f"{operation}: gather_tensor must be specified on the destination rank")
    check_tensor(operation, "gather_tensor", gather_tensor)
    check_same_dtype(operation, "gather_tensor", gather_tensor, "tensor", tensor)
    if not gather_tensor.is_contiguous():
        raise ValueError(f"{operation}: gather_tensor must be contiguous")
    check_whole(operation, "gather_tensor", gather_tensor, tensor, size)
    return gather_tensor


def check_root(operation: str, pg: ProcessGroup, name: str, group_rank: int, allow_self: bool = True) -> int:
    """``group_rank`` if it names a rank of ``pg`` (and, unless ``allow_self``, not this one)."""
    if not isinstance(group_rank, int) or not 0 <= group_rank < pg.size:
        raise ValueError(
            f"{operation}: {name} (group rank {group_rank!r}) is out of range for a group of size {pg.size}"
        )
    if not allow_self and group_rank == pg.rank:
        raise ValueError(f"{operation}: {name} {pg.ranks[group_rank]} is this process's own rank")
    return group_rank


def peer_rank(
    operation: str,
    pg: ProcessGroup,
    name: str,
    global_rank: Optional[int],
    group_rank: Optional[int],
    allow_self: bool = True,
    default: Optional[int] = None,
) -> int:
    """The group rank named by a global ``name=`` or a ``group_name=`` argument."""
    if group_rank is None and type(global_rank) is int:  # the common case, in one lookup
        result = pg._global_to_group.get(global_rank)
        if result is not None and (allow_self or result != pg.rank):
            return result
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{operation}: pass either {name} or group_{name}, not both")
    if group_rank is not None:
        if not isinstance(group_rank, int) or isinstance(group_rank, bool) or not 0 <= group_rank < pg.size:
            raise ValueError(f"{operation}: group_{name}={group_rank!r} is out of range for a group of size {pg.size}")
        result = group_rank
    elif global_rank is not None:
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{operation}: {name} must be an int rank, got {global_rank!r}")
        if not 0 <= global_rank:
            raise ValueError(f"{operation}: {name}={global_rank} is not a valid rank")
        try:
            result = pg.group_rank(global_rank)
        except ValueError:
            raise ValueError(
                f"{operation}: {name}={global_rank} is not a rank of group {pg.name!r} (its ranks: {pg.ranks})"
            ) from None
    elif default is not None:
        result = default
    else:
        raise ValueError(f"{operation}: {name} is required")
    if not allow_self and result == pg.rank:
        raise ValueError(f"{operation}: {name}={pg.ranks[result]} is this process's own rank")
    return result


def check_splits(operation: str, name: str, splits: Optional[Sequence[int]], dim0: int, size: int) -> list[int]:
    """Split sizes along dim 0 (even split when None), checked to sum to ``dim0``."""
    if splits is None or len(splits) == 0:
        if dim0 % size:
            raise ValueError(f"{operation}: dim 0 ({dim0}) is not divisible by the group size {size}; pass {name}")
        return [dim0 // size] * size
    splits = list(splits)
    if len(splits) != size:
        raise ValueError(f"{operation}: {name} has {len(splits)} entries but the group has {size} ranks")
    if any((not isinstance(s, int)) or s < 0 for s in splits):
        raise ValueError(f"{operation}: {name} must be non-negative integers, got {splits}")
    if sum(splits) != dim0:
        raise ValueError(f"{operation}: {name} sums to {sum(splits)} but dim 0 of the tensor is {dim0}")
    return splits


def check_all_to_all_splits(
    output: "torch.Tensor",
    input: "torch.Tensor",
    output_split_sizes: Optional[Sequence[int]],
    input_split_sizes: Optional[Sequence[int]],
    size: int,
) -> tuple[list[int], list[int]]:
    """all_to_all_single's (output, input) split sizes along dim 0, checked: even splits
    when not given, tensors of at least one dimension that agree beyond dim 0."""
    if input.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_single: input and output must have at least one dimension")
    in_splits = check_splits("all_to_all_single", "input_split_sizes", input_split_sizes, input.shape[0], size)
    out_splits = check_splits("all_to_all_single", "output_split_sizes", output_split_sizes, output.shape[0], size)
    if input.shape[1:] != output.shape[1:]:
        raise ValueError(
            f"all_to_all_single: input and output must agree beyond dim 0, got {tuple(input.shape)} and "
            f"{tuple(output.shape)}"
        )
    return out_splits, in_splits
