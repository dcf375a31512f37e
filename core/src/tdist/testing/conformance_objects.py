"""Conformance bodies: the object collectives (picklable Python objects of different
sizes per rank), on the world and on a subgroup, roots given as global ranks and as
group ranks (``group_src``/``group_dst``)."""

from __future__ import annotations

import inspect
from typing import Any

from ._registry import body
from .helpers import GROUP_KINDS, Sub, assert_equal, assert_true, check_world_works, dist

__all__ = [
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "object_p2p",
    "objects_weights_only",
]

_GROUPS = [{"group": g} for g in GROUP_KINDS]


def _obj(rank: int) -> Any:
    """A different object, of a different pickled size, for every rank."""
    return {"rank": rank, "text": "x" * (rank * 37 + 1), "nested": [rank, (rank, None), {rank: 1.5}]}


@body(params=_GROUPS)
def broadcast_object_list(group: str = "world"):
    """Every member in turn broadcasts a list of objects; roots by src and by group_src."""
    s = Sub(group)
    if not s.is_member:
        return
    for i, src in enumerate(s.members):
        objects = [_obj(src), "tail", None] if s.rank == src else [None, None, None]
        dist.broadcast_object_list(objects, src=src, **s.kw)
        assert_equal(objects, [_obj(src), "tail", None], f"broadcast_object_list from rank {src}")
        objects = [_obj(src)] if s.rank == src else [None]
        dist.broadcast_object_list(objects, group_src=i, **s.kw)
        assert_equal(objects, [_obj(src)], f"broadcast_object_list from group rank {i}")


@body(params=_GROUPS)
def all_gather_object(group: str = "world"):
    """object_list[i] receives group rank i's object (objects of different sizes)."""
    s = Sub(group)
    if not s.is_member:
        return
    gathered: list[Any] = [None] * s.size
    dist.all_gather_object(gathered, _obj(s.rank), **s.kw)
    assert_equal(gathered, [_obj(m) for m in s.members], "all_gather_object")


#: The ranks whose :class:`_Tracked` objects this process has unpickled.
_UNPICKLED: list[int] = []


def _unpickle_tracked(rank: int) -> tuple[str, int]:
    _UNPICKLED.append(rank)
    return ("unpickled", rank)


class _Tracked:
    """An object whose unpickling is recorded in :data:`_UNPICKLED` of the unpickling process."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __reduce__(self) -> Any:
        return (_unpickle_tracked, (self.rank,))


@body(params=_GROUPS)
def gather_object(group: str = "world"):
    """Only the destination's list is filled, and only the destination unpickles the
    objects; destination by dst and by group_dst."""
    s = Sub(group)
    if not s.is_member:
        return
    for i, dst in enumerate(s.members):
        for how in ({"dst": dst}, {"group_dst": i}):
            out = [None] * s.size if s.rank == dst else None
            dist.gather_object(_obj(s.rank), out, **how, **s.kw)
            if s.rank == dst:
                assert_equal(out, [_obj(m) for m in s.members], f"gather_object to {how}")
    dst = s.members[-1]
    _UNPICKLED.clear()
    out = [None] * s.size if s.rank == dst else None
    dist.gather_object(_Tracked(s.rank), out, dst=dst, **s.kw)
    if s.rank == dst:
        assert_equal(out, [("unpickled", m) for m in s.members], "gather_object of tracked objects")
    assert_equal(
        sorted(_UNPICKLED),
        sorted(s.members) if s.rank == dst else [],
        f"objects unpickled on rank {s.rank} by gather_object to rank {dst}",
    )


@body(params=_GROUPS)
def scatter_object_list(group: str = "world"):
    """Group rank i receives item i of the source's list; source by src and by group_src."""
    s = Sub(group)
    if not s.is_member:
        return
    for i, src in enumerate(s.members):
        for how in ({"src": src}, {"group_src": i}):
            items = [_obj(m) for m in s.members] if s.rank == src else None
            out: list[Any] = [None]
            dist.scatter_object_list(out, items, **how, **s.kw)
            assert_equal(out[0], _obj(s.rank), f"scatter_object_list from {how}")


@body(min_world_size=2, params=[{"device": d} for d in (None, "cpu")])
def object_p2p(device: Any = None):
    """send_object_list / recv_object_list between ranks 0 and 1, by dst/src and by
    group_dst/group_src in a subgroup; recv returns the sender's global rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    kw = {} if device is None else {"device": device}
    if r == 0:
        dist.send_object_list([_obj(0), "two"], dst=1, **kw)
    elif r == 1:
        got: list[Any] = [None, None]
        sender = dist.recv_object_list(got, src=0, **kw)
        assert_equal(got, [_obj(0), "two"], "recv_object_list from rank 0")
        assert_true(sender == 0, f"recv_object_list returned {sender!r}, expected 0")
    members = [n - 1, 0]  # group ranks 0 -> global 0, 1 -> global n-1
    g = dist.new_group(members)
    if r == n - 1:
        dist.send_object_list([_obj(r)], group=g, group_dst=0, **kw)
    elif r == 0:
        got = [None]
        sender = dist.recv_object_list(got, group=g, group_src=1, **kw)
        assert_equal(got, [_obj(n - 1)], "recv_object_list from group rank 1")
        assert_true(sender == n - 1, f"recv_object_list returned {sender!r}, expected global rank {n - 1}")
    check_world_works("object p2p")


def _weights(rank: int) -> dict[str, Any]:
    import torch

    return {"weight": torch.arange(rank + 2, dtype=torch.float32) * rank, "step": rank, "names": [f"r{rank}"]}


def _plain(value: Any) -> Any:
    """``value`` with its tensors as lists (for comparison)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value.tolist() if hasattr(value, "tolist") else value


@body()
def objects_weights_only():
    """``weights_only=True`` (torch's option): objects travel as ``torch.save`` bytes and are read
    with ``torch.load(weights_only=True)``: tensors and plain containers arrive intact; an object
    whose loading would run code is refused on every receiving rank, and that code never runs."""
    if "weights_only" not in inspect.signature(dist.all_gather_object).parameters:
        return  # the reference run on torch.distributed before 2.15, which has no weights_only
    r, n = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, _weights(r), weights_only=True)
    assert_equal(_plain(gathered), [_plain(_weights(m)) for m in range(n)], "all_gather_object(weights_only=True)")
    objects = [_weights(n - 1)] if r == n - 1 else [None]
    dist.broadcast_object_list(objects, src=n - 1, weights_only=True)
    assert_equal(_plain(objects), [_plain(_weights(n - 1))], "broadcast_object_list(weights_only=True)")
    out: list[Any] = [None]
    dist.scatter_object_list(out, [_weights(m) for m in range(n)] if r == 0 else None, src=0, weights_only=True)
    assert_equal(_plain(out[0]), _plain(_weights(r)), "scatter_object_list(weights_only=True)")
    if n >= 2 and r in (0, 1):
        if r == 0:
            dist.send_object_list([_weights(0)], dst=1, weights_only=True)
        else:
            got: list[Any] = [None]
            dist.recv_object_list(got, src=0, weights_only=True)
            assert_equal(_plain(got), [_plain(_weights(0))], "send/recv_object_list(weights_only=True)")
    _UNPICKLED.clear()
    refused = None
    try:
        dist.all_gather_object(gathered, _Tracked(r), weights_only=True)
    except Exception as exc:  # torch.load's UnpicklingError
        refused = exc
    assert_true(refused is not None, "all_gather_object(weights_only=True) loaded an object that runs code")
    assert_equal(_UNPICKLED, [], "objects unpickled with weights_only=True")
    check_world_works("objects with weights_only")
