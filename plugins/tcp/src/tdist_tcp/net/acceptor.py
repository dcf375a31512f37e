"""The accepting side of a link: a group's listeners and the handshakes of the connections they accept.

Served by the I/O loop (:mod:`tdist_tcp.net.ioloop`) for the group's lifetime: each listener
and each connection in its handshake is a loop handler, and the handshake is a
non-blocking state machine (TLS first where configured, then HELLO, the proofs and the
verdict; see :mod:`tdist_tcp.protocol.auth`), so a silent, slow or garbage connection is dropped
without delaying the others; each must complete within
:data:`~tdist_tcp.net.connect.HANDSHAKE_LIMIT` seconds, and beyond :data:`MAX_PENDING`
unfinished ones the oldest is dropped. A rank counts as connected only once it proved
the group key. Whether to take a rank's connection at all is the owner's call
(``admit``: not when already connected, nor when this lower rank is connecting to it:
the answer is then DUPLICATE); a rank's streams, once all arrived, go to ``complete``.
"""

from __future__ import annotations

import hmac
import socket
import time
from typing import Any, Callable, Optional

from tdist.plugin import descriptor_shortage

from ..protocol import tls as _tls
from ..protocol.auth import (
    ACCEPTED,
    DUPLICATE,
    HELLO,
    MAC_SIZE,
    REFUSED,
    mac,
    make_hello,
    parse_hello,
    token_mismatch_hint,
)
from .connect import HANDSHAKE_LIMIT, configure_socket
from .ioloop import AGAIN, WAIT, io_loop

__all__ = ["Acceptor", "MAX_PENDING"]

#: unauthenticated connections a group's listeners hold at once (beyond, the oldest is dropped)
MAX_PENDING = 64
_ACCEPTS_PER_TURN = 16


class _Pending:
    """An accepted connection still in its handshake: reading ``want`` bytes into ``buf``."""

    __slots__ = (
        "sock",
        "owner",
        "buf",
        "want",
        "limit",
        "hello_c",
        "hello_a",
        "peer",
        "flags",
        "tls",
        "stream",
        "streams",
    )

    def __init__(self, sock: socket.socket, owner: "Acceptor", limit: float) -> None:
        self.sock = sock
        self.owner = owner
        self.buf = bytearray()
        self.want = HELLO.size
        self.limit = limit
        self.hello_c = b""
        self.hello_a = b""
        self.peer = -1
        self.flags = 0
        self.stream = 0
        self.streams = 1
        self.tls = 0  # 1: TLS expected, its first byte not seen yet; 2: TLS handshake running; 3: TLS up

    def on_readable(self) -> int:
        self.owner.read(self)
        return WAIT


class _Listener:
    """A listening socket as a loop handler (its ticks drop handshakes that take too long)."""

    __slots__ = ("sock", "owner")

    def __init__(self, sock: socket.socket, owner: "Acceptor") -> None:
        self.sock = sock
        self.owner = owner

    def on_readable(self) -> int:
        return self.owner.accept(self.sock)

    def tick(self) -> None:
        if self.sock is self.owner.listeners[0]:
            self.owner.expire()


class Acceptor:
    """Accepts the group's connections (see the module); ``admit(rank)`` decides whether a
    rank's connection is taken, ``complete(rank, sockets)`` receives its streams (stream 0
    first), ``failed(rank)`` hears of a connection admitted and then lost."""

    def __init__(
        self,
        listeners: list[socket.socket],
        rank: int,
        size: int,
        nonce: bytes,
        key: bytes,
        has_token: bool,
        admit: Callable[[int], bool],
        complete: Callable[[int, list[Any]], None],
        failed: Callable[[int], None],
        tls: Optional[_tls.MeshTls] = None,
    ) -> None:
        self.listeners = listeners
        self.tls = tls  # serves the TCP listener (listeners[0]) only
        self.rank = rank
        self.size = size
        self.nonce = nonce
        self.key = key
        self.has_token = has_token
        self._admit, self._complete, self._failed = admit, complete, failed
        self.partial: dict[int, dict[int, Any]] = {}  # admitted ranks' streams so far, by stream index
        self._streams: dict[int, int] = {}  # how many streams each admitted rank announced
        self.refused = 0
        self.refusals: list[str] = []  # why connections that claimed a rank were refused
        self.exhausted = ""  # why accepting failed for want of file descriptors, if it did
        self.on_exhausted: Optional[Callable[[str], None]] = None  # told that, once
        self._pending: dict[Any, _Pending] = {}
        self._closed = False

    def start(self) -> None:
        """Serve the listeners in the I/O loop."""
        loop = io_loop()
        for listener in self.listeners:
            listener.setblocking(False)
            loop.register(listener, _Listener(listener, self))

    def close(self) -> None:
        """Stop serving: unregister and close the listeners and the handshakes (any thread)."""
        loop = io_loop()
        for listener in self.listeners:
            loop.unregister(listener)
            listener.close()
        self._closed = True
        for p in list(self._pending.values()):  # the loop no longer touches them (nor adds any)
            loop.unregister(p.sock)
            p.sock.close()
        self._pending.clear()
        for conns in self.partial.values():
            for sock in conns.values():
                sock.close()
        self.partial.clear()

    # ------------------------------------------------------- in the I/O loop
    def accept(self, listener: socket.socket) -> int:
        for _ in range(_ACCEPTS_PER_TURN):
            try:
                conn, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return WAIT
            except OSError as exc:  # e.g. out of file descriptors: the connector retries
                if self._descriptor_shortage(exc):  # said in this rank's timeout error; wait, rather than spin
                    time.sleep(0.05)
                return WAIT
            if self._closed:
                conn.close()
                return WAIT
            if len(self._pending) >= MAX_PENDING:
                self._drop(next(iter(self._pending.values())), None)  # the oldest
            conn.setblocking(False)
            p = _Pending(conn, self, time.monotonic() + HANDSHAKE_LIMIT)
            p.tls = 1 if self.tls is not None and listener is self.listeners[0] else 0
            self._pending[conn] = p
            io_loop().register(conn, p)
        return AGAIN

    def expire(self) -> None:
        now = time.monotonic()
        for p in [p for p in self._pending.values() if p.limit < now]:  # too slow: dropped
            self._drop(p, "it did not complete the handshake in time" if p.peer >= 0 else None)

    def _descriptor_shortage(self, exc: OSError) -> bool:
        """Whether ``exc`` is EMFILE or ENFILE; then keep why, and tell it once (``on_exhausted``)."""
        why = descriptor_shortage(exc)
        if why is None:
            return False
        if not self.exhausted and self.on_exhausted is not None:
            try:
                self.on_exhausted(why)
            except Exception:  # noqa: BLE001 - only a better error message is lost
                pass
        self.exhausted = f"accepting a connection failed: {why}"
        return True

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        io_loop().unregister(p.sock)

    def _drop(self, p: _Pending, reason: Optional[str]) -> None:
        self._forget(p)
        p.sock.close()
        self.refused += 1
        if reason and len(self.refusals) < 8:
            self.refusals.append(f"a connection claiming rank {p.peer}: {reason}")
        if p.peer >= 0 and p.peer in self.partial and (p.stream > 0 or p.hello_a):
            for sock in self.partial.pop(p.peer).values():  # its other streams are of no use now
                sock.close()
            self._failed(p.peer)

    def _refuse(self, p: _Pending, reason: str) -> None:
        if len(self.refusals) < 8:
            self.refusals.append(reason)
        self._drop(p, None)

    def _tls_step(self, p: _Pending) -> bool:
        """Advance the TLS handshake of ``p``: True once TLS is up (or not expected)."""
        assert self.tls is not None
        if p.tls == 1:
            try:
                first = p.sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return False
            except OSError:
                first = b""
            if first[:1] != bytes([_tls.TLS_RECORD_TYPE]):
                if first:
                    _tls.tell_tls_required(p.sock)
                self._refuse(
                    p,
                    "a connection without TLS (this rank requires TLS: the ranks' TDIST_TLS_* "
                    "variables or tls_* options differ)"
                    if first
                    else "a connection closed before TLS",
                )
                return False
            self._forget(p)
            p.sock, p.tls = self.tls.accept(p.sock), 2
            self._pending[p.sock] = p
            io_loop().register(p.sock, p)
        try:
            if not _tls.shake(p.sock):  # type: ignore[arg-type]
                return False
        except OSError as exc:
            self._refuse(p, _tls.refusal(exc))
            return False
        p.tls = 3
        return True

    def read(self, p: _Pending) -> None:
        if self._pending.get(p.sock) is not p:
            return
        if 0 < p.tls < 3 and not self._tls_step(p):
            return
        try:
            chunk = p.sock.recv(p.want - len(p.buf))
        except (BlockingIOError, InterruptedError) + _tls.WOULD_BLOCK:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(p, "it closed the connection during the handshake" if p.peer >= 0 else None)
            return
        p.buf += chunk
        if len(p.buf) < p.want:
            return
        if not p.hello_c:
            self._on_hello(p)
        else:
            self._on_proof(p)

    def _on_hello(self, p: _Pending) -> None:
        """Step 2: answer a valid HELLO with ours and our proof."""
        hello = parse_hello(bytes(p.buf), self.nonce, self.size)
        if self.tls is None and p.buf[:1] == bytes([_tls.TLS_RECORD_TYPE]):
            self._refuse(
                p,
                "a connection starting TLS (this rank has no TLS configured: the ranks' TDIST_TLS_* "
                "variables or tls_* options differ)",
            )
            return
        if hello is None or hello.rank == self.rank:
            self._drop(p, None)
            return
        if hello.stream > 0 and self._streams.get(hello.rank, hello.streams) != hello.streams:
            self._refuse(p, f"rank {hello.rank} announced {hello.streams} streams after {self._streams[hello.rank]}")
            return
        p.hello_c, p.peer, p.flags = bytes(p.buf), hello.rank, hello.flags
        p.stream, p.streams = hello.stream, hello.streams
        p.hello_a = make_hello(self.nonce, self.rank, self.size, self.has_token)
        reply = p.hello_a + mac(self.key, b"A", p.hello_c, p.hello_a)
        try:
            sent = p.sock.send(reply)
        except OSError:
            sent = 0
        if sent != len(reply):  # a fresh socket's buffer takes 88 bytes: something is wrong
            p.hello_a = b""
            self._drop(p, "the answer could not be sent")
            return
        p.buf, p.want = bytearray(), MAC_SIZE

    def _on_proof(self, p: _Pending) -> None:
        """Step 4: check the connector's proof; accept it, tell it that it was refused, or
        that this rank keeps its own connection to it (DUPLICATE)."""
        expected = mac(self.key, b"C", p.hello_c, p.hello_a)
        good = hmac.compare_digest(bytes(p.buf), expected)
        verdict = ACCEPTED if good else REFUSED
        q = p.peer
        if good and p.stream == 0:
            if q in self.partial:  # the rank retried (a later stream of its first try failed): the new one counts
                for sock in self.partial.pop(q).values():
                    sock.close()
            if self._admit(q):
                self.partial[q], self._streams[q] = {}, p.streams
            else:
                verdict = DUPLICATE
        elif good and q not in self.partial:  # a later stream of a connection not admitted
            verdict = DUPLICATE
        try:
            p.sock.send(verdict)
        except OSError:
            good = False
        if not good:
            self._drop(p, f"its proof of the token is wrong ({token_mismatch_hint(self.has_token, p.flags)})")
            return
        if verdict == DUPLICATE:
            p.peer = -1  # (not a failure of an admitted connection)
            self._drop(p, None)
            self.refused -= 1
            return
        self._forget(p)
        p.sock.setblocking(True)
        configure_socket(p.sock, 0)
        conns = self.partial[q]
        old = conns.get(p.stream)
        if old is not None:
            old.close()
        conns[p.stream] = _tls.TlsStream(p.sock) if p.tls else p.sock  # type: ignore[arg-type]
        if len(conns) == self._streams[q]:
            del self.partial[q]
            self._complete(q, [conns[i] for i in sorted(conns)])
