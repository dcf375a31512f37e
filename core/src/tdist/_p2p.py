"""Point-to-point operations: send/recv, isend/irecv and batched P2P.

Messages between one pair of ranks (with the same tag) arrive in the order they
were sent. ``recv``/``irecv`` with ``src=None`` receive from any rank, on the
backends that declare ``recv_anysource``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._dispatch import contiguous_view, device_type, issue
from ._errors import DistError
from ._groups import ProcessGroup, resolve_group, warn_not_member
from ._observe import rejected
from ._validate import check_tensor, peer_rank
from ._work import Work

if TYPE_CHECKING:
    import torch

__all__ = ["send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv"]


def _check_tag(operation: str, tag: Any) -> int:
    if not isinstance(tag, int) or isinstance(tag, bool):
        raise TypeError(f"{operation}: tag must be an int, got {tag!r}")
    return tag


def _isend(
    operation: str, tensor: "torch.Tensor", dst: Optional[int], group: Any, tag: int, group_dst: Optional[int]
) -> tuple[Optional[ProcessGroup], Optional[Work]]:
    check_tensor(operation, "tensor", tensor)
    _check_tag(operation, tag)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member(operation)
        return None, None
    peer = peer_rank(operation, pg, "dst", dst, group_dst, allow_self=False)
    t = contiguous_view(tensor, None, output=False)
    return pg, issue(
        pg, "send", device_type(tensor), lambda b: b.send(t, peer, tag), True, (), (tensor,), peer=peer, tag=tag
    )


def _irecv(
    operation: str, tensor: "torch.Tensor", src: Optional[int], group: Any, tag: int, group_src: Optional[int]
) -> tuple[Optional[ProcessGroup], Optional[Work]]:
    check_tensor(operation, "tensor", tensor)
    _check_tag(operation, tag)
    pg = resolve_group(group)
    if pg is None:
        warn_not_member(operation)
        return None, None
    if src is None and group_src is None:
        peer: Optional[int] = None
        pg.backend_for(device_type(tensor), "recv_anysource")
        if pg.size == 1:
            raise ValueError(f"{operation}: src=None in a group of one rank: there is no other rank to receive from")
    else:
        peer = peer_rank(operation, pg, "src", src, group_src, allow_self=False)
    copies: list = []
    t = contiguous_view(tensor, copies, output=True)
    return pg, issue(
        pg, "recv", device_type(tensor), lambda b: b.recv(t, peer, tag), True, copies, (tensor,), peer=peer, tag=tag
    )


@rejected("isend")
def isend(
    tensor: "torch.Tensor",
    dst: Optional[int] = None,
    group: Any = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> Optional[Work]:
    """Start sending ``tensor`` to global rank ``dst``; returns a Work. Do not modify
    ``tensor`` until the Work completes."""
    return _isend("isend", tensor, dst, group, tag, group_dst)[1]


@rejected("irecv")
def irecv(
    tensor: "torch.Tensor",
    src: Optional[int] = None,
    group: Any = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> Optional[Work]:
    """Start receiving into ``tensor`` from global rank ``src`` (None: any rank);
    returns a Work whose ``source_rank()`` is the sender's group rank."""
    return _irecv("irecv", tensor, src, group, tag, group_src)[1]


@rejected("send")
def send(
    tensor: "torch.Tensor",
    dst: Optional[int] = None,
    group: Any = None,
    tag: int = 0,
    group_dst: Optional[int] = None,
) -> None:
    """Send ``tensor`` to global rank ``dst``; blocks until the backend has taken it."""
    _, work = _isend("send", tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


@rejected("recv")
def recv(
    tensor: "torch.Tensor",
    src: Optional[int] = None,
    group: Any = None,
    tag: int = 0,
    group_src: Optional[int] = None,
) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: from any rank).
    Returns the sender's global rank (-1 if this rank is not in ``group``)."""
    pg, work = _irecv("recv", tensor, src, group, tag, group_src)
    if pg is None or work is None:
        return -1
    work.wait()
    return pg.ranks[work.source_rank()]


@dataclass(eq=False)
class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``op`` is ``tdist.isend`` or ``tdist.irecv``."""

    op: Callable[..., Any]
    tensor: "torch.Tensor"
    peer: Optional[int] = None
    group: Any = None
    tag: int = 0
    group_peer: Optional[int] = None

    def __post_init__(self) -> None:
        if self.op not in (isend, irecv):
            raise ValueError(f"P2POp: op must be tdist.isend or tdist.irecv, got {self.op!r}")
        if self.peer is None and self.group_peer is None:
            raise ValueError("P2POp: peer (or group_peer) is required")


@rejected("batch_isend_irecv")
def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of ``p2p_op_list`` and return their Works, in order.

    Sends and receives of one batch never deadlock each other, whatever their order.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    for i, item in enumerate(p2p_op_list):
        if not isinstance(item, P2POp):
            raise TypeError(f"batch_isend_irecv: item {i} is {type(item).__name__}, not a P2POp")
    works: dict[int, Work] = {}
    order = sorted(range(len(p2p_op_list)), key=lambda i: p2p_op_list[i].op is isend)  # post receives first
    for i in order:
        item = p2p_op_list[i]
        start = _isend if item.op is isend else _irecv
        work = start("batch_isend_irecv", item.tensor, item.peer, item.group, item.tag, item.group_peer)[1]
        if work is None:
            raise DistError(f"batch_isend_irecv: this rank is not a member of the group of operation {i}")
        works[i] = work
    return [works[i] for i in range(len(p2p_op_list))]
