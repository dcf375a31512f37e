"""Frames over the mesh of sockets: one reader thread per connection, posted receives, stashes.

A reader thread reads each frame's header and hands the payload to the receive
posted for it, reading straight into the destination tensor (zero copy); a frame
nobody waits for yet goes into a freshly allocated buffer in that peer's stash,
from which the next matching receive copies it once it is complete. Posting a receive
never waits for a stashed frame still arriving (a rank that starts a collective late
must start its own sends at once, or its link idles while its peer's data comes in).

- A pair of ranks may use several connections (*links*, the ``streams`` option):
  segment ``k`` of a collective travels on link ``k % links``, P2P, acknowledgement
  and control frames on link 0, so both ends agree where each frame goes.
- Collective frames from one peer's link are matched FIFO and their header (operation,
  reduce op, sequence number, dtype, size) must be what the receiver expects; a
  mismatch fails the group everywhere (ABORT frames carry the reason to the peers).
- P2P frames match posted receives by (source or any source, tag) in posting order;
  frames between a pair stay in order. A size or dtype mismatch fails that receive only.
- A peer whose connection ends without a BYE frame (crash, reset) breaks the group:
  every pending and later operation raises. A peer that said BYE (destroyed its group)
  only fails the operations that need it.
- A collective that times out asks every peer which collective it has reached
  (PROBE/STATE frames, answered by the peers' reader threads) to name the ranks that
  did not arrive; the ABORT frames that break the group carry that verdict, so every
  rank raises the same :class:`DistBackendTimeoutError` naming them.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import numpy as np
from tdist.plugin import DistBackendError, DistBackendTimeoutError

from .wire import (
    ABORT,
    BYE,
    COLL,
    FRAME_MAGIC,
    HEADER,
    OP_ACK,
    P2P,
    PROBE,
    STATE,
    describe,
    dtype_name,
    pack_header,
    part_name,
)

if TYPE_CHECKING:
    from .algorithms import Coll

__all__ = ["Transport", "PostedRecv", "FrameTimeout"]

_READ_BUFFER = 64 << 10  # a reader's buffered chunk (headers and small payloads)
_SMALL_SEND = 16 << 10  # payloads up to this size are sent joined to their header
_SEND_SLICE = 0.5  # seconds a blocked send waits before it checks the group and its own timeout
_READ_AHEAD = 8 << 10  # bytes a reader asks for beyond the header it needs
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


class PostedRecv:
    """A receive waiting for one frame. Collective receives complete by releasing
    ``done``; P2P receives call ``callback(self)`` instead."""

    __slots__ = ("src", "dest", "nbytes", "op", "redop", "seq", "dtype", "tag", "done", "error", "source", "callback")

    def __init__(
        self,
        src: Optional[int],
        dest: memoryview,
        op: int,
        redop: int,
        seq: int,
        dtype: int,
        tag: int = 0,
        callback: Optional[Callable[["PostedRecv"], None]] = None,
    ) -> None:
        self.src = src
        self.dest = dest
        self.nbytes = len(dest)
        self.op = op
        self.redop = redop
        self.seq = seq
        self.dtype = dtype
        self.tag = tag
        self.error: Optional[BaseException] = None
        self.source = -1 if src is None else src
        self.callback = callback
        self.done = threading.Lock()
        self.done.acquire()

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Complete the receive (called exactly once, by whoever took it off a list)."""
        self.error = error
        if self.callback is None:
            self.done.release()
            return
        try:  # completes a Work, which runs its done-callbacks: never let them break a reader
            self.callback(self)
        except Exception:
            pass


class _Stashed:
    """A frame that arrived before its receive was posted. The receive that claims it
    gets its data through :meth:`deliver_to` as soon as the frame is fully read, without
    waiting for the rest of it to arrive (the reader thread delivers what is still coming)."""

    __slots__ = (
        "op",
        "redop",
        "seq",
        "dtype",
        "tag",
        "nbytes",
        "shape",
        "data",
        "error",
        "arrival",
        "_guard",
        "_complete",
        "_then",
    )

    def __init__(
        self, op: int, redop: int, seq: int, dtype: int, tag: int, nbytes: int, shape: tuple, arrival: int
    ) -> None:
        self.op, self.redop, self.seq, self.dtype, self.tag = op, redop, seq, dtype, tag
        self.nbytes = nbytes
        self.shape = shape
        self.data: Any = np.empty(nbytes, dtype=np.uint8)  # a buffer (numpy's stubs do not say so)
        self.error: Optional[BaseException] = None
        self.arrival = arrival
        self._guard = threading.Lock()
        self._complete = False
        self._then: Optional[Callable[[Optional[BaseException]], None]] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        """The frame is fully read (or never will be: ``error``); called by its reader."""
        with self._guard:
            self.error = error
            self._complete = True
            then, self._then = self._then, None
        if then is not None:
            then(error)

    def deliver_to(self, then: Callable[[Optional[BaseException]], None]) -> None:
        """Call ``then(error)`` once the frame is complete: now if it is, else from the reader."""
        with self._guard:
            if not self._complete:
                self._then = then
                return
        then(self.error)


class _Link:
    """One connection (stream) to a peer: its socket, its reader, and the collective
    frames it carries, matched FIFO."""

    __slots__ = ("index", "sock", "send_lock", "coll_posted", "coll_stash", "said_bye", "reader")

    def __init__(self, index: int, sock: socket.socket) -> None:
        self.index = index
        self.sock = sock
        self.send_lock = threading.Lock()
        self.coll_posted: deque[PostedRecv] = deque()
        self.coll_stash: deque[_Stashed] = deque()
        self.said_bye = False
        self.reader: Optional[threading.Thread] = None


class _Peer:
    """Another rank: its links (stream 0 carries P2P, acknowledgement and control frames;
    a collective's segment ``k`` travels on link ``k % len(links)``) and P2P stash."""

    __slots__ = ("rank", "links", "p2p_stash", "closed", "failed", "label")

    def __init__(self, rank: int, socks: Sequence[socket.socket], label: str) -> None:
        self.rank = rank
        self.label = label
        self.links = [_Link(i, sock) for i, sock in enumerate(socks)]
        self.p2p_stash: list[_Stashed] = []
        self.closed: Optional[str] = None  # why this peer can no longer be reached
        self.failed: Optional[int] = None  # its global rank once it is gone (died, shut down)

    def link_of(self, part: int) -> _Link:
        """The link that carries collective frame ``part`` (step << 32 | segment)."""
        links = self.links
        return links[(part & 0xFFFFFFFF) % len(links)] if len(links) > 1 else links[0]

    @property
    def said_bye(self) -> bool:
        return any(link.said_bye for link in self.links)

    def take_posted(self) -> list[PostedRecv]:
        """Withdraw every collective receive posted on this peer's links (caller holds the transport's lock)."""
        taken: list[PostedRecv] = []
        for link in self.links:
            taken.extend(link.coll_posted)
            link.coll_posted.clear()
        return taken


class _EOF(Exception):
    pass


class _Corrupt(Exception):
    pass


class FrameTimeout(Exception):
    """A collective's frame from ``peer`` did not arrive (entirely) before the deadline;
    the collective turns it into :meth:`Transport.collective_timeout`'s error."""

    def __init__(self, peer: int, op: int, nbytes: int, part: int) -> None:
        what = "acknowledgement" if op == OP_ACK else f"{nbytes}-byte frame"
        self.frame = f"its {what}" + (f" ({part_name(part)})" if part else "")
        super().__init__(self.frame)
        self.peer = peer


#: How much of a peer's ABORT reason goes into this rank's error (the frame may hold 1 MiB).
ABORT_REASON_CHARS = 1024


def clip_reason(reason: str, limit: int = ABORT_REASON_CHARS) -> str:
    """``reason`` cut to ``limit`` characters, saying how many bytes were left out."""
    if len(reason) <= limit:
        return reason
    omitted = len(reason[limit:].encode("utf-8", "replace"))
    return f"{reason[:limit]}… ({omitted} bytes omitted)"


def _timeout_error(message: str, missing: Sequence[int]) -> DistBackendTimeoutError:
    err = DistBackendTimeoutError(message)
    err.missing_ranks = list(missing)  # type: ignore[attr-defined]  # carried by the ABORT frames
    return err


class Transport:
    """The sockets to every peer of one group and the matching of frames to receives."""

    def __init__(
        self,
        rank: int,
        size: int,
        sockets: Mapping[int, Sequence[socket.socket]],
        timeout: float,
        global_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self._global = list(global_ranks) if global_ranks else list(range(size))
        self._lock = threading.Lock()
        self._p2p_posted: list[PostedRecv] = []
        self._arrivals = 0
        self.broken: Optional[DistBackendError] = None
        self._told_peers = False  # ABORT frames sent (once per rank)
        self._closing = False
        self._helpers: list[threading.Thread] = []
        self._break_callbacks: list[Callable[[], None]] = []
        self.peers: list[Optional[_Peer]] = [None] * size
        #: collectives this rank has issued (the backend counts them; peers' probes read it)
        self.issued = 0
        self._probe_seq = 0
        self._probe_replies: dict[int, int] = {}
        self._probe_cv = threading.Condition(self._lock)
        slice_s = min(timeout, _SEND_SLICE)
        sndtimeo = struct.pack("ll", int(slice_s), int((slice_s % 1) * 1e6))
        for peer_rank, socks in sockets.items():
            for sock in socks:
                try:  # a blocked send returns after this long (see _push)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, sndtimeo)
                except (OSError, OverflowError):
                    pass
            self.peers[peer_rank] = _Peer(peer_rank, socks, self.label(peer_rank))
        for peer in self.peers:
            if peer is None:
                continue
            for link in peer.links:
                suffix = f".{link.index}" if len(peer.links) > 1 else ""
                link.reader = threading.Thread(
                    target=self._read_loop,
                    args=(peer, link),
                    name=f"tdist-tcp-r{rank}-from{peer.rank}{suffix}",
                    daemon=True,
                )
                link.reader.start()

    # ------------------------------------------------------------------ names
    def label(self, rank: int) -> str:
        if rank < len(self._global) and self._global[rank] != rank:
            return f"rank {rank} (global {self._global[rank]})"
        return f"rank {rank}"

    @property
    def me(self) -> str:
        return self.label(self.rank)

    def _gone_error(self, message: str, peer: Optional[_Peer]) -> DistBackendError:
        """A :class:`DistBackendError` that is the consequence of ``peer``'s failure (None:
        a peer, not known which): ``failed_peer`` names its global rank."""
        err = DistBackendError(message)
        err.failed_peer = -1 if peer is None else self._global[peer.rank]
        return err

    def peer_error(self, peer: _Peer) -> DistBackendError:
        """The error of an operation with ``peer``, which can no longer be reached."""
        err = DistBackendError(peer.closed)
        err.failed_peer = peer.failed
        return err

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
        n = len(payload)
        link = peer.link_of(part)
        sent = -1
        try:
            with link.send_lock:
                sock = link.sock
                if n <= _SMALL_SEND:
                    data = header + payload if n else header
                    try:
                        sent = sock.send(data)
                    except (BlockingIOError, InterruptedError):  # nothing sent within SO_SNDTIMEO
                        sent = 0
                    if sent < len(data):
                        self._push(sock, memoryview(data)[sent:], b"")
                else:
                    try:
                        sent = sock.sendmsg([header, payload])
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    if sent < len(header) + n:
                        self._push(
                            sock,
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

    def _push(self, sock: socket.socket, first: Any, rest: Any) -> None:
        """Send the rest of a frame (with the peer's send lock held). Each blocked call
        returns after SO_SNDTIMEO (a fraction of a second), so a group broken meanwhile
        ends the wait at once, and a peer that took nothing for the group's timeout
        raises ``socket.timeout``."""
        parts = [memoryview(p) for p in (first, rest) if len(p)]
        stalled = 0.0
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

    def _send_failed(self, peer: _Peer, exc: OSError, coll: Optional["Coll"] = None) -> DistBackendError:
        if self.broken is not None:
            return self.broken
        if peer.closed is not None:
            return self.peer_error(peer)
        if peer.said_bye:  # it destroyed its group; its reader has not seen the EOF yet
            return self._gone_error(
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
                err = _timeout_error(
                    f"tcp backend: {self.me} timed out after {self.timeout:g} s sending to "
                    f"{peer.label} (it stopped reading its connection)",
                    [peer.rank],
                )
        else:
            err = self._gone_error(
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

    def _claim(self, pr: PostedRecv, stashed: _Stashed) -> None:
        """Complete ``pr`` with ``stashed`` as soon as that frame is fully read: now if it
        is, else from its reader (posting never waits for a frame still arriving). A group
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

    # --------------------------------------------------------------- timeouts
    def collective_timeout(
        self, c: "Coll", waited_for: int, detail: str = "", via: str = ""
    ) -> DistBackendTimeoutError:
        """The error of collective ``c`` that timed out on ``waited_for`` (``detail``: how),
        naming the ranks that did not arrive at it (asked with :meth:`probe`)."""
        missing, silent = self.probe(c.seq, min(2.0, max(0.5, self.timeout / 2)))
        what = describe(c.op, c.redop, c.seq, c.dtype, c.nbytes)
        head = f"tcp backend: {self.me} timed out after {self.timeout:g} s in {what}{via}"
        if missing:
            parts = []
            for q in missing:
                why = "no answer: stopped, hung or overloaded" if q in silent else "it has not started it"
                parts.append(f"{self.label(q)} ({why})")
            names = ", ".join(parts)
            verdict = f"{names} did not arrive" if len(missing) == 1 else f"ranks {names} did not arrive"
        else:  # everyone has started it: the one waited for is stuck behind something else
            verdict = f"every rank has started it; {self.label(waited_for)} did not send its part"
        detail = f" ({detail})" if detail else ""
        return _timeout_error(f"{head}: {verdict}{detail}", missing or [waited_for])

    def probe(self, seq: int, wait: float) -> tuple[list[int], set[int]]:
        """Ask every reachable peer how many collectives it has issued; return (the ranks
        that have not issued collective ``seq``, those of them that did not answer within ``wait``)."""
        with self._lock:
            self._probe_seq += 1
            token = self._probe_seq
            self._probe_replies = {}
        frame = pack_header(PROBE, 0, 0, 0, 0, token, 0)
        asked = [p for p in self.peers if p is not None and p.closed is None and _send_control(p.links[0], frame, 0.5)]
        deadline = time.monotonic() + wait
        with self._probe_cv:
            while len(self._probe_replies) < len(asked) and self._probe_seq == token:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._probe_cv.wait(left)
            replies = dict(self._probe_replies) if self._probe_seq == token else {}
        silent = {p.rank for p in self.peers if p is not None and p.rank not in replies}
        missing = sorted(q for q in range(self.size) if q in silent or (q in replies and replies[q] < seq))
        return missing, silent

    def _on_probe(self, peer: _Peer, token: int) -> None:
        _send_control(peer.links[0], pack_header(STATE, 0, 0, 0, self.issued, token, 0), 1.0)

    def _on_state(self, peer: _Peer, token: int, issued: int) -> None:
        with self._probe_cv:
            if token == self._probe_seq:
                self._probe_replies[peer.rank] = issued
                self._probe_cv.notify_all()

    def _mismatch(
        self, pr: PostedRecv, peer: _Peer, op: int, redop: int, seq: int, dtype: int, nbytes: int, part: int
    ) -> DistBackendError:
        return DistBackendError(
            f"tcp backend: {self.me} expected {describe(pr.op, pr.redop, pr.seq, pr.dtype, pr.nbytes, part=pr.tag)} "
            f"from {peer.label} but got {describe(op, redop, seq, dtype, nbytes, part=part)} (the ranks called "
            "different collectives, or with different sizes, dtypes or reduce ops)"
        )

    # ------------------------------------------------------------------ p2p
    def post_p2p(
        self, src: Optional[int], tag: int, dtype: int, dest: memoryview, callback: Callable[[PostedRecv], None]
    ) -> PostedRecv:
        """Post a P2P receive (``src`` None: any source); ``callback`` runs on completion."""
        pr = PostedRecv(src, dest, 0, 0, 0, dtype, tag, callback)
        with self._lock:
            if self.broken is not None:
                raise self.broken
            found: Optional[tuple[_Peer, _Stashed]] = None
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
                    raise self._gone_error(
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

    def _p2p_mismatch(self, pr: PostedRecv, peer: _Peer, dtype: int, nbytes: int, shape: tuple) -> DistBackendError:
        src = "any source" if pr.src is None else f"src={pr.src}"
        return DistBackendError(
            f"tcp backend: {self.me} recv({src}, tag={pr.tag}) expects {dtype_name(pr.dtype)} x {pr.nbytes} bytes "
            f"but {peer.label} sent {dtype_name(dtype)}{list(shape)} x {nbytes} bytes"
        )

    # --------------------------------------------------------------- readers
    def _read_loop(self, peer: _Peer, link: _Link) -> None:
        sock = link.sock
        buf = bytearray(_READ_BUFFER)
        mv = memoryview(buf)
        start = end = 0
        hsize = HEADER.size
        unpack = HEADER.unpack_from
        current: Any = None  # the receive or stash entry being filled
        try:
            while True:
                if end - start < hsize:
                    start, end = _fill(sock, buf, mv, start, end, hsize)
                magic, kind, op, redop, dtype, ndim, tag, seq, nbytes = unpack(buf, start)
                if magic != FRAME_MAGIC:
                    raise _Corrupt(f"bad frame magic {magic:#x}")
                hlen = hsize + 8 * ndim
                if end - start < hlen:
                    start, end = _fill(sock, buf, mv, start, end, hlen)
                shape = struct.unpack_from(f"<{ndim}q", buf, start + hsize) if ndim else ()
                start += hlen
                if kind == COLL:
                    target, current = self._on_coll(peer, link, op, redop, seq, dtype, nbytes, shape, tag)
                elif kind == P2P:
                    target, current = self._on_p2p(peer, tag, dtype, seq, nbytes, shape)
                elif kind == PROBE:  # answered from this thread: a busy or blocked rank still answers
                    if nbytes:
                        raise _Corrupt(f"{nbytes}-byte probe")
                    self._on_probe(peer, seq)
                    target, current = None, None
                elif kind == STATE:
                    if nbytes:
                        raise _Corrupt(f"{nbytes}-byte state frame")
                    self._on_state(peer, seq, tag)
                    target, current = None, None
                elif kind == ABORT or kind == BYE:
                    if nbytes > (1 << 20):
                        raise _Corrupt(f"{nbytes}-byte control frame")
                    target, current = memoryview(bytearray(nbytes)), None
                else:
                    raise _Corrupt(f"unknown frame kind {kind}")
                if nbytes:
                    # payload: first what the buffer holds, then straight from the socket
                    take = min(end - start, nbytes)
                    if target is not None:
                        target[:take] = mv[start : start + take]
                    start += take
                    got = take
                    while got < nbytes:
                        if target is not None:  # one syscall for the rest of the payload
                            n = sock.recv_into(target[got:], nbytes - got, _WAITALL)
                        else:  # discard: the buffer is empty here, use it as scratch
                            n = sock.recv_into(mv, min(len(buf), nbytes - got))
                        if n == 0:
                            raise _EOF()
                        got += n
                if start == end:
                    start = end = 0
                if current is not None:
                    done, current = current, None
                    if kind == P2P and isinstance(done, PostedRecv):
                        done.source = peer.rank
                    done.finish()
                elif kind == ABORT:
                    self.fail(self._abort_error(peer, bytes(target or b"")), notify=False)
                elif kind == BYE:
                    link.said_bye = True
        except _EOF:
            problem = None if link.said_bye else "it closed the connection without saying goodbye"
        except _Corrupt as exc:
            problem = f"it sent a corrupt frame ({exc})"
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # never let a reader die silently
            problem = f"reader failed: {type(exc).__name__}: {exc}"
        if self._closing:
            err = DistBackendError(f"tcp backend: {self.me}'s process group was destroyed")
        elif problem is None:
            err = self._gone_error(
                f"tcp backend: {peer.label} has shut down its process group; {self.me} cannot communicate with it",
                peer,
            )
        else:
            err = self._gone_error(
                f"tcp backend: {self.me} lost its connection to {peer.label} ({problem}); that rank probably died",
                peer,
            )
        if current is not None:
            current.finish(err)
        self._peer_gone(peer, err, crashed=problem is not None and not self._closing)

    def _on_coll(
        self, peer: _Peer, link: _Link, op: int, redop: int, seq: int, dtype: int, nbytes: int, shape: tuple, part: int
    ) -> tuple[Optional[memoryview], Any]:
        with self._lock:
            if self.broken is not None:
                return None, None
            if not link.coll_posted:
                self._arrivals += 1
                stashed = _Stashed(op, redop, seq, dtype, part, nbytes, shape, self._arrivals)
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

    def _on_p2p(
        self, peer: _Peer, tag: int, dtype: int, seq: int, nbytes: int, shape: tuple
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
                stashed = _Stashed(0, 0, seq, dtype, tag, nbytes, shape, self._arrivals)
                peer.p2p_stash.append(stashed)
                return memoryview(stashed.data), stashed
        found.source = peer.rank
        if found.dtype != dtype or found.nbytes != nbytes:
            found.finish(self._p2p_mismatch(found, peer, dtype, nbytes, shape))
            return None, None
        return found.dest, found

    # ---------------------------------------------------------------- failure
    def add_break_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` whenever the group breaks or a peer goes away (e.g. to wake
        threads that wait on something other than a posted receive)."""
        self._break_callbacks.append(fn)

    def _notify_break(self) -> None:
        for fn in list(self._break_callbacks):
            try:
                fn()
            except Exception:
                pass

    def fail(self, err: DistBackendError, notify: bool = True) -> None:
        """Break the group: every pending and later operation raises the first error.
        With ``notify``, ABORT frames carrying ``err`` tell the peers (so they raise instead
        of waiting); each rank sends them once, also when an ABORT broke its group first
        and one of its own operations then fails (so a peer that the first rank could not
        reach still hears of it)."""
        with self._lock:
            first = self.broken is None
            if first:
                self.broken = err
                pending: list[Any] = list(self._p2p_posted)
                self._p2p_posted.clear()
                for peer in self.peers:
                    if peer is not None:
                        pending.extend(peer.take_posted())
            tell = notify and not self._closing and not self._told_peers
            if tell:
                self._told_peers = True
        if first:
            for pr in pending:
                pr.finish(err)
            self._notify_break()
        if tell:
            reason = getattr(err, "abort_reason", None) or str(err)  # relay the origin's words, not nested
            payload = json.dumps(
                {
                    "reason": reason[:4000],
                    "timeout": isinstance(err, DistBackendTimeoutError),
                    "missing": list(getattr(err, "missing_ranks", [])),
                }
            ).encode()
            helper = threading.Thread(target=self._send_aborts, args=(payload,), name="tdist-tcp-abort", daemon=True)
            self._helpers.append(helper)
            helper.start()

    def _abort_error(self, peer: _Peer, payload: bytes) -> DistBackendError:
        """The error an ABORT frame from ``peer`` breaks this rank's group with: a
        :class:`DistBackendTimeoutError` naming the missing ranks if the abort is a timeout's."""
        try:
            info = json.loads(payload.decode("utf-8", "replace"))
            reason = str(info["reason"])
            missing = [int(q) for q in info.get("missing", ()) if 0 <= int(q) < self.size]
            timed_out = bool(info.get("timeout"))
        except (ValueError, TypeError, KeyError, AttributeError):
            reason, missing, timed_out = payload.decode("utf-8", "replace"), [], False
        reason, missing = clip_reason(reason), sorted(set(missing))  # a peer's words, not a megabyte of them
        if timed_out:
            err: DistBackendError = _timeout_error(
                f"tcp backend: {peer.label} aborted {self.me}'s group after a timeout: {reason}", missing
            )
        else:
            err = DistBackendError(f"tcp backend: {peer.label} aborted the group: {reason}")
        err.failed_peer = self._global[peer.rank]  # its failure, or one it relays
        err.abort_reason = reason  # type: ignore[attr-defined]
        return err

    def _send_aborts(self, payload: bytes) -> None:
        frame = pack_header(ABORT, 0, 0, 0, 0, 0, len(payload)) + payload
        for peer in self.peers:
            if peer is not None and peer.closed is None:
                _send_control(peer.links[0], frame, 2.0)

    def _peer_gone(self, peer: _Peer, err: DistBackendError, crashed: bool) -> None:
        with self._lock:
            if peer.closed is None:
                peer.closed = str(err)
                peer.failed = err.failed_peer
            pending: list[Any] = peer.take_posted()
            everyone_gone = all(p is None or p.closed is not None for p in self.peers)
            keep = []
            for pr in self._p2p_posted:
                if pr.src == peer.rank or (pr.src is None and everyone_gone):
                    pending.append(pr)
                else:
                    keep.append(pr)
            self._p2p_posted[:] = keep
        for pr in pending:
            pr.finish(err)
        self._notify_break()
        if crashed:
            self.fail(err)

    # ---------------------------------------------------------------- closing
    def close(self, linger: float = 1.0) -> None:
        """Say BYE to every peer, close the connections and stop the readers. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self.broken is None:
            self.fail(DistBackendError(f"tcp backend: {self.me}'s process group was destroyed"), notify=False)
        bye = pack_header(BYE, 0, 0, 0, 0, 0, 0)
        links = [(peer, link) for peer in self.peers if peer is not None for link in peer.links]
        for peer, link in links:
            if peer.closed is None:
                _send_control(link, bye, 1.0)
            try:
                link.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        deadline = time.monotonic() + linger  # let the peers' BYEs arrive (avoids resets)
        for _peer, link in links:
            if link.reader is not None:
                link.reader.join(max(0.0, deadline - time.monotonic()))
        for _peer, link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _peer, link in links:
            if link.reader is not None:
                link.reader.join(2.0)
            link.sock.close()
        for helper in self._helpers:
            helper.join(3.0)

    def threads(self) -> list[threading.Thread]:
        readers = [link.reader for p in self.peers if p is not None for link in p.links]
        return [t for t in readers if t is not None] + self._helpers


def _send_control(link: _Link, frame: bytes, limit: float) -> bool:
    """Best-effort send of a small control frame without blocking longer than ``limit``
    (never changes the socket's blocking mode, which its reader relies on)."""
    deadline = time.monotonic() + limit
    if not link.send_lock.acquire(True, limit):
        return False
    try:
        view = memoryview(frame)
        while view:
            try:
                view = view[link.sock.send(view, socket.MSG_DONTWAIT) :]
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
        return True
    except OSError:
        return False
    finally:
        link.send_lock.release()


def _fill(sock: socket.socket, buf: bytearray, mv: memoryview, start: int, end: int, need: int) -> tuple[int, int]:
    """Read until ``buf[start:end]`` holds at least ``need`` bytes."""
    if len(buf) - start < need:
        kept = end - start
        buf[:kept] = bytes(mv[start:end])
        start, end = 0, kept
    while end - start < need:
        # read ahead a little (several small frames per syscall) but not far into a
        # large payload, which goes straight to its destination instead
        n = sock.recv_into(mv[end:], min(len(buf) - end, max(need - (end - start), _READ_AHEAD)))
        if n == 0:
            raise _EOF()
        end += n
    return start, end
