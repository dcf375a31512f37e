"""``TCPStoreServer``: the server of :class:`TCPStore`, one thread running an event loop.

Every connection is a non-blocking socket in one selector (epoll on Linux: the cost of a
``select`` call grows with the connections that are ready, not with those connected, so
thousands of idle clients cost memory only). Every operation runs between two selector
calls, so each is atomic. This module holds the server's life cycle: binding (every
address of the host, a deep listen backlog), the loop, its timers; the parts it mixes in:

* :mod:`.tcp_connections`: accepting, reading and writing, the handshake, TLS, shedding
  pending handshakes and running out of descriptors;
* :mod:`.tcp_requests`: the key space, the commands, parked requests;
* :mod:`.fd_limits`: the open-file limit (raised to the hard limit on :meth:`~TCPStoreServer.start`).

A request that arrives in pieces is parsed incrementally (:class:`.tcp_protocol.RequestScan`):
each piece is read once, however many there are. Timers (handshake deadlines, parked
requests' deadlines) live in one heap; an entry whose request completed stays until it
would fire, and the heap is rebuilt without them once they outnumber the live ones.
"""

from __future__ import annotations

import collections
import errno
import heapq
import hmac
import itertools
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from typing import Dict, List, Optional, Tuple, Union

from .._errors import DistNetworkError, DistStoreError
from .fd_limits import LISTEN_BACKLOG, default_max_pending, raise_descriptor_limit
from .table import KeyTable
from .tcp_connections import _READY, _RECV_BYTES, HANDSHAKE_TIMEOUT, _Conn, _Connections
from .tcp_protocol import token_bytes
from .tcp_requests import _Requests
from .tls import TlsConfig

__all__ = ["TCPStoreServer", "UnresolvableHostError", "HANDSHAKE_TIMEOUT", "default_max_pending"]

log = logging.getLogger(__name__)

_TIMERS_MIN = 4096  # the timer heap is compacted once longer than this and twice its live entries


class UnresolvableHostError(DistNetworkError):
    """The server's host name does not resolve (yet: DNS names of new machines can appear late)."""


class TCPStoreServer(_Connections, _Requests):
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
        self._max_pending_arg = max_pending
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
        self._poppers: Dict[bytes, Dict[_Conn, None]] = {}
        self._barriers: Dict[bytes, Dict[int, Dict[_Conn, None]]] = {}
        self._parked_count = 0
        self._timers: List[Tuple[float, int, _Conn, object]] = []
        self._timers_limit = _TIMERS_MIN
        self._seq = itertools.count()
        self._resume: "collections.deque[_Conn]" = collections.deque()
        self._rbuf = bytearray(_RECV_BYTES)
        self._rview = memoryview(self._rbuf)
        self._handlers = self._handler_table()

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
        return self._parked_count

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
        raise_descriptor_limit()  # a connection per client: thousands of them need more than the usual 1024
        if self._max_pending_arg is None:
            self._max_pending = default_max_pending()
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
                sock.listen(LISTEN_BACKLOG)
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
            sock.listen(LISTEN_BACKLOG)
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
        """Call back at ``delay`` s from now about ``what`` ("handshake", "listen" or a parked request)."""
        heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), conn, what))
        if len(self._timers) > self._timers_limit:
            self._compact_timers()

    def _compact_timers(self) -> None:
        """Drop the entries that can no longer fire (handshakes done, requests completed): the
        heap stays proportional to what is pending, whatever the request rate; amortised O(1)."""
        live = [t for t in self._timers if _live(t[2], t[3])]
        heapq.heapify(live)
        self._timers = live
        self._timers_limit = max(_TIMERS_MIN, 2 * len(live))

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


def _live(conn: _Conn, what: object) -> bool:
    """Whether a timer about ``what`` on ``conn`` still has something to do."""
    if what == "listen":
        return True
    if conn.closed:
        return False
    if what == "handshake":
        return conn.state != _READY
    return conn.parked is what


class _PortTaken(Exception):
    """Port 0 picked a port that another process holds on one of the other addresses: pick again."""
