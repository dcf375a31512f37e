"""The connection side of :class:`~.tcp_server.TCPStoreServer`: accepting, the handshake, TLS, eviction.

A mixin of the server (one event-loop thread runs all of it). Connections that have not
completed the handshake are the only ones an outsider can open. They get one deadline for
the whole handshake (not per byte: a client dribbling a byte a second is cut off), and at
most ``max_pending`` of them are kept: a new one evicts the oldest (an ordered dict: O(1)).
An attacker therefore costs a bounded number of file descriptors and no thread, and
authenticated clients are served throughout. Out of file descriptors (EMFILE), the server
answers the connections it cannot keep that it ran out (``OUT_OF_DESCRIPTORS``, through one
descriptor it holds in reserve), so that their clients say so at once.

With TLS (:mod:`.tls`), a connection starts with a TLS handshake done without blocking
(``do_handshake`` on the non-blocking socket), inside the same deadline and the same cap;
the token handshake then runs inside TLS. A client that does not start with TLS is told
so (a tdist client gets a hello saying TLS is required) and dropped.

Per connection the server keeps one :class:`_Conn` (slots; empty buffers until a request
arrives in pieces or a reply cannot be sent at once) and one selector registration.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import select
import selectors
import socket
import ssl
from typing import TYPE_CHECKING, Dict, List, Optional, Union

from .._oserror import describe, note, out_of_descriptors
from .tcp_protocol import (
    ACK,
    CLIENT_HELLO_BYTES,
    MAGIC,
    NAK,
    NONCE_BYTES,
    OUT_OF_DESCRIPTORS,
    PROOF_BYTES,
    TLS_REQUIRED,
    VERSION,
    ProtocolError,
    RequestScan,
    client_proof,
    server_proof,
)
from .tls import TLS_RECORD_TYPE, WOULD_BLOCK

if TYPE_CHECKING:
    from .tcp_requests import _Parked

__all__ = ["HANDSHAKE_TIMEOUT"]

log = logging.getLogger("tdist._store.tcp_server")

HANDSHAKE_TIMEOUT = 10.0
_RECV_BYTES = 256 << 10
_MAX_UNSENT = 256 << 20
_ACCEPT_BATCH = 512  # connections accepted per listener event before the loop serves the others again
_HELLO, _PROOF, _READY, _TLS_START, _TLS_SHAKE, _REFUSE = 0, 1, 2, 3, 4, 5
_AGAIN = (BlockingIOError, InterruptedError) + WOULD_BLOCK
_HELLO_HEAD = MAGIC + bytes([VERSION])


class _Conn:
    """One client connection: its socket, handshake state, unparsed input, unsent output, parked request."""

    __slots__ = (
        "sock",
        "state",
        "buf",
        "out",
        "nonce",
        "server_nonce",
        "parked",
        "writing",
        "closed",
        "pending",
        "scan",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.state = _HELLO
        self.buf = bytearray()
        self.out = bytearray()
        self.nonce = b""
        self.server_nonce = b""
        self.parked: Optional[_Parked] = None
        self.writing = False
        self.closed = False
        self.pending = True  # counted against max_pending until the handshake completes
        self.scan = RequestScan()  # how far the partial request at the start of ``buf`` was parsed


class _Connections:
    """Accepting, reading, writing and closing connections, and their handshakes (a mixin of
    the server, which provides the attributes below and the request side's methods)."""

    _host: str
    _port: int
    _token: bytes
    _tls: Optional[ssl.SSLContext]
    _sel: Optional[selectors.BaseSelector]
    _listeners: List[socket.socket]
    _stopping: bool
    _spare: Optional[int]
    _told_out_of_descriptors: bool
    _conns: Dict[int, _Conn]
    _pending: "collections.OrderedDict[_Conn, None]"
    _max_pending: int
    _handshake_timeout: float
    _rbuf: bytearray
    _rview: memoryview

    if TYPE_CHECKING:  # provided by the server and the request side

        def _timer(self, delay: float, conn: _Conn, what: object) -> None: ...

        def _serve(self, conn: _Conn, buf: Union[bytearray, memoryview]) -> int: ...

        def _process(self, conn: _Conn) -> None: ...

        def _unpark(self, conn: _Conn) -> None: ...

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, _addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: shed the oldest handshake, else refuse or pause
                log.debug("TCPStoreServer: accept failed: %s", exc)
                if out_of_descriptors(exc):
                    if not _waiting(listener):  # Linux says EMFILE before it looks for a connection
                        return
                    self._out_of_descriptors(exc)
                if self._pending:
                    self._close(next(iter(self._pending)))
                    continue
                if out_of_descriptors(exc) and self._refuse_one(listener):
                    continue
                self._pause_accepting()
                return
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            while self._pending and len(self._pending) >= self._max_pending:  # the cap holds at every moment
                self._close(next(iter(self._pending)))
            conn = _Conn(sock)
            if self._tls is not None:
                conn.state = _TLS_START
            self._conns[sock.fileno()] = conn
            self._pending[conn] = None
            assert self._sel is not None
            self._sel.register(sock, selectors.EVENT_READ, conn)
            self._timer(self._handshake_timeout, conn, "handshake")

    def _reserve(self) -> None:
        """Hold a descriptor in reserve (plaintext servers; see ``_refuse_one``)."""
        if self._spare is None and self._tls is None and not self._stopping:
            try:
                self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass

    def _out_of_descriptors(self, exc: OSError) -> None:
        """Say once (a warning in the server's process), and remember for its timeouts, that
        connections are turned away for want of file descriptors."""
        where = f"TCPStore {self._host}:{self._port}"
        note(f"the store server {where} could not accept a connection", exc)
        if not self._told_out_of_descriptors:
            self._told_out_of_descriptors = True
            log.warning("%s: cannot accept connections: %s", where, describe(exc))

    def _refuse_one(self, listener: socket.socket) -> bool:
        """Out of descriptors: accept one connection with the reserved descriptor, to answer its
        hello with OUT_OF_DESCRIPTORS (its client fails at once, saying why, instead of timing
        out); the reserve is taken back when a connection closes. False when there is no reserve."""
        if self._spare is None:
            return False
        os.close(self._spare)
        self._spare = None
        try:
            sock, _addr = listener.accept()
        except OSError:
            self._reserve()
            return False
        sock.setblocking(False)
        conn = _Conn(sock)
        conn.state, conn.pending = _REFUSE, False  # not shed for a newcomer: it has a word to say first
        self._conns[sock.fileno()] = conn
        assert self._sel is not None
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self._timer(self._handshake_timeout, conn, "handshake")
        return True

    def _pause_accepting(self) -> None:
        assert self._sel is not None
        for sock in self._listeners:
            self._sel.unregister(sock)
        self._timer(0.1, _Conn.__new__(_Conn), "listen")

    def _resume_accepting(self) -> None:
        assert self._sel is not None
        for sock in self._listeners:
            self._sel.register(sock, selectors.EVENT_READ, "listen")

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._unpark(conn)
        self._pending.pop(conn, None)
        try:
            self._conns.pop(conn.sock.fileno(), None)
            if self._sel is not None:
                self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock.close()
        if self._spare is None:
            self._reserve()

    def _on_read(self, conn: _Conn) -> None:
        try:  # into one preallocated buffer: recv(n) would allocate (mmap) n bytes per call
            size = conn.sock.recv_into(self._rbuf)
        except _AGAIN:
            return
        except OSError:
            self._close(conn)
            return
        if not size:
            self._close(conn)
            return
        if conn.state == _READY and conn.parked is None and not conn.buf:
            try:  # the common case: serve straight from the receive buffer, keep only a partial request
                data = self._rview[:size]
                used = self._serve(conn, data)
                if used < size and not conn.closed:
                    conn.buf += data[used:]
            except Exception as exc:  # noqa: BLE001 - whatever one client caused ends only its connection
                self._drop(conn, exc)
            return
        conn.buf += self._rview[:size]
        try:
            if conn.state != _READY:
                self._handshake(conn)
            if conn.state == _READY and conn.parked is None:
                self._process(conn)
        except Exception as exc:  # noqa: BLE001 - whatever one client caused ends only its connection
            self._drop(conn, exc)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if not conn.out:  # the common case: nothing queued, send directly
            try:
                sent = conn.sock.send(data)
            except _AGAIN:
                sent = 0
            except OSError:
                self._close(conn)
                return
            if sent == len(data):
                return
            data = data[sent:]
        conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.out:
            try:
                sent = conn.sock.send(conn.out)
                del conn.out[:sent]
            except _AGAIN:
                pass
            except OSError:
                self._close(conn)
                return
        want_write = bool(conn.out)
        if want_write != conn.writing:
            if want_write and len(conn.out) > _MAX_UNSENT:  # a client that never reads its replies
                self._close(conn)
                return
            conn.writing = want_write
            assert self._sel is not None
            self._sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0), conn)

    # ----------------------------------------------------------------- TLS
    def _on_read_tls(self, conn: _Conn) -> None:
        """``_on_read`` of a TLS server: the TLS handshake first, then read until the TLS
        layer holds no decrypted bytes (the selector cannot see those)."""
        if conn.state == _TLS_START:
            self._tls_start(conn)
            return
        if conn.state == _TLS_SHAKE:
            self._tls_shake(conn)
            if conn.state == _TLS_SHAKE or conn.closed:
                return
        while True:
            _Connections._on_read(self, conn)
            if conn.closed or not conn.sock.pending():  # type: ignore[attr-defined]
                return

    def _flush_tls(self, conn: _Conn) -> None:
        if conn.state == _TLS_SHAKE:
            self._tls_shake(conn)
        else:
            _Connections._flush(self, conn)

    def _tls_start(self, conn: _Conn) -> None:
        """Peek at the first byte: a TLS ClientHello starts the TLS handshake; a plaintext
        tdist client is told that TLS is required; anything else is dropped."""
        try:
            first = conn.sock.recv(1, socket.MSG_PEEK)
        except _AGAIN:
            return
        except OSError:
            self._close(conn)
            return
        if first and first[0] == TLS_RECORD_TYPE:
            assert self._sel is not None and self._tls is not None
            self._sel.unregister(conn.sock)
            conn.sock = self._tls.wrap_socket(conn.sock, server_side=True, do_handshake_on_connect=False)
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            conn.writing, conn.state = False, _TLS_SHAKE
            self._tls_shake(conn)
            return
        if first == MAGIC[:1]:
            try:  # consume its hello, so that closing does not reset the connection before it reads ours
                conn.sock.recv(4096)
                conn.sock.send(MAGIC + bytes([VERSION, TLS_REQUIRED]) + bytes(NONCE_BYTES))
            except OSError:
                pass
        log.debug("TCPStoreServer: dropping a connection that does not start with TLS")
        self._close(conn)

    def _tls_shake(self, conn: _Conn) -> None:
        """One non-blocking step of the TLS handshake (the handshake deadline bounds them all)."""
        want_write = False
        try:
            conn.sock.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLWantWriteError:
            want_write = True
        except (ssl.SSLError, OSError) as exc:
            log.debug("TCPStoreServer: TLS handshake failed: %s", exc)
            self._close(conn)
            return
        else:
            conn.state = _HELLO
        if want_write != conn.writing:
            conn.writing = want_write
            assert self._sel is not None
            self._sel.modify(conn.sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0), conn)

    # ----------------------------------------------------------------- handshake
    def _handshake(self, conn: _Conn) -> None:
        buf = conn.buf
        if conn.state == _REFUSE:  # read its hello (so that closing does not reset the connection), then say why
            if len(buf) < CLIENT_HELLO_BYTES and _HELLO_HEAD.startswith(bytes(buf[: len(_HELLO_HEAD)])):
                return
            self._send(conn, MAGIC + bytes([VERSION, OUT_OF_DESCRIPTORS]) + bytes(NONCE_BYTES))
            raise ProtocolError("out of file descriptors: refused a connection")
        if conn.state == _HELLO:
            if self._tls is None and buf[:1] == bytes([TLS_RECORD_TYPE]):  # a TLS client: answer in plaintext,
                self._send(conn, MAGIC + bytes([VERSION, 0]) + bytes(NONCE_BYTES))  # which it reports
                raise ProtocolError("a TLS client; this server runs without TLS")
            head = bytes(buf[: len(_HELLO_HEAD)])
            if not _HELLO_HEAD.startswith(head):  # checked from the first byte: garbage is dropped at once
                raise ProtocolError("bad handshake magic or version")
            if len(buf) < CLIENT_HELLO_BYTES:
                return
            conn.nonce = bytes(buf[len(MAGIC) + 1 : CLIENT_HELLO_BYTES])
            del buf[:CLIENT_HELLO_BYTES]
            conn.server_nonce = os.urandom(NONCE_BYTES)
            hello = MAGIC + bytes([VERSION, 1 if self._token else 0]) + conn.server_nonce
            if self._token:
                self._send(conn, hello + server_proof(self._token, conn.nonce, conn.server_nonce))
                conn.state = _PROOF
            else:
                self._send(conn, hello)
                self._authenticated(conn)
                return
        if conn.state == _PROOF:
            if len(buf) < PROOF_BYTES:
                return
            proof = bytes(buf[:PROOF_BYTES])
            del buf[:PROOF_BYTES]
            if not hmac.compare_digest(proof, client_proof(self._token, conn.nonce, conn.server_nonce)):
                self._send(conn, NAK)
                raise ProtocolError("authentication failed")
            self._send(conn, ACK)
            self._authenticated(conn)

    def _authenticated(self, conn: _Conn) -> None:
        conn.state = _READY
        conn.pending = False
        conn.nonce = conn.server_nonce = b""
        self._pending.pop(conn, None)

    def _drop(self, conn: _Conn, exc: Exception) -> None:
        """Close ``conn`` after it broke the protocol (or, logged loudly, hit a server bug)."""
        if isinstance(exc, (ProtocolError, ValueError, UnicodeError)):
            log.debug("TCPStoreServer: dropping a connection: %s", exc)
        else:
            log.error(
                "TCPStoreServer %s:%s: dropping a connection after an internal error",
                self._host,
                self._port,
                exc_info=exc,
            )
        self._close(conn)


def _waiting(listener: socket.socket) -> bool:
    """Whether a connection waits on ``listener`` (poll needs no descriptor of its own)."""
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    return bool(poller.poll(0))
