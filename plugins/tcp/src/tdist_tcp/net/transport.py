"""Frames over a group's links: posted receives, stashes, failure, and connections made when first needed.

Every link (connection to a peer) of every group of the process is read by the one I/O
loop thread of :mod:`tdist_tcp.net.ioloop`: a link's reader (:class:`~tdist_tcp.net.links.Link`)
reads each frame's header and hands the payload to the receive posted for it, reading
straight into the destination tensor (zero copy, non-blocking ``recv_into`` calls
resumed whenever the socket has more); a frame nobody waits for yet goes into a freshly
allocated buffer in that peer's stash, from which the next matching receive copies it
once it is complete. Posting a receive never waits for a stashed frame still arriving (a
rank that starts a collective late must start its own sends at once, or its link idles
while its peer's data comes in). Sends are made by the calling threads (blocking, with
``SO_SNDTIMEO`` slices, one frame at a time per link).

- Connections are made when first needed: the first frame to a peer, or the first
  collective receive posted from it, connects to it (:meth:`Transport.connect`, through
  the group's :class:`~tdist_tcp.net.mesh.Mesh`), unless the peer connected first (its
  connection is accepted by the listener, which the I/O loop serves for the group's
  lifetime). When both ends connect at once, the connection opened by the lower rank
  is kept: the higher rank's is refused with a DUPLICATE verdict and it waits for the
  other one.
- A pair of ranks may use several connections (*links*, the ``streams`` option):
  segment ``k`` of a collective travels on link ``k % links``, P2P, acknowledgement
  and control frames on link 0, so both ends agree where each frame goes.
- Collective frames from one peer's link are matched FIFO and their header (operation,
  reduce op, sequence number, dtype, size) must be what the receiver expects; a
  mismatch fails the group everywhere (ABORT frames carry the reason to the peers).
- P2P frames match posted receives by (source or any source, tag) in posting order;
  frames between a pair stay in order. A size or dtype mismatch fails that receive only.
- A connected peer whose connection ends without a BYE frame (crash, reset) breaks the
  group: every pending and later operation raises. A peer that said BYE (destroyed its
  group) only fails the operations that need it.
- A collective that times out asks every peer which collective it has reached
  (PROBE/STATE frames, answered by the peers' I/O loops; see :mod:`tdist_tcp.net.verdicts`)
  to name the ranks that did not arrive; the ABORT frames that break the group carry
  that verdict, so every rank raises the same :class:`DistBackendTimeoutError` naming them.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from tdist.plugin import DistBackendError

from .ioloop import io_loop
from .links import (
    ABORT_REASON_CHARS,
    FrameTimeout,
    Link,
    Peer,
    PostedRecv,
    Stashed,
    clip_reason,
    close_links,
    send_control,
    timeout_error,
)
from .handover import Handover
from .verdicts import Verdicts
from ..protocol.wire import BYE, pack_header

if TYPE_CHECKING:
    from ..collectives.algorithms import Coll
    from .mesh import Mesh

__all__ = ["Transport", "PostedRecv", "FrameTimeout", "clip_reason", "ABORT_REASON_CHARS"]

_SMALL_SEND = 16 << 10  # payloads up to this size are sent joined to their header
_SEND_SLICE = 0.5  # seconds a blocked send waits before it checks the group and its own timeout


class Transport(Handover, Verdicts):
    """The links to the peers of one group and the matching of frames to receives."""

    def __init__(
        self,
        rank: int,
        size: int,
        sockets: Mapping[int, Sequence[socket.socket]],
        timeout: float,
        global_ranks: Optional[Sequence[int]] = None,
        mesh: Optional["Mesh"] = None,
        epoch: int = 0,
    ) -> None:
        """``sockets``: connections already made, by peer; ``mesh``: makes the others when
        first needed (without one, a peer not in ``sockets`` cannot be reached); ``epoch``:
        how many shrinks made this group from the one built by the factory (see
        :mod:`tdist_tcp.net.links`: the links' frames are this transport's in that epoch)."""
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.mesh = mesh
        self.epoch = epoch
        self.retired = False  # its links went to the group a shrink made (see retire)
        #: that group's transport and its rank of each peer here (see retire)
        self.successor: Optional[tuple["Transport", Mapping[int, int]]] = None
        self._global = list(global_ranks) if global_ranks else list(range(size))
        self._lock = threading.Lock()
        self._linked = threading.Condition(self._lock)  # a peer got its links (or a connect attempt ended)
        self._p2p_posted: list[PostedRecv] = []
        self._arrivals = 0
        self.broken: Optional[DistBackendError] = None
        self._told_peers = False  # ABORT frames sent (once per rank)
        self._closing = False
        self._helpers: list[threading.Thread] = []
        self._break_callbacks: list[Callable[[], None]] = []
        self.peers: list[Optional[Peer]] = [None if q == rank else Peer(q, self.label(q)) for q in range(size)]
        #: collectives this rank has issued (the backend counts them; peers' probes read it)
        self.issued = 0
        self._probe_seq = 0
        self._probe_replies: dict[int, int] = {}
        self._probe_cv = threading.Condition(self._lock)
        for peer_rank, socks in sockets.items():
            self.attach(peer_rank, socks)
        if mesh is not None:
            mesh.serve(self)

    # ------------------------------------------------------------------ names
    def label(self, rank: int) -> str:
        if rank < len(self._global) and self._global[rank] != rank:
            return f"rank {rank} (global {self._global[rank]})"
        return f"rank {rank}"

    @property
    def me(self) -> str:
        return self.label(self.rank)

    def gone_error(self, message: str, peer: Optional[Peer]) -> DistBackendError:
        """A :class:`DistBackendError` that is the consequence of ``peer``'s failure (None:
        a peer, not known which): ``failed_peer`` names its global rank."""
        err = DistBackendError(message)
        err.failed_peer = -1 if peer is None else self._global[peer.rank]
        return err

    def peer_error(self, peer: Peer) -> DistBackendError:
        """The error of an operation with ``peer``, which can no longer be reached."""
        err = DistBackendError(peer.closed)
        err.failed_peer = peer.failed
        return err

    # ------------------------------------------------------------ connections
    def connect(self, peer: Peer, limit: Optional[float] = None, broken_too: bool = False) -> None:
        """Make sure ``peer`` has its links: connect to it (in this thread) unless it is
        connected or connecting to this rank, within ``limit`` s (default: the group's
        timeout); raises why not (the group's error if it is broken, unless ``broken_too``:
        to tell the peer why)."""
        deadline = time.monotonic() + (self.timeout if limit is None else limit)
        while True:
            with self._lock:
                while not peer.links:
                    if self.broken is not None and not broken_too:
                        raise self.broken
                    if peer.closed is not None:
                        raise self.peer_error(peer)
                    now = time.monotonic()
                    waiting = peer.expect > now
                    if not (peer.connecting or peer.incoming or waiting):
                        break
                    if now >= deadline:
                        raise timeout_error(
                            f"tcp backend: {self.me} timed out after {self.timeout:g} s waiting for "
                            f"{peer.label} to connect",
                            [peer.rank],
                        )
                    self._linked.wait(min(deadline - now, peer.expect - now if waiting else 1.0))
                if peer.links:
                    return
                if self.mesh is None or self._closing or self.retired:
                    raise DistBackendError(f"tcp backend: {self.me} has no connection to {peer.label}")
                peer.connecting = True
            socks: Optional[list[Any]] = None
            ok = False
            late: list[Link] = []
            try:
                socks = self.mesh.connect(peer.rank, deadline)
                ok = True
            except ConnectionRefusedError:
                err = self.gone_error(
                    f"tcp backend: {peer.label} refuses connections from {self.me}: it has shut down its "
                    "process group (or exited)",
                    peer,
                )
                with self._lock:
                    if peer.closed is None:
                        peer.closed, peer.failed = str(err), err.failed_peer
                raise err from None
            finally:
                with self._lock:
                    peer.connecting = False
                    if socks:
                        late = self._attach_locked(peer, socks)
                    elif ok:  # the peer is connecting to this rank: wait for it a while, then try again
                        peer.expect = time.monotonic() + 1.0
                    self._linked.notify_all()
                if late:
                    self._forward(peer.rank, late)

    def admit(self, rank: int) -> bool:
        """Whether to accept a connection that ``rank`` is opening (its first stream, proved):
        not when connected already, nor when this lower rank is connecting to it (the
        lower rank's connection wins). Called by the listener in the I/O loop."""
        with self._lock:
            peer = self.peers[rank] if 0 <= rank < self.size else None
            if peer is None or self._closing or self.retired or peer.links or peer.closed is not None:
                return False
            if peer.connecting and self.rank < rank:
                return False
            peer.incoming = True
            return True

    def incoming_failed(self, rank: int) -> None:
        """A connection ``rank`` was opening was dropped before all its streams arrived."""
        with self._lock:
            peer = self.peers[rank]
            if peer is not None:
                peer.incoming = False
                self._linked.notify_all()

    def attach(self, rank: int, socks: Sequence[Any]) -> None:
        """Give ``rank`` these connected, authenticated sockets (its streams, stream 0 first)."""
        with self._lock:
            peer = self.peers[rank]
            assert peer is not None
            late = self._attach_locked(peer, socks)
            self._linked.notify_all()
        if late:
            self._forward(rank, late)

    def _attach_locked(self, peer: Peer, socks: Sequence[Any]) -> list[Link]:
        """Make ``socks`` ``peer``'s links; the links to hand to the successor instead (see
        :meth:`_forward`) when this transport is retired."""
        peer.incoming, peer.expect = False, 0.0
        late = self.retired and self.successor is not None and peer.rank in self.successor[1]
        if (self._closing or self.retired or peer.links) and not late:  # too late, or a second set: closed
            for sock in socks:
                sock.close()
            return []
        slice_s = min(self.timeout, _SEND_SLICE)
        sndtimeo = struct.pack("ll", int(slice_s), int((slice_s % 1) * 1e6))
        for sock in socks:
            try:  # a blocked send returns after this long (see _push)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, sndtimeo)
            except (OSError, OverflowError):
                pass
        links = [Link(i, sock, peer, self) for i, sock in enumerate(socks)]
        loop = io_loop()
        for link in links:
            loop.register(link.sock, link)
        if late:
            return links
        peer.links = links
        return []

    # ---------------------------------------------------------------- sending
    def send(self, dst: int, header: bytes, payload: memoryview, coll: Optional["Coll"] = None, part: int = 0) -> None:
        """Send one frame to ``dst`` (frames on one link never interleave); ``coll``: the
        collective it belongs to (named if the send times out), ``part`` the frame's
        number in it (which picks the link)."""
        peer = self.peers[dst]
        if self.broken is not None:
            raise self.broken
        if peer is None:
            raise DistBackendError(f"tcp backend: {self.me} cannot send to itself")
        if peer.closed is not None:
            raise self.peer_error(peer)
        if not peer.links:
            self.connect(peer)
        n = len(payload)
        link = peer.link_of(part)
        sent = -1
        try:
            with link.send_lock:
                if link.sender is not self:  # handed to the group a shrink made
                    raise self.broken or DistBackendError(f"tcp backend: {self.me}'s process group was shrunk")
                sock = link.sock
                if n <= _SMALL_SEND:
                    data = header + payload if n else header
                    try:
                        sent = sock.send(data)
                    except (BlockingIOError, InterruptedError):  # nothing sent within SO_SNDTIMEO
                        sent = 0
                    if sent < len(data):
                        self._push(link, memoryview(data)[sent:], b"")
                else:
                    try:
                        sent = sock.sendmsg([header, payload])
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    if sent < len(header) + n:
                        self._push(
                            link,
                            memoryview(header)[sent:] if sent < len(header) else b"",
                            payload[max(0, sent - len(header)) :],
                        )
                sent = -2  # the whole frame is out
        except OSError as exc:
            raise self._send_failed(peer, exc, coll) from None
        except BaseException as exc:  # an interrupt (KeyboardInterrupt) of the sending thread
            if sent >= 0 and not isinstance(exc, Exception):  # a frame cut short: the link is lost
                err = DistBackendError(
                    f"tcp backend: {self.me} was interrupted ({type(exc).__name__}) while sending to "
                    f"{peer.label}; its group is broken"
                )
                err.__cause__ = exc
                self.fail(err)
            raise

    def _push(self, link: Link, first: Any, rest: Any) -> None:
        """Send the rest of a frame (with the peer's send lock held). Each blocked call
        returns after SO_SNDTIMEO (a fraction of a second), so a group broken meanwhile
        ends the wait at once, and a peer that took nothing for the group's timeout
        raises ``socket.timeout``; a frame cut short leaves ``link.owed`` bytes owed."""
        sock = link.sock
        parts = [memoryview(p) for p in (first, rest) if len(p)]
        stalled = 0.0
        try:
            while parts:
                try:
                    sent = sock.sendmsg(parts)
                except (BlockingIOError, InterruptedError):  # no progress for one SO_SNDTIMEO
                    stalled += min(self.timeout, _SEND_SLICE)
                    if self.broken is not None or stalled >= self.timeout:
                        raise socket.timeout("send timed out") from None
                    continue
                stalled = 0.0
                while sent and parts:
                    if sent >= len(parts[0]):
                        sent -= len(parts[0])
                        parts.pop(0)
                    else:
                        parts[0] = parts[0][sent:]
                        sent = 0
        except BaseException:
            link.owed = sum(len(p) for p in parts)
            raise

    def _send_failed(self, peer: Peer, exc: OSError, coll: Optional["Coll"] = None) -> DistBackendError:
        if self.broken is not None:
            return self.broken
        if peer.closed is not None:
            return self.peer_error(peer)
        if peer.said_bye:  # it destroyed its group; its link's reader has not seen the EOF yet
            return self.gone_error(
                f"tcp backend: {peer.label} has shut down its process group; {self.me} cannot communicate with it",
                peer,
            )
        if isinstance(exc, (BlockingIOError, socket.timeout)):
            with self._lock:  # a frame was cut short: nothing more may be sent on this connection
                if peer.closed is None:
                    peer.closed = f"tcp backend: {peer.label} stopped reading its connection from {self.me}"
            if coll is not None:
                err: DistBackendError = self.collective_timeout(
                    coll, peer.rank, f"sending to {peer.label}, which stopped reading"
                )
            else:
                err = timeout_error(
                    f"tcp backend: {self.me} timed out after {self.timeout:g} s sending to "
                    f"{peer.label} (it stopped reading its connection)",
                    [peer.rank],
                )
        else:
            err = self.gone_error(
                f"tcp backend: {self.me} lost its connection to {peer.label} while sending "
                f"({type(exc).__name__}: {exc}); that rank probably died",
                peer,
            )
        self.fail(err)
        return err

    # ------------------------------------------------------------ collectives
    def post_coll(
        self, src: int, dest: memoryview, op: int, redop: int, seq: int, dtype: int, part: int = 0
    ) -> PostedRecv:
        """Post the receive of the next collective frame from ``src`` into ``dest``; the
        frame must be ``part`` (the algorithm's step/segment number) of that collective."""
        pr = PostedRecv(src, dest, op, redop, seq, dtype, part)
        peer = self.peers[src]
        assert peer is not None  # never this rank
        if not peer.links:
            self.connect(peer)
        link = peer.link_of(part)
        with self._lock:
            if self.broken is not None:
                raise self.broken
            if link.coll_stash:
                stashed = link.coll_stash.popleft()
            elif peer.closed is not None:
                raise self.peer_error(peer)
            else:
                link.coll_posted.append(pr)
                return pr
        if (
            stashed.op != op
            or stashed.redop != redop
            or stashed.seq != seq
            or stashed.dtype != dtype
            or stashed.nbytes != pr.nbytes
            or stashed.tag != part
        ):
            err = self._mismatch(
                pr, peer, stashed.op, stashed.redop, stashed.seq, stashed.dtype, stashed.nbytes, stashed.tag
            )
            self.fail(err)
            raise err
        self._claim(pr, stashed)
        return pr

    def _claim(self, pr: PostedRecv, stashed: Stashed) -> None:
        """Complete ``pr`` with ``stashed`` as soon as that frame is fully read: now if it
        is, else from its link's reader (posting never waits for a frame still arriving). A group
        broken meanwhile fails it, as it fails the receives still posted."""

        def land(error: Optional[BaseException]) -> None:
            if error is None:
                error = self.broken
            if error is None and pr.nbytes:
                pr.dest[:] = stashed.data
            pr.finish(error)

        stashed.deliver_to(land)

    def wait_coll(self, pr: PostedRecv, deadline: float) -> None:
        """Wait for a posted collective receive; raise its error, or :class:`FrameTimeout`."""
        if pr.done.acquire(True, max(0.0, deadline - time.monotonic())):
            if pr.error is not None:
                raise pr.error
            return
        assert pr.src is not None
        peer = self.peers[pr.src]
        assert peer is not None
        with self._lock:
            try:
                peer.link_of(pr.tag).coll_posted.remove(pr)
            except ValueError:
                pass
        raise FrameTimeout(peer.rank, pr.op, pr.nbytes, pr.tag)

    # ------------------------------------------------------------------ p2p
    def post_p2p(
        self, src: Optional[int], tag: int, dtype: int, dest: memoryview, callback: Callable[[PostedRecv], None]
    ) -> PostedRecv:
        """Post a P2P receive (``src`` None: any source); ``callback`` runs on completion."""
        pr = PostedRecv(src, dest, 0, 0, 0, dtype, tag, callback)
        with self._lock:
            if self.broken is not None:
                raise self.broken
            found: Optional[tuple[Peer, Stashed]] = None
            if src is not None:
                peer = self.peers[src]
                assert peer is not None  # never this rank
                for stashed in peer.p2p_stash:
                    if stashed.tag == tag:
                        found = (peer, stashed)
                        break
                if found is None and peer.closed is not None:
                    raise self.peer_error(peer)
            else:
                for peer in self.peers:
                    if peer is None:
                        continue
                    for stashed in peer.p2p_stash:
                        if stashed.tag == tag:
                            if found is None or stashed.arrival < found[1].arrival:
                                found = (peer, stashed)
                            break
                if found is None and all(p is None or p.closed is not None for p in self.peers):
                    raise self.gone_error(
                        f"tcp backend: {self.me} cannot receive from any rank: all peers are gone", None
                    )
            if found is None:
                self._p2p_posted.append(pr)
                return pr
            found[0].p2p_stash.remove(found[1])
        peer, stashed = found
        pr.source = peer.rank
        if stashed.dtype != dtype or stashed.nbytes != pr.nbytes:
            pr.finish(self._p2p_mismatch(pr, peer, stashed.dtype, stashed.nbytes, stashed.shape))
            return pr
        self._claim(pr, stashed)
        return pr

    def cancel_p2p(self, pr: PostedRecv) -> bool:
        """Withdraw a posted P2P receive that nothing matched yet; True if withdrawn."""
        with self._lock:
            try:
                self._p2p_posted.remove(pr)
            except ValueError:
                return False
        return True

    # ----------------------------------------------------- the links' readers
    def on_coll(
        self, peer: Peer, link: Link, op: int, redop: int, seq: int, dtype: int, nbytes: int, shape: tuple, part: int
    ) -> tuple[Optional[memoryview], Any]:
        with self._lock:
            if self.broken is not None:
                return None, None
            if not link.coll_posted:
                self._arrivals += 1
                stashed = Stashed(op, redop, seq, dtype, part, nbytes, shape, self._arrivals)
                link.coll_stash.append(stashed)
                return memoryview(stashed.data), stashed
            pr = link.coll_posted.popleft()
        if (
            pr.op != op
            or pr.redop != redop
            or pr.seq != seq
            or pr.dtype != dtype
            or pr.nbytes != nbytes
            or pr.tag != part
        ):
            err = self._mismatch(pr, peer, op, redop, seq, dtype, nbytes, part)
            pr.finish(err)
            self.fail(err)
            return None, None
        return pr.dest, pr

    def on_p2p(
        self, peer: Peer, tag: int, dtype: int, seq: int, nbytes: int, shape: tuple
    ) -> tuple[Optional[memoryview], Any]:
        with self._lock:
            if self.broken is not None:
                return None, None
            found = None
            for index, pr in enumerate(self._p2p_posted):
                if pr.tag == tag and (pr.src is None or pr.src == peer.rank):
                    found = pr
                    del self._p2p_posted[index]
                    break
            if found is None:
                self._arrivals += 1
                stashed = Stashed(0, 0, seq, dtype, tag, nbytes, shape, self._arrivals)
                peer.p2p_stash.append(stashed)
                return memoryview(stashed.data), stashed
        found.source = peer.rank
        if found.dtype != dtype or found.nbytes != nbytes:
            found.finish(self._p2p_mismatch(found, peer, dtype, nbytes, shape))
            return None, None
        return found.dest, found

    def link_lost(self, link: Link, current: Any, problem: Optional[str]) -> None:
        """``link``'s reader ended (``problem``: why, None after the peer's BYE); called by the loop."""
        peer = link.peer
        if self._closing:
            err = DistBackendError(f"tcp backend: {self.me}'s process group was destroyed")
        elif problem is None:
            err = self.gone_error(
                f"tcp backend: {peer.label} has shut down its process group; {self.me} cannot communicate with it",
                peer,
            )
        else:
            err = self.gone_error(
                f"tcp backend: {self.me} lost its connection to {peer.label} ({problem}); that rank probably died",
                peer,
            )
        if current is not None:
            current.finish(err)
        self._peer_gone(peer, err, crashed=problem is not None and not self._closing)

    # ---------------------------------------------------------------- closing
    def abort(self, wait: float = 5.0) -> None:
        """Break the group and tell every peer (ABORT frames, connecting to those never
        connected), waiting up to ``wait`` s for that before the caller closes."""
        self.fail(DistBackendError(f"tcp backend: {self.me} aborted its process group"))
        deadline = time.monotonic() + wait
        for helper in list(self._helpers):
            helper.join(max(0.0, deadline - time.monotonic()))

    def close(self, linger: float = 1.0) -> None:
        """Say BYE to every connected peer, close the connections and the listener, and let
        the I/O loop go of them. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.broken is None:
            self.fail(DistBackendError(f"tcp backend: {self.me}'s process group was destroyed"), notify=False)
        with self._lock:
            links = [(peer, link) for peer in self.peers if peer is not None for link in peer.links]
        bye = pack_header(BYE, 0, 0, 0, 0, 0, 0)
        for peer, link in links:
            if peer.closed is None:
                send_control(link, bye, 1.0, self)
            try:
                link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + linger  # let the peers' BYEs arrive (avoids resets)
        for _peer, link in links:
            link.ended.wait(max(0.0, deadline - time.monotonic()))
        if self.mesh is not None:
            self.mesh.close()
        close_links(
            [link for _peer, link in links], DistBackendError(f"tcp backend: {self.me}'s process group was destroyed")
        )
        if not self.retired:  # (a retired group's helper may still be connecting: nothing of it is needed)
            for helper in self._helpers:
                helper.join(3.0)
        io_loop().settle()

    def threads(self) -> list[threading.Thread]:
        """The threads serving this group: the I/O loop's while it reads its links, and helpers."""
        loop = io_loop().thread()
        serving = loop is not None and (self.mesh is not None or any(p.links for p in self.peers if p is not None))
        return ([loop] if loop is not None and serving and not self._closing else []) + self._helpers
