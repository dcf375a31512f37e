"""Handing a group's links to the group ``shrink_group`` makes of it (a part of
:class:`~tdist_tcp.net.transport.Transport`; :mod:`tdist_tcp.regroup` runs the shrink).

The old transport *retires* (:meth:`Handover.retire`): its operations fail, it starts and
accepts no connection, and it gives up its links, which the new transport *adopts*
(:meth:`Handover.adopt`): it sends a MARK on each (the first frame of the link's new
epoch, see :mod:`tdist_tcp.net.links`) and reads them from their next frame on. A connection
the old transport was still opening when it retired is handed over when it is made
(:meth:`Handover._forward`): the peer accepted it before it retired, so it took it over too.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from tdist.plugin import DistBackendError

from .links import Link, Peer, close_links, send_mark

if TYPE_CHECKING:
    from .mesh import Mesh
    from .transport import Transport

__all__ = ["Handover"]


class Handover:
    """A transport's links changing hands (a mixin of Transport)."""

    epoch: int
    retired: bool
    successor: Optional[tuple["Transport", Mapping[int, int]]]
    timeout: float
    peers: list[Optional[Peer]]
    mesh: Optional["Mesh"]
    _lock: threading.Lock
    _linked: threading.Condition
    _closing: bool

    if TYPE_CHECKING:  # (Transport's own)

        @property
        def me(self) -> str: ...

        def fail(self, err: DistBackendError, notify: bool = True) -> None: ...

        def link_lost(self, link: Link, current: Any, problem: Optional[str]) -> None: ...

    def retire(
        self, error: DistBackendError, successor: "Transport", index: Mapping[int, int]
    ) -> dict[int, list[Link]]:
        """Give up every peer's links, for the group a shrink makes (:mod:`tdist_tcp.regroup`;
        ``successor`` its transport, ``index`` its rank of each peer that stays): fail every
        pending and later operation with ``error`` (the peers are not told), start no
        connection and accept none, and return the links by peer, their frames of this
        group dropped; :meth:`close` then touches none of them. A connection this rank was
        still opening goes to ``successor`` when it is made (:meth:`_forward`)."""
        self.fail(error, notify=False)
        with self._lock:
            self.retired = True
            self.successor = (successor, index)
            self.mesh = None
            taken: dict[int, list[Link]] = {}
            for peer in self.peers:
                if peer is not None and peer.links:
                    taken[peer.rank], peer.links = peer.links, []
                    for link in taken[peer.rank]:
                        link.coll_stash.clear()  # (posted receives were failed; broken: no more stashed)
            self._linked.notify_all()
        return taken

    def adopt(self, rank: int, links: Sequence[Link], limit: float) -> bool:
        """Make another transport's ``links`` (see :meth:`retire`) ``rank``'s: read for this
        transport from their next frame on, delivered once the peer's MARK of this epoch
        came; this rank's MARK goes out first (after the rest of a frame cut short). False
        (nothing adopted) if a MARK could not be sent within ``limit`` s."""
        with self._lock:
            peer = self.peers[rank]
            assert peer is not None
            if peer.links or peer.incoming or self._closing:  # (it has its own by now: a late one is closed)
                return False
            peer.incoming = True  # (its connect waits meanwhile)
        marked = all(send_mark(link, self, self.epoch, limit) for link in links)
        with self._lock:
            peer.incoming = False
            if marked:
                peer.links = list(links)
            self._linked.notify_all()
        if not marked:
            return False
        for link in links:
            link.hand_over(self, peer)
            if link.ended.is_set():  # (its reader may have ended before the hand-over: this owner learns it)
                self.link_lost(link, None, "it closed the connection while the group was shrunk")
        return True

    def _forward(self, rank: int, links: list[Link]) -> None:
        """Hand links that this retired transport got late (a connection it was still
        opening when it retired) to the successor, which takes them as the kept ones (the
        peer, which accepted them before it retired, took them over too); closed if the
        successor has this peer's links already."""
        assert self.successor is not None
        successor, index = self.successor
        if not successor.adopt(index[rank], links, min(self.timeout, 5.0)):
            close_links(links, DistBackendError(f"tcp backend: {self.me}'s process group was shrunk"))
