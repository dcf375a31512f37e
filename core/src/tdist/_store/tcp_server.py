"""``TCPStoreServer``: the server of :class:`TCPStore`, one thread running an event loop.

Every connection is a non-blocking socket in one selector; a request that must wait
(``get`` of a missing key, ``wait``, ``multi_get``, a blocking ``queue_pop``, ``barrier``)
parks its connection until a change to one of its keys completes it or its deadline
passes. Every operation runs between two selector calls, so each is atomic.

Connections that have not completed the handshake are the only ones an outsider can open.
They get one deadline for the whole handshake (not per byte: a client dribbling a byte a
second is cut off), and at most ``max_pending`` of them are kept: a new one evicts the
oldest. An attacker therefore costs a bounded number of file descriptors and no thread,
and authenticated clients are served throughout. Out of file descriptors (EMFILE), the
server answers the connections it cannot keep that it ran out (``OUT_OF_DESCRIPTORS``,
through one descriptor it holds in reserve), so that their clients say so at once.

A request that arrives in pieces is parsed incrementally (:class:`.tcp_protocol.RequestScan`):
each piece is read once, however many there are.

With TLS (:mod:`.tls`), a connection starts with a TLS handshake done without blocking
(``do_handshake`` on the non-blocking socket), inside the same deadline and the same cap;
the token handshake then runs inside TLS. A client that does not start with TLS is told
so (a tdist client gets a hello saying TLS is required) and dropped.
"""

from __future__ import annotations

import collections
import errno
import heapq
import hmac
import itertools
import logging
import os
import resource
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple, Union

from .._errors import DistNetworkError, DistStoreError
from .._oserror import describe, note, out_of_descriptors
from .table import KeyTable
from .tcp_protocol import (
    ACK,
    ADD,
    APPEND,
    BARRIER,
    CHECK,
    CLIENT_HELLO_BYTES,
    COMPARE_SET,
    DELETE,
    EMPTY,
    ERROR,
    GET,
    LIST_KEYS,
    MAGIC,
    MULTI_GET,
    MULTI_SET,
    NAK,
    NONCE_BYTES,
    NUM_KEYS,
    OK,
    OUT_OF_DESCRIPTORS,
    PING,
    PROOF_BYTES,
    QUEUE_LEN,
    QUEUE_POP,
    QUEUE_PUSH,
    SET,
    TIMEOUT,
    TLS_REQUIRED,
    VERSION,
    WAIT,
    ProtocolError,
    RequestScan,
    client_proof,
    encode_list,
    encode_reply,
    parse_request,
    server_proof,
    timeout_arg,
    token_bytes,
)
from .tls import TLS_RECORD_TYPE, WOULD_BLOCK, TlsConfig

__all__ = ["TCPStoreServer", "UnresolvableHostError", "HANDSHAKE_TIMEOUT", "default_max_pending"]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
_RECV_BYTES = 256 << 10
_MAX_UNSENT = 256 << 20
_HELLO, _PROOF, _READY, _TLS_START, _TLS_SHAKE, _REFUSE = 0, 1, 2, 3, 4, 5
_AGAIN = (BlockingIOError, InterruptedError) + WOULD_BLOCK
_HELLO_HEAD = MAGIC + bytes([VERSION])
_OK_EMPTY = encode_reply(OK)
_TRUE, _FALSE = encode_reply(OK, b"\x01"), encode_reply(OK, b"\x00")


def default_max_pending() -> int:
    """Connections allowed to be mid-handshake at once: a quarter of the descriptor limit, 16..1024."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, min(1024, soft // 4))


class UnresolvableHostError(DistNetworkError):
    """The server's host name does not resolve (yet: DNS names of new machines can appear late)."""


class _Parked:
    """A request waiting for keys: what it is, for which keys, until when."""

    __slots__ = ("kind", "keys", "extra")

    def __init__(self, kind: int, keys: List[bytes], extra: int = 0) -> None:
        self.kind, self.keys, self.extra = kind, keys, extra


class _Conn:
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


class TCPStoreServer:
    """The server side of :class:`TCPStore`: a key-value table served by one event-loop thread.

    Listens on every address ``host`` resolves to (``""`` means every interface, and only
    when asked); ``port=0`` picks a free port, see :attr:`port`. ``listen_fd`` takes over an
    already bound socket instead (torch's ``master_listen_fd``). ``token`` (default
    ``$TDIST_STORE_TOKEN``) makes the server and every client prove to each other that they
    know the secret. ``tls`` (default: from the ``TDIST_TLS_*`` variables; False: off) serves
    every connection over TLS. Call :meth:`start`, and :meth:`stop` to close the sockets and end the thread.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        token: Union[bytes, str, None] = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        max_pending: Optional[int] = None,
        listen_fd: Optional[int] = None,
        tls: Union[TlsConfig, None, bool] = None,
    ) -> None:
        self._host = host
        self._requested_port = int(port)
        self._token = token_bytes(token)
        self._handshake_timeout = float(handshake_timeout)
        self._max_pending = max_pending if max_pending is not None else default_max_pending()
        self._listen_fd = listen_fd
        self._table = KeyTable(f"TCPStore {host}:{port}")
        tls = TlsConfig.resolve(tls)
        self._tls: Optional[ssl.SSLContext] = tls.server_context(self._where()) if tls is not None else None
        if self._tls is not None:  # only TLS servers pay for the handshake state and the pending() loop
            self._on_read = self._on_read_tls  # type: ignore[method-assign]
            self._flush = self._flush_tls  # type: ignore[method-assign]
        self._listeners: List[socket.socket] = []
        self._sockname: Tuple = ()
        self._port = self._requested_port
        self._sel: Optional[selectors.BaseSelector] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        #: a descriptor held in reserve: out of descriptors, the server closes it to accept one
        #: connection and tell its client why it cannot serve it (plaintext servers)
        self._spare: Optional[int] = None
        self._told_out_of_descriptors = False
        self._conns: Dict[int, _Conn] = {}
        self._pending: "collections.OrderedDict[_Conn, None]" = collections.OrderedDict()
        self._waiters: Dict[bytes, Dict[_Conn, None]] = {}
        self._timers: List[Tuple[float, int, _Conn, object]] = []
        self._seq = itertools.count()
        self._resume: "collections.deque[_Conn]" = collections.deque()
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._handlers: Dict[int, Callable[[_Conn, List[bytes]], Optional[bytes]]] = {
            SET: self._set,
            GET: self._get,
            ADD: self._add,
            COMPARE_SET: self._compare_set,
            WAIT: self._wait,
            CHECK: self._check,
            DELETE: self._delete,
            NUM_KEYS: self._num_keys,
            PING: self._ping,
            APPEND: self._append,
            MULTI_GET: self._multi_get,
            MULTI_SET: self._multi_set,
            QUEUE_PUSH: self._queue_push,
            QUEUE_POP: self._queue_pop,
            QUEUE_LEN: self._queue_len,
            LIST_KEYS: self._list_keys,
            BARRIER: self._barrier,
        }

    # ----------------------------------------------------------------- public
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The port listened on (the chosen one when constructed with ``port=0``)."""
        return self.sockname[1]

    @property
    def sockname(self) -> Tuple:
        """The first bound address, as ``socket.getsockname()`` gave it."""
        if not self._sockname:
            raise DistStoreError(f"TCPStoreServer {self._host}:{self._port}: not started")
        return self._sockname

    @property
    def authenticates(self) -> bool:
        """Whether clients must prove they know a token."""
        return bool(self._token)

    @property
    def uses_tls(self) -> bool:
        """Whether connections are served over TLS."""
        return self._tls is not None

    @property
    def pending_handshakes(self) -> int:
        """Connections accepted whose handshake has not completed yet."""
        return len(self._pending)

    @property
    def parked_requests(self) -> int:
        """Requests waiting for keys (a get of a missing key, a wait, a blocking pop, a barrier)."""
        return sum(1 for conn in list(self._conns.values()) if conn.parked is not None)

    @property
    def connections(self) -> int:
        """Open client connections (mid-handshake ones included)."""
        return len(self._conns)

    def token_matches(self, token: bytes) -> bool:
        return hmac.compare_digest(self._token, token)

    def __repr__(self) -> str:
        state = "listening" if self._listeners and not self._stopping else "stopped"
        return f"<TCPStoreServer {self._host}:{self._port} {state}>"

    def start(self) -> "TCPStoreServer":
        """Bind, listen and start the event loop; returns ``self`` (a no-op once started: no restarts)."""
        if self._listeners:
            return self
        self._listeners = self._adopt(self._listen_fd) if self._listen_fd is not None else self._bind()
        self._sockname = self._listeners[0].getsockname()
        self._port = self._sockname[1]
        self._table.owner = f"TCPStore {self._host}:{self._port}"
        self._sel = selectors.DefaultSelector()
        self._reserve()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        for sock in self._listeners:
            self._sel.register(sock, selectors.EVENT_READ, "listen")
        self._thread = threading.Thread(target=self._run, name=f"tdist-store:{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening sockets and every connection; wait up to ``timeout`` s for the thread."""
        if self._stopping:
            return
        self._stopping = True
        if self._wake_w is not None:
            try:
                self._wake_w.send(b"x")
            except OSError:
                pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        elif thread is None:
            self._close_all()

    def __enter__(self) -> "TCPStoreServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- sockets
    def _where(self) -> str:
        return f"TCPStore {self._host}:{self._requested_port}"

    def _bind(self) -> List[socket.socket]:
        host = None if self._host == "" else self._host
        try:
            infos = socket.getaddrinfo(host, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise UnresolvableHostError(f"{self._where()}: the host name does not resolve: {exc}") from exc
        seen, addrs = set(), []
        for family, socktype, proto, _, addr in infos:
            if (family, addr[0]) not in seen:
                seen.add((family, addr[0]))
                addrs.append((family, socktype, proto, addr))
        for _attempt in range(8):  # port 0 on several addresses: another process may hold the port on one
            try:
                return self._bind_all(addrs)
            except _PortTaken:
                continue
        return self._bind_all(addrs, final=True)

    def _bind_all(self, addrs: List[Tuple], final: bool = False) -> List[socket.socket]:
        socks: List[socket.socket] = []
        port, error = self._requested_port, None
        for family, socktype, proto, addr in addrs:
            sock = socket.socket(family, socktype, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((addr[0], port) + tuple(addr[2:]))
                sock.listen(1024)
            except OSError as exc:
                sock.close()
                if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) and len(addrs) > 1:
                    error = exc  # e.g. no IPv6 on this machine: serve the other addresses
                    continue
                for s in socks:
                    s.close()
                if exc.errno == errno.EADDRINUSE and self._requested_port == 0 and socks and not final:
                    raise _PortTaken() from exc
                raise DistNetworkError(
                    "The server socket has failed to listen on any local network address. "
                    f"{self._where()}: cannot listen on {addr[0]} port {port}: {exc}"
                ) from exc
            sock.setblocking(False)
            socks.append(sock)
            port = sock.getsockname()[1]
        if not socks:
            raise DistNetworkError(
                f"The server socket has failed to listen on any local network address. {self._where()}: {error}"
            )
        return socks

    def _adopt(self, fd: int) -> List[socket.socket]:
        try:
            sock = socket.socket(fileno=fd)
            sock.listen(1024)
        except OSError as exc:
            raise DistNetworkError(
                f"{self._where()}: cannot listen on the socket of master_listen_fd={fd}: {exc}"
            ) from exc
        sock.setblocking(False)
        return [sock]

    # ----------------------------------------------------------------- event loop
    def _run(self) -> None:
        sel = self._sel
        assert sel is not None
        try:
            while not self._stopping:
                for key, mask in sel.select(self._next_delay()):
                    conn = key.data
                    if type(conn) is _Conn:
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._on_read(conn)
                        if mask & selectors.EVENT_WRITE and not conn.closed:
                            self._flush(conn)
                        if self._resume:
                            self._drain_resume()
                    elif conn == "listen":
                        self._accept(key.fileobj)  # type: ignore[arg-type]
                    else:  # "wake": stop() was called
                        return
                if self._timers and self._timers[0][0] <= time.monotonic():
                    self._fire_timers()
        except Exception:  # a bug must not leave clients hanging: they see the connection close
            log.exception("TCPStoreServer %s:%s: event loop failed", self._host, self._port)
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for conn in list(self._conns.values()):
            self._close(conn)
        for sock in self._listeners:
            sock.close()
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                wake.close()
        if self._sel is not None:
            self._sel.close()
        if self._spare is not None:
            os.close(self._spare)
            self._spare = None

    def _next_delay(self) -> Optional[float]:
        if self._resume:
            return 0.0
        if not self._timers:
            return None
        return min(max(0.0, self._timers[0][0] - time.monotonic()), 3600.0)

    def _timer(self, delay: float, conn: _Conn, what: object) -> None:
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), conn, what))

    def _fire_timers(self) -> None:
        now = time.monotonic()
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, conn, what = heapq.heappop(timers)
            if what == "listen":
                self._resume_accepting()
            elif conn.closed:
                continue
            elif what == "handshake":
                if conn.state != _READY:
                    log.debug("TCPStoreServer: handshake deadline passed; dropping a connection")
                    self._close(conn)
            elif conn.parked is what:
                self._expire(conn, what)  # type: ignore[arg-type]
        self._drain_resume()

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(256):
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
            TCPStoreServer._on_read(self, conn)
            if conn.closed or not conn.sock.pending():  # type: ignore[attr-defined]
                return

    def _flush_tls(self, conn: _Conn) -> None:
        if conn.state == _TLS_SHAKE:
            self._tls_shake(conn)
        else:
            TCPStoreServer._flush(self, conn)

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
        self._pending.pop(conn, None)

    # ----------------------------------------------------------------- requests
    def _process(self, conn: _Conn) -> None:
        """Serve the complete requests buffered on ``conn`` until one parks it."""
        used = self._serve(conn, conn.buf)
        if used:
            del conn.buf[:used]

    def _serve(self, conn: _Conn, buf: Union[bytearray, memoryview]) -> int:
        """Serve the complete requests in ``buf`` until one parks ``conn``; return the bytes used."""
        pos, replies = 0, []
        handlers, scan = self._handlers, conn.scan
        while conn.parked is None and not conn.closed:
            request = parse_request(buf, pos, scan)
            if request is None:
                break
            cmd, args, pos = request
            reply = handlers[cmd](conn, args)
            if reply is not None:
                replies.append(reply)
        if replies and not conn.closed:
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
        return pos

    def _drain_resume(self) -> None:
        while self._resume:
            conn = self._resume.popleft()
            if not conn.closed and conn.parked is None:
                try:
                    self._process(conn)
                except Exception as exc:  # noqa: BLE001 - as in _on_read
                    self._drop(conn, exc)

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

    def _changed(self, key: bytes) -> None:
        """``key`` changed: complete the parked requests it may satisfy, oldest first."""
        waiting = self._waiters.get(key)
        if not waiting:
            return
        for conn in list(waiting):
            parked = conn.parked
            if parked is None:
                continue
            reply = self._try(parked)
            if reply is not None:
                self._unpark(conn)
                self._send(conn, reply)
                self._resume.append(conn)

    def _park(self, conn: _Conn, parked: _Parked, timeout: float) -> None:
        conn.parked = parked
        for key in parked.keys:
            self._waiters.setdefault(key, {})[conn] = None
        self._timer(timeout, conn, parked)

    def _unpark(self, conn: _Conn) -> None:
        parked, conn.parked = conn.parked, None
        if parked is None:
            return
        for key in parked.keys:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.pop(conn, None)
                if not waiting:
                    del self._waiters[key]

    def _try(self, parked: _Parked) -> Optional[bytes]:
        """The reply completing ``parked``, or None while it must keep waiting."""
        table, kind = self._table, parked.kind
        if kind == GET:
            value = table.values.get(parked.keys[0])
            return None if value is None else encode_reply(OK, value)
        if kind == WAIT:
            return None if table.missing(parked.keys) else _OK_EMPTY
        if kind == MULTI_GET:
            values = table.values
            if any(k not in values for k in parked.keys):
                return None
            return encode_reply(OK, encode_list([values[k] for k in parked.keys]))
        if kind == QUEUE_POP:
            value = table.queue_pop(parked.keys[0])
            return None if value is None else encode_reply(OK, value)
        # BARRIER: the counter reached the world size
        try:
            arrived = int(table.values.get(parked.keys[0], b"0"))
        except ValueError:
            return encode_reply(ERROR, b"barrier: the barrier key was overwritten with a non-integer")
        return _OK_EMPTY if arrived >= parked.extra else None

    def _timed_out(self, parked: _Parked) -> bytes:
        """The TIMEOUT reply: the keys still missing (a barrier: its key and how many arrived)."""
        if parked.kind == BARRIER:
            missing = [parked.keys[0], self._table.values.get(parked.keys[0], b"0")]
        else:
            missing = [k for k in parked.keys if not self._table.has(k)] or parked.keys
        return encode_reply(TIMEOUT, encode_list(missing))

    def _expire(self, conn: _Conn, parked: _Parked) -> None:
        self._unpark(conn)
        self._send(conn, self._timed_out(parked))
        self._resume.append(conn)

    def _blocking(self, conn: _Conn, parked: _Parked, timeout: float) -> Optional[bytes]:
        reply = self._try(parked)
        if reply is not None:
            return reply
        if timeout <= 0:
            return self._timed_out(parked)
        self._park(conn, parked, timeout)
        return None

    # ----------------------------------------------------------------- commands
    def _set(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.values[args[0]] = args[1]
        self._changed(args[0])
        return _OK_EMPTY

    def _get(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(GET, args[1:]), timeout_arg(args[0]))

    def _wait(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(WAIT, args[1:]), timeout_arg(args[0]))

    def _multi_get(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(MULTI_GET, args[1:]), timeout_arg(args[0]))

    def _add(self, conn: _Conn, args: List[bytes]) -> bytes:
        if len(args[1]) > 32:
            raise ProtocolError("bad ADD amount")
        amount = int(args[1])  # ValueError drops the connection
        try:
            value = self._table.add(args[0], amount)
        except DistStoreError as exc:
            return encode_reply(ERROR, str(exc).encode())
        self._changed(args[0])
        return encode_reply(OK, value)

    def _compare_set(self, conn: _Conn, args: List[bytes]) -> bytes:
        stored, result = self._table.compare_set(args[0], args[1], args[2])
        if stored:
            self._changed(args[0])
        return encode_reply(OK, result)

    def _check(self, conn: _Conn, args: List[bytes]) -> bytes:
        return _FALSE if self._table.missing(args) else _TRUE

    def _delete(self, conn: _Conn, args: List[bytes]) -> bytes:
        return _TRUE if self._table.delete(args[0]) else _FALSE

    def _num_keys(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, str(self._table.num_keys()).encode())

    def _ping(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, args[0] if args else b"")

    def _append(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.append(args[0], args[1])
        self._changed(args[0])
        return _OK_EMPTY

    def _multi_set(self, conn: _Conn, args: List[bytes]) -> bytes:
        if len(args) % 2:
            raise ProtocolError("MULTI_SET with an odd number of arguments")
        values = self._table.values
        for i in range(0, len(args), 2):
            values[args[i]] = args[i + 1]
        for i in range(0, len(args), 2):
            self._changed(args[i])
        return _OK_EMPTY

    def _queue_push(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.queue_push(args[0], args[1])
        self._changed(args[0])
        return _OK_EMPTY

    def _queue_pop(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        block, timeout, key = args[0] != b"\x00", timeout_arg(args[1]), args[2]
        if not block:
            value = self._table.queue_pop(key)
            return encode_reply(EMPTY) if value is None else encode_reply(OK, value)
        return self._blocking(conn, _Parked(QUEUE_POP, [key]), timeout)

    def _queue_len(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, str(self._table.queue_len(args[0])).encode())

    def _list_keys(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, encode_list([k.encode() for k in self._table.list_keys()]))

    def _barrier(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        timeout, key = timeout_arg(args[0]), args[1]
        if len(args[2]) > 32:
            raise ProtocolError("bad BARRIER world size")
        world_size = int(args[2])
        try:
            self._table.add(key, 1)
        except DistStoreError as exc:
            return encode_reply(ERROR, str(exc).encode())
        self._changed(key)
        return self._blocking(conn, _Parked(BARRIER, [key], world_size), timeout)


def _waiting(listener: socket.socket) -> bool:
    """Whether a connection waits on ``listener`` (poll needs no descriptor of its own)."""
    poller = select.poll()
    poller.register(listener, select.POLLIN)
    return bool(poller.poll(0))


class _PortTaken(Exception):
    """Port 0 picked a port that another process holds on one of the other addresses: pick again."""
