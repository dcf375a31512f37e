"""A peer's links and the frame reader each link runs inside the I/O loop.

A :class:`Link` is one connection (stream) to a peer. Its reader is a state machine that
the process's I/O loop (:mod:`tdist_tcp.net.ioloop`) drives whenever the socket is readable:
it reads the frame header (buffered, with a little read-ahead), asks its owner (the
:class:`~tdist_tcp.net.transport.Transport`) where the payload goes -- the posted receive's
own memory (zero copy), a fresh stash buffer, or nowhere -- and reads the payload there
with non-blocking ``recv_into`` calls on the destination's memoryview slice, resuming where
it stopped when the socket runs dry. It never blocks and reads at most
:data:`READ_BUDGET` bytes per turn, so one busy link does not starve the others.

A link can change hands (``shrink_group``, :mod:`tdist_tcp.regroup`): each owner has an
*epoch*, and a link delivers a frame only while its :attr:`Link.rx` (the epoch of the
frames now arriving) is its owner's; a MARK frame from the peer starts its next epoch.
:meth:`Link.hand_over` names the next owner, which the reader takes at the next frame
boundary (frames of the old epoch, still arriving, are then read and dropped); a MARK of
an epoch beyond its owner's, with no next owner named yet, *parks* the link: it leaves
the loop, its buffered bytes kept, until :meth:`Link.hand_over` brings it back. Sends
name their transport (:attr:`Link.sender`), so an old owner can never send on a link
handed over.

Also here: :class:`PostedRecv` (a receive waiting for one frame), :class:`Stashed` (a
frame that arrived first), :class:`Peer` (a rank's links and P2P stash) and the small
helpers the transport's errors use.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
from tdist.plugin import WOULD_BLOCK, DistBackendTimeoutError

from .ioloop import AGAIN, DONE, WAIT, io_loop
from ..protocol.wire import (
    ABORT,
    BYE,
    COLL,
    FRAME_MAGIC,
    HEADER,
    MARK,
    OP_ACK,
    P2P,
    PROBE,
    STATE,
    pack_header,
    part_name,
)

if TYPE_CHECKING:
    from .transport import Transport

__all__ = [
    "PostedRecv",
    "Stashed",
    "Link",
    "Peer",
    "FrameTimeout",
    "clip_reason",
    "timeout_error",
    "send_control",
    "send_mark",
    "close_links",
]

_READ_BUFFER = 64 << 10  # a reader's buffered chunk (headers and small payloads)
_READ_AHEAD = 8 << 10  # bytes a reader asks for beyond the header it needs
READ_BUDGET = 4 << 20  # bytes a link reads per turn of the loop before the others get theirs
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_BLOCKED = (BlockingIOError, InterruptedError) + tuple(WOULD_BLOCK)


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
        try:  # completes a Work, which runs its done-callbacks: never let them break the loop
            self.callback(self)
        except Exception:
            pass


class Stashed:
    """A frame that arrived before its receive was posted. The receive that claims it
    gets its data through :meth:`deliver_to` as soon as the frame is fully read, without
    waiting for the rest of it to arrive (the link's reader delivers what is still coming)."""

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


class _EOF(Exception):
    pass


class _Corrupt(Exception):
    pass


class Link:
    """One connection (stream) to a peer: its socket, the collective frames it carries
    (matched FIFO), and its reader's state between two turns of the I/O loop."""

    __slots__ = (
        "index",
        "sock",
        "peer",
        "owner",
        "send_lock",
        "coll_posted",
        "coll_stash",
        "said_bye",
        "ended",
        "rx",
        "sender",
        "owed",
        "_next",
        "_parked",
        "_handoff",
        "_buf",
        "_mv",
        "_start",
        "_end",
        "_payload",
        "_kind",
        "_target",
        "_current",
        "_got",
        "_nbytes",
        "_recv",
        "_plain",
    )

    def __init__(self, index: int, sock: Any, peer: "Peer", owner: "Transport") -> None:
        self.index = index
        self.sock = sock
        self.peer = peer
        self.owner = owner
        self.send_lock = threading.Lock()
        self.coll_posted: deque[PostedRecv] = deque()
        self.coll_stash: deque[Stashed] = deque()
        self.said_bye = False
        self.ended = threading.Event()  # its reader saw the end of the connection (or gave up on it)
        self.rx: int = owner.epoch  # the epoch of the frames arriving now (delivered if it is the owner's)
        self.sender: Any = owner  # the transport that may send on it (checked under send_lock)
        self.owed = 0  # bytes of a frame cut short (a send that gave up), still owed to the peer
        self._next: Optional[tuple[Any, Peer]] = None  # the next (owner, peer), see hand_over
        self._parked = False
        self._handoff = threading.Lock()
        self._buf = bytearray(_READ_BUFFER)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0
        self._payload = False  # reading a payload (else a header)
        self._kind = 0
        self._target: Optional[memoryview] = None  # where the payload goes (None: discarded)
        self._current: Any = None  # the receive or stash entry being filled
        self._got = self._nbytes = 0
        nowait = getattr(sock, "recv_nowait", None)  # a TlsStream
        self._recv: Callable[[Any, int], int] = nowait or (lambda view, n: sock.recv_into(view, n, _DONTWAIT))
        # a plain socket has nothing buffered above the kernel: once the buffer is drained,
        # the loop's (level-triggered) poll says when there is more (a TLS stream may hold
        # decrypted bytes that no poll sees: it is read until it says it is dry)
        self._plain = nowait is None

    # ---------------------------------------------------------------- reading
    def on_readable(self) -> int:
        """Read what the socket holds (see the module); called by the I/O loop only."""
        try:
            return self._pump()
        except _BLOCKED:
            return WAIT
        except _EOF:
            problem = None if self.said_bye else "it closed the connection without saying goodbye"
        except _Corrupt as exc:
            problem = f"it sent a corrupt frame ({exc})"
        except OSError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        except BaseException as exc:  # never let a reader die silently
            problem = f"reader failed: {type(exc).__name__}: {exc}"
        current, self._current = self._current, None
        self.ended.set()
        self._adopt()  # a link handed over: its new owner learns that it ended
        self.owner.link_lost(self, current, problem)
        return DONE

    # ------------------------------------------------------------ changing hands
    def hand_over(self, owner: Any, peer: "Peer") -> None:
        """Make ``owner`` (its ``peer``) this link's reader's owner from the next frame on
        (any thread); a parked link goes back into the I/O loop."""
        with self._handoff:
            self._next = (owner, peer)
            parked, self._parked = self._parked, False
        if parked:
            io_loop().register(self.sock, self)

    def _adopt(self) -> tuple[Any, "Peer"]:
        """Take the next owner if one is named; the (owner, peer) now."""
        if self._next is not None:
            with self._handoff:
                taken, self._next = self._next, None
            if taken is not None:
                self.owner, self.peer = taken
        return self.owner, self.peer

    def _adopt_or_park(self) -> Optional[tuple[Any, "Peer"]]:
        """Take the next owner: (owner, peer); None if none is named yet: the link is then
        parked (its reader returns DONE and :meth:`hand_over` brings it back)."""
        with self._handoff:
            taken, self._next = self._next, None
            if taken is None:
                self._parked = True
                return None
        self.owner, self.peer = taken
        return taken

    def abandon(self, error: BaseException) -> None:
        """Fail the frame being read (the loop no longer serves this link)."""
        current, self._current = self._current, None
        self.ended.set()
        if current is not None:
            current.finish(error)

    def _fill(self, need: int) -> None:
        """Read until the buffer holds ``need`` bytes from ``_start`` (raises when the socket is dry)."""
        buf, mv = self._buf, self._mv
        if len(buf) - self._start < need:
            kept = self._end - self._start
            buf[:kept] = bytes(mv[self._start : self._end])
            self._start, self._end = 0, kept
        while self._end - self._start < need:
            # read ahead a little (several small frames per call) but not far into a large
            # payload, which goes straight to its destination instead
            want = min(len(buf) - self._end, max(need - (self._end - self._start), _READ_AHEAD))
            n = self._recv(mv[self._end :], want)
            if n == 0:
                raise _EOF()
            self._end += n

    def _pump(self) -> int:
        owner, peer, recv, mv = self.owner, self.peer, self._recv, self._mv
        hsize = HEADER.size
        budget = READ_BUDGET
        while True:
            if not self._payload:
                if self._next is not None:  # handed over: the new owner's from this frame on
                    owner, peer = self._adopt()
                if self._end - self._start < hsize:
                    self._fill(hsize)
                magic, kind, op, redop, dtype, ndim, tag, seq, nbytes = HEADER.unpack_from(self._buf, self._start)
                if magic != FRAME_MAGIC:
                    raise _Corrupt(f"bad frame magic {magic:#x}")
                hlen = hsize + 8 * ndim
                if self._end - self._start < hlen:
                    self._fill(hlen)
                shape = struct.unpack_from(f"<{ndim}q", self._buf, self._start + hsize) if ndim else ()
                self._start += hlen
                target: Optional[memoryview] = None
                if kind == MARK:  # the peer's next epoch starts: a later owner's frames follow
                    if nbytes:
                        raise _Corrupt(f"{nbytes}-byte epoch mark")
                    self.rx = seq
                    while seq > owner.epoch:
                        adopted = self._adopt_or_park()
                        if adopted is None:
                            return DONE  # parked: hand_over brings it back
                        owner, peer = adopted
                    continue
                if self.rx != owner.epoch:  # an earlier epoch's frame (its group is gone): dropped
                    if kind not in (COLL, P2P, ABORT, BYE, PROBE, STATE) or (kind >= ABORT and nbytes > (1 << 20)):
                        raise _Corrupt(f"a {nbytes}-byte frame of kind {kind} from an earlier epoch")
                    self._current, kind = None, 0
                elif kind == COLL:
                    target, self._current = owner.on_coll(peer, self, op, redop, seq, dtype, nbytes, shape, tag)
                elif kind == P2P:
                    target, self._current = owner.on_p2p(peer, tag, dtype, seq, nbytes, shape)
                elif kind == PROBE or kind == STATE:  # answered from the loop: a busy rank still answers
                    if nbytes:
                        raise _Corrupt(f"{nbytes}-byte {'probe' if kind == PROBE else 'state frame'}")
                    if kind == PROBE:
                        owner.on_probe(peer, seq)
                    else:
                        owner.on_state(peer, seq, tag)
                elif kind == ABORT or kind == BYE:
                    if nbytes > (1 << 20):
                        raise _Corrupt(f"{nbytes}-byte control frame")
                    target = memoryview(bytearray(nbytes))
                else:
                    raise _Corrupt(f"unknown frame kind {kind}")
                # the payload: first what the buffer holds, then straight from the socket
                take = min(self._end - self._start, nbytes)
                if take and target is not None:
                    target[:take] = mv[self._start : self._start + take]
                self._start += take
                self._kind, self._target, self._got, self._nbytes = kind, target, take, nbytes
                self._payload = True
            nbytes, target = self._nbytes, self._target
            while self._got < nbytes:
                if target is not None:
                    n = recv(target[self._got :], nbytes - self._got)
                else:  # discard: the buffer is empty here, use it as scratch
                    n = recv(mv, min(len(mv), nbytes - self._got))
                if n == 0:
                    raise _EOF()
                self._got += n
                budget -= n
                if budget <= 0 and self._got < nbytes:
                    return AGAIN
            self._payload = False
            if self._start == self._end:
                self._start = self._end = 0
            kind, current = self._kind, self._current
            self._current = self._target = None
            if current is not None:
                if kind == P2P and isinstance(current, PostedRecv):
                    current.source = peer.rank
                current.finish()
            elif kind == ABORT:
                owner.fail(owner.abort_error(peer, bytes(target or b"")), notify=False)
            elif kind == BYE:
                self.said_bye = True
            if budget <= 0:
                return AGAIN
            if self._plain and self._start == self._end:
                # drained: back to the poll at once rather than a read that finds nothing --
                # the fewer steps between waking a waiter and this thread's wait, the less
                # the waiter waits for the interpreter lock this thread holds
                return WAIT


class Peer:
    """Another rank: its links (none until connected; stream 0 carries P2P, acknowledgement
    and control frames; a collective's segment ``k`` travels on link ``k % len(links)``),
    its P2P stash and the state of its connection."""

    __slots__ = ("rank", "links", "p2p_stash", "closed", "failed", "label", "connecting", "incoming", "expect")

    def __init__(self, rank: int, label: str) -> None:
        self.rank = rank
        self.label = label
        self.links: list[Link] = []
        self.p2p_stash: list[Stashed] = []
        self.closed: Optional[str] = None  # why this peer can no longer be reached
        self.failed: Optional[int] = None  # its global rank once it is gone (died, shut down)
        self.connecting = False  # this rank is opening the connection
        self.incoming = False  # the peer is opening it (its first stream was accepted)
        self.expect = 0.0  # the peer said it is connecting (until this monotonic time)

    def link_of(self, part: int) -> Link:
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


def timeout_error(message: str, missing: Sequence[int]) -> DistBackendTimeoutError:
    """A timeout error naming the ``missing`` ranks (carried by the ABORT frames)."""
    err = DistBackendTimeoutError(message)
    err.missing_ranks = list(missing)  # type: ignore[attr-defined]
    return err


def send_control(link: Link, frame: bytes, limit: float, sender: Any = None) -> bool:
    """Best-effort send of a small control frame without blocking longer than ``limit``
    (``sender``: the transport sending, which must still hold the link)."""
    deadline = time.monotonic() + limit
    if not link.send_lock.acquire(True, limit):
        return False
    try:
        if sender is not None and link.sender is not sender:
            return False
        return _send_all(link, frame, deadline)
    finally:
        link.send_lock.release()


def send_mark(link: Link, sender: Any, epoch: int, limit: float) -> bool:
    """Start ``sender``'s ``epoch`` on ``link`` (``shrink_group``): the bytes still owed of
    a frame cut short (zeros: that frame's epoch is over, its receiver drops it), then a
    MARK; from then on only ``sender`` sends on it. False if that took over ``limit`` s."""
    deadline = time.monotonic() + limit
    if not link.send_lock.acquire(True, limit):
        return False
    try:
        link.sender = sender
        owed, link.owed = link.owed, 0
        while owed:
            chunk = min(owed, 1 << 20)
            if not _send_all(link, bytes(chunk), deadline):
                return False
            owed -= chunk
        return _send_all(link, pack_header(MARK, 0, 0, 0, 0, epoch, 0), deadline)
    finally:
        link.send_lock.release()


def close_links(links: Sequence[Link], error: BaseException) -> None:
    """Take ``links`` out of the I/O loop and close them (a frame being read fails with ``error``)."""
    loop = io_loop()
    for link in links:
        loop.unregister(link.sock)
        link.abandon(error)
        try:
            link.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        link.sock.close()


def _send_all(link: Link, data: bytes, deadline: float) -> bool:
    view = memoryview(data)
    try:
        while view:
            try:
                view = view[link.sock.send(view, _DONTWAIT) :]
            except _BLOCKED:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)
    except OSError:
        return False
    return True
