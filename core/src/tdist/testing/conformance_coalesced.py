"""Conformance bodies: the coalesced collectives (several tensors in one call) and
torch.distributed's other names for the single-tensor collectives, on the world and
on a subgroup. As in torch, ``async_op=True`` of a coalesced call returns a future."""

from __future__ import annotations

from typing import Any

from ._registry import body
from .helpers import GROUP_ASYNC, GROUP_KINDS, Sub, assert_tensor, assert_true, dist, is_tdist, value, value_sum

__all__ = ["all_reduce_coalesced", "all_gather_coalesced", "coalescing_manager", "single_tensor_aliases"]


def _torch():
    import torch

    return torch


def _settle(s: Sub, result: Any, name: str, async_op: bool) -> None:
    """None for a blocking call or a non-member; else a future, waited on here."""
    if not s.is_member or not async_op:
        assert_true(result is None, f"{name} returned {result!r}, expected None")
        return
    is_future = hasattr(result, "wait") and hasattr(result, "done")
    assert_true(is_future, f"{name}(async_op=True) returned {result!r}, not a future")
    result.wait()
    assert_true(result.done(), f"{name}: the future is not done after wait()")


@body(params=GROUP_ASYNC)
def all_reduce_coalesced(group: str = "world", async_op: bool = False):
    """Three tensors of different shapes reduced in one call (plus a strided view on tdist),
    SUM then MAX; non-members' tensors stay untouched."""
    torch = _torch()
    s = Sub(group)
    shapes = [(5,), (2, 3), (1,)]
    tensors = [value(s.rank, *shape, salt=i) for i, shape in enumerate(shapes)]
    if is_tdist():  # torch's gloo wants contiguous tensors here
        base = value(s.rank, 4, 4, salt=7)
        tensors.append(base[:, ::2])
    before = [t.clone() for t in tensors]
    _settle(s, dist.all_reduce_coalesced(tensors, async_op=async_op, **s.kw), "all_reduce_coalesced", async_op)
    for i, shape in enumerate(shapes):
        expected = value_sum(s.members, *shape, salt=i) if s.is_member else before[i]
        assert_tensor(tensors[i], expected, f"all_reduce_coalesced tensor {i}")
    if is_tdist():
        expected = value_sum(s.members, 4, 4, salt=7)[:, ::2] if s.is_member else before[3]
        assert_tensor(tensors[3], expected, "all_reduce_coalesced strided view")
        assert_tensor(base[:, 1::2], value(s.rank, 4, 4, salt=7)[:, 1::2], "the elements between the view's")
    pair = [torch.tensor([float(s.rank)]), torch.tensor([-float(s.rank), 1.0])]
    _settle(
        s,
        dist.all_reduce_coalesced(pair, op=dist.ReduceOp.MAX, async_op=async_op, **s.kw),
        "all_reduce_coalesced MAX",
        async_op,
    )
    if s.is_member:
        assert_tensor(pair[0], torch.tensor([float(max(s.members))]), "all_reduce_coalesced MAX tensor 0")
        assert_tensor(pair[1], torch.tensor([-float(min(s.members)), 1.0]), "all_reduce_coalesced MAX tensor 1")


@body(params=GROUP_ASYNC)
def all_gather_coalesced(group: str = "world", async_op: bool = False):
    """``output_tensor_lists[i][j]`` receives group rank i's ``input_tensor_list[j]``;
    tensors of several shapes in one call."""
    torch = _torch()
    s = Sub(group)
    shapes = [(3,), (2, 2)]
    inputs = [value(s.rank, *shape, salt=j) for j, shape in enumerate(shapes)]
    outputs = [[torch.full(shape, -1.0) for shape in shapes] for _ in range(s.size)]
    result = dist.all_gather_coalesced(outputs, inputs, async_op=async_op, **s.kw)
    _settle(s, result, "all_gather_coalesced", async_op)
    for i, m in enumerate(s.members):
        for j, shape in enumerate(shapes):
            expected = value(m, *shape, salt=j) if s.is_member else torch.full(shape, -1.0)
            assert_tensor(outputs[i][j], expected, f"all_gather_coalesced output [{i}][{j}] (rank {m})")


@body(params=[{"group": "world", "async_ops": a} for a in (False, True)])
def coalescing_manager(group: str = "world", async_ops: bool = False):
    """torch's private ``_coalescing_manager`` (FSDP and DTensor use it): all_reduces issued
    inside complete by the end of the block, or by ``cm.wait()`` with ``async_ops``."""
    s = Sub(group)
    tensors = [value(s.rank, 3, salt=i) for i in range(3)]
    with dist._coalescing_manager(async_ops=async_ops, **s.kw) as cm:
        for t in tensors:
            dist.all_reduce(t, **s.kw)
    if async_ops:
        cm.wait()
    for i, t in enumerate(tensors):
        assert_tensor(t, value_sum(s.members, 3, salt=i), f"all_reduce {i} inside _coalescing_manager")


@body(params=[{"group": g} for g in GROUP_KINDS], requires=("all_gather_into_tensor", "reduce_scatter_tensor"))
def single_tensor_aliases(group: str = "world"):
    """``all_gather_single`` and ``reduce_scatter_single``: the ``*_into_tensor``/``*_tensor`` forms."""
    torch = _torch()
    s = Sub(group)
    out = torch.full((s.size * 2,), -1.0)
    dist.all_gather_single(out, value(s.rank, 2), **s.kw)
    if s.is_member:
        assert_tensor(out, torch.cat([value(m, 2) for m in s.members]), "all_gather_single")
    out = torch.full((3,), -1.0)
    dist.reduce_scatter_single(out, value(s.rank, s.size * 3), **s.kw)
    if s.is_member:
        assert_tensor(out, value_sum(s.members, s.size * 3)[s.me * 3 : (s.me + 1) * 3], "reduce_scatter_single")
