"""Connection setup: every rank listens, publishes ``tcp/addr/<rank>`` in the group's
store, then rank i connects to every rank j < i and accepts every rank j > i. Over TCP
a pair may use several connections (``streams``, chosen by the connecting rank, each
handshaken on its own); a Unix-domain pair uses one.

Every connection (TCP or Unix-domain) is mutually authenticated before it carries a
frame: both ends prove they know the group's key (see :mod:`tdist_tcp.auth`), over
the group nonce rank 0 published as ``tcp/nonce`` and fresh nonces of both ends.
A connection that fails is closed and the acceptor keeps listening; a connector
whose peer fails to prove the key, or refuses its proof, raises at once. Everything
honours one deadline; on timeout the error names the missing ranks (and why
connections claiming to be them were refused).
"""

from __future__ import annotations

import hmac
import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

from tdist.plugin import (
    DistBackendTimeoutError,
    DistNetworkError,
    DistStoreTimeoutError,
    descriptor_shortage,
    flag,
    route_address,
    store_endpoint,
)

from . import tls as _tls
from .auth import (
    ACCEPTED,
    HELLO,
    MAC_SIZE,
    MAX_STREAMS,
    REFUSED,
    group_key,
    mac,
    make_hello,
    parse_hello,
    token_mismatch_hint,
)

__all__ = [
    "choose_host",
    "configure_socket",
    "connect_mesh",
    "stream_count",
    "Mesh",
    "HOST_ENV",
    "IFNAME_ENV",
    "STREAMS_ENV",
]

HOST_ENV = "TDIST_TCP_HOST"
IFNAME_ENV = "TDIST_TCP_IFNAME"
UNIX_ENV = "TDIST_TCP_UNIX"
STREAMS_ENV = "TDIST_TCP_STREAMS"
ADDR_KEY = "tcp/addr/{}"
UNIX_KEY = "tcp/unix/{}"
_AF_UNIX = getattr(socket, "AF_UNIX", -1)
NONCE_KEY = "tcp/nonce"
#: a rank whose acceptor ran out of file descriptors says so here (group nonce, rank), for its connectors
EXHAUSTED_KEY = "tcp/exhausted/{}/{}"
DEFAULT_SOCKET_BUFFER = 4 << 20
TOKEN_ENV = "TDIST_STORE_TOKEN"  # named in errors: the core derives the factory's secret from it
#: unauthenticated connections an acceptor holds at once (beyond, the oldest is dropped)
MAX_PENDING = 64
#: seconds a connection may take for its whole handshake
HANDSHAKE_LIMIT = 10.0


# ------------------------------------------------------------------ addresses
def _interface_address(ifname: str) -> str:
    import fcntl  # Linux / BSD only

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            raise DistNetworkError(f"tcp backend: network interface {ifname!r} has no IPv4 address: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def choose_host(store: Any, options: Mapping[str, Any]) -> str:
    """The address to listen on and publish: ``options["host"]``, ``$TDIST_TCP_HOST``,
    ``options["ifname"]`` / ``$TDIST_TCP_IFNAME``, the local address of the route to the
    store's server, else this host name's address (127.0.0.1 when it does not resolve)."""
    host = options.get("host") or os.environ.get(HOST_ENV)
    if host:
        return str(host)
    ifname = options.get("ifname") or os.environ.get(IFNAME_ENV)
    if ifname:
        return _interface_address(str(ifname))
    store_host, _ = store_endpoint(store)
    routed = route_address(store_host) if store_host else None
    if routed:
        return routed
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _parse_addr(value: bytes) -> tuple[str, int]:
    text = value.decode()
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


# -------------------------------------------------------------------- sockets
def configure_socket(sock: socket.socket, buffer_bytes: int) -> None:
    """TCP_NODELAY, keepalive (TCP only) and large kernel buffers (before connect/listen)."""
    if sock.family != _AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if buffer_bytes > 0:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
            except OSError:
                pass


class _AuthFailed(Exception):
    """The other end of a connection failed authentication, or refused ours (never retried)."""


class _Pending:
    """An accepted connection still in its handshake: reading ``want`` bytes into ``buf``."""

    __slots__ = ("sock", "buf", "want", "limit", "hello_c", "hello_a", "peer", "flags", "tls", "stream", "streams")

    def __init__(self, sock: socket.socket, limit: float) -> None:
        self.sock = sock
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


class _Acceptor(threading.Thread):
    """Accepts the higher ranks' connections until all arrived, the deadline passes or it is stopped.

    Handshakes are read without blocking, so a silent, slow or garbage connection is
    dropped without delaying the others; each must complete within
    :data:`HANDSHAKE_LIMIT` seconds, and beyond :data:`MAX_PENDING` unfinished ones the
    oldest is dropped. A rank counts as connected only once it proved the group key.
    """

    def __init__(
        self,
        listeners: list[socket.socket],
        rank: int,
        size: int,
        nonce: bytes,
        key: bytes,
        has_token: bool,
        deadline: float,
        tls: Optional[_tls.MeshTls] = None,
    ) -> None:
        super().__init__(name=f"tdist-tcp-accept-r{rank}", daemon=True)
        self.listeners = listeners
        self.tls = tls  # serves the TCP listener (listeners[0]) only
        self.rank = rank
        self.size = size
        self.nonce = nonce
        self.key = key
        self.has_token = has_token
        self.deadline = deadline
        #: each higher rank's connections, by stream index
        self.accepted: dict[int, dict[int, socket.socket]] = {}
        self._streams: dict[int, int] = {}  # how many streams each connecting rank announced
        self.refused = 0
        self.refusals: list[str] = []  # why connections that claimed a wanted rank were refused
        self.exhausted = ""  # why accepting failed for want of file descriptors, if it did
        self.on_exhausted: Optional[Callable[[str], None]] = None  # told that, once
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()
        self._wanted = set(range(rank + 1, size))
        self._pending: dict[socket.socket, _Pending] = {}
        self._sel: Any = None

    def run(self) -> None:
        try:
            sel = self._sel = selectors.DefaultSelector()
        except OSError as exc:  # e.g. out of file descriptors: reported by connect_mesh
            self.error = exc
            self._descriptor_shortage(exc)
            return
        try:
            for listener in self.listeners:
                listener.setblocking(False)
                sel.register(listener, selectors.EVENT_READ)
            while self._wanted - set(self.complete()) and not self.stop.is_set() and time.monotonic() < self.deadline:
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    if sock in self.listeners:
                        self._accept(sock)
                    else:
                        self._read(self._pending[sock])  # type: ignore[index]
                now = time.monotonic()
                for p in [p for p in self._pending.values() if p.limit < now]:  # too slow: dropped
                    self._drop(p, "it did not complete the handshake in time" if p.peer >= 0 else None)
        except BaseException as exc:  # reported by connect_mesh
            self.error = exc
        finally:
            for p in list(self._pending.values()):
                self._drop(p, None)
            sel.close()

    def complete(self) -> dict[int, list[socket.socket]]:
        """The ranks whose every stream is connected: their sockets, stream 0 first."""
        return {
            q: [conns[i] for i in sorted(conns)]
            for q, conns in self.accepted.items()
            if len(conns) == self._streams.get(q, 0)
        }

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _addr = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # e.g. out of file descriptors: the connector retries
            if self._descriptor_shortage(exc):  # said in this rank's timeout error; wait, rather than spin
                time.sleep(0.05)
            return
        if len(self._pending) >= MAX_PENDING:
            self._drop(next(iter(self._pending.values())), None)  # the oldest
        conn.setblocking(False)
        p = _Pending(conn, min(self.deadline, time.monotonic() + HANDSHAKE_LIMIT))
        p.tls = 1 if self.tls is not None and listener is self.listeners[0] else 0
        self._pending[conn] = p
        self._sel.register(conn, selectors.EVENT_READ)

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

    def _drop(self, p: _Pending, reason: Optional[str]) -> None:
        self._pending.pop(p.sock, None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()
        self.refused += 1
        if reason and len(self.refusals) < 8:
            self.refusals.append(f"a connection claiming rank {p.peer}: {reason}")

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
            self._sel.unregister(p.sock)
            del self._pending[p.sock]
            p.sock, p.tls = self.tls.accept(p.sock), 2
            self._pending[p.sock] = p
            self._sel.register(p.sock, selectors.EVENT_READ)
        try:
            if not _tls.shake(p.sock):  # type: ignore[arg-type]
                return False
        except OSError as exc:
            self._refuse(p, _tls.refusal(exc))
            return False
        p.tls = 3
        return True

    def _read(self, p: _Pending) -> None:
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
        if hello is None or hello.rank not in self._wanted:
            self._drop(p, None)
            return
        if self._streams.get(hello.rank, hello.streams) != hello.streams:
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
            self._drop(p, "the answer could not be sent")
            return
        p.buf, p.want = bytearray(), MAC_SIZE

    def _on_proof(self, p: _Pending) -> None:
        """Step 4: check the connector's proof; accept it or tell it that it was refused."""
        expected = mac(self.key, b"C", p.hello_c, p.hello_a)
        good = hmac.compare_digest(bytes(p.buf), expected)
        try:
            p.sock.send(ACCEPTED if good else REFUSED)
        except OSError:
            good = False
        if not good:
            self._drop(p, f"its proof of the token is wrong ({token_mismatch_hint(self.has_token, p.flags)})")
            return
        self._pending.pop(p.sock)
        self._sel.unregister(p.sock)
        p.sock.setblocking(True)
        configure_socket(p.sock, 0)
        self._streams[p.peer] = p.streams
        conns = self.accepted.setdefault(p.peer, {})
        old = conns.get(p.stream)
        if old is not None:  # the rank retried (a later stream of its first try failed): the new one counts
            old.close()
        conns[p.stream] = _tls.TlsStream(p.sock) if p.tls else p.sock  # type: ignore


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _handshake(
    sock: socket.socket,
    nonce: bytes,
    key: bytes,
    has_token: bool,
    rank: int,
    size: int,
    peer: int,
    deadline: float,
    stream: int = 0,
    streams: int = 1,
) -> bool:
    """Run the connector's side of the handshake with ``peer`` (for connection ``stream``
    of ``streams``): True once it accepted us, False if the other end is not ``peer`` of
    this group (retry later); raises :class:`_AuthFailed` if either side's proof fails."""
    hello_c = make_hello(nonce, rank, size, has_token, stream, streams)
    sock.settimeout(max(0.05, min(HANDSHAKE_LIMIT, deadline - time.monotonic())))
    sock.sendall(hello_c)
    reply = _recv_exact(sock, HELLO.size + MAC_SIZE)
    if reply.startswith(_tls.TLS_REQUIRED):
        raise _tls.TlsRefused(
            f"rank {peer} requires TLS and this rank has none configured (the ranks' TDIST_TLS_* "
            "variables or tls_* options differ)"
        )
    hello = parse_hello(reply[: HELLO.size], nonce, size)
    if len(reply) != HELLO.size + MAC_SIZE or hello is None or hello.rank != peer:
        return False
    hello_a = reply[: HELLO.size]
    sock.sendall(mac(key, b"C", hello_c, hello_a))  # sent even if the peer's proof fails: it then knows why
    if not hmac.compare_digest(reply[HELLO.size :], mac(key, b"A", hello_c, hello_a)):
        raise _AuthFailed(
            f"rank {peer} did not prove it knows this group's key ({token_mismatch_hint(has_token, hello.flags)})"
        )
    verdict = _recv_exact(sock, 1)
    if verdict == REFUSED:
        raise _AuthFailed(f"rank {peer} refused this rank's proof ({token_mismatch_hint(has_token, hello.flags)})")
    if verdict != ACCEPTED:
        return False
    sock.settimeout(None)
    return True


def _connect_unix(
    store: Any, peer: int, rank: int, size: int, auth: "_Auth", deadline: float, buffer_bytes: int
) -> Optional[socket.socket]:
    """A Unix-domain connection to ``peer`` if it published one and runs on this host
    (its abstract socket name exists only in its kernel's network namespace)."""
    try:
        if not store.check([UNIX_KEY.format(peer)]):
            return None
        name = "\0" + store.get(UNIX_KEY.format(peer), timeout=1.0).decode()
        sock = socket.socket(_AF_UNIX, socket.SOCK_STREAM)
    except Exception:
        return None
    try:
        configure_socket(sock, buffer_bytes)
        sock.settimeout(max(0.05, min(2.0, deadline - time.monotonic())))
        sock.connect(name)
        if _handshake(sock, auth.nonce, auth.key, auth.has_token, rank, size, peer, deadline):
            return sock
    except OSError:
        pass
    except BaseException:
        sock.close()
        raise
    sock.close()
    return None


class _Auth(NamedTuple):
    nonce: bytes
    key: bytes
    has_token: bool


def _group_auth(store: Any, secret: bytes, timeout: float) -> _Auth:
    nonce = bytes.fromhex(store.get(NONCE_KEY, timeout=timeout).decode())
    return _Auth(nonce, group_key(secret, nonce), bool(secret))


def _connect_one(
    store: Any,
    peer: int,
    rank: int,
    size: int,
    secret: bytes,
    deadline: float,
    buffer_bytes: int,
    use_unix: bool,
    tls: Optional[_tls.MeshTls] = None,
    streams: int = 1,
    auth: Optional[_Auth] = None,
) -> list[socket.socket]:
    """Connect to lower rank ``peer`` and handshake, retrying (re-reading its address)
    until ``deadline``. Every attempt uses ``auth``, the group nonce this rank read once
    and uses throughout (its acceptor and the :class:`Mesh` it returns too; read from the
    store when not given). Same-host peers are reached through one Unix-domain socket
    when possible (several times TCP loopback's bandwidth), others through ``streams``
    TCP connections. A failed authentication raises at once."""
    last: Optional[str] = None
    addr = "?"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            _raise_if_exhausted(store, auth, rank, peer, addr)
            raise DistNetworkError(
                f"tcp backend: rank {rank} could not connect to rank {peer} at {addr} within the timeout: {last} "
                f"(if that address is wrong, set options['host'], ${HOST_ENV} or ${IFNAME_ENV} on rank {peer})"
            )
        opened: list[socket.socket] = []
        try:
            if auth is None:
                auth = _group_auth(store, secret, remaining)
            raw = store.get(ADDR_KEY.format(peer), timeout=max(0.01, deadline - time.monotonic()))
            host, port = _parse_addr(raw)
            addr = _format_addr(host, port)
            if use_unix:
                unix = _connect_unix(store, peer, rank, size, auth, deadline, buffer_bytes)
                if unix is not None:
                    return [unix]
            family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            for stream in range(streams):
                sock = socket.socket(family, socktype, proto)
                opened.append(sock)
                configure_socket(sock, buffer_bytes)
                sock.settimeout(max(0.05, min(HANDSHAKE_LIMIT, deadline - time.monotonic())))
                sock.connect(sockaddr)
                if tls is not None:
                    sock = opened[-1] = tls.connect(
                        sock, host, max(0.05, min(HANDSHAKE_LIMIT, deadline - time.monotonic()))
                    )
                if not _handshake(
                    sock, auth.nonce, auth.key, auth.has_token, rank, size, peer, deadline, stream, streams
                ):
                    break
            else:
                return [_tls.TlsStream(s) if tls is not None else s for s in opened]  # type: ignore
            last = "handshake refused (wrong group nonce, protocol version or world size)"
        except DistStoreTimeoutError:
            raise
        except _tls.TlsRefused as exc:
            _close_all(opened)
            raise DistNetworkError(
                f"tcp backend: rank {rank} cannot connect to rank {peer} at {addr} over TLS: {exc}"
            ) from None
        except _AuthFailed as exc:
            _close_all(opened)
            raise DistNetworkError(
                f"tcp backend: rank {rank} cannot authenticate its connection to rank {peer} at {addr}: {exc}; "
                f"give every rank the same token (store token= or ${TOKEN_ENV})"
            ) from None
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            if descriptor_shortage(exc) is not None:  # retrying would not give one back
                _close_all(opened)
                raise DistNetworkError(
                    f"tcp backend: rank {rank} cannot open a connection to rank {peer} at {addr}: "
                    f"{descriptor_shortage(exc)}"
                ) from None
            why = _tls.fatal(exc) if tls is not None else None
            if why is not None:  # e.g. the peer refused this rank's certificate (TLS 1.3 says so after the handshake)
                _close_all(opened)
                raise DistNetworkError(
                    f"tcp backend: rank {rank} cannot connect to rank {peer} at {addr} over TLS: {why}"
                ) from None
            if isinstance(exc, socket.timeout):  # connected but never answered: is it out of descriptors?
                _close_all(opened)
                _raise_if_exhausted(store, auth, rank, peer, addr)
        _close_all(opened)
        time.sleep(0.05)


def _raise_if_exhausted(store: Any, auth: Optional[_Auth], rank: int, peer: int, addr: str) -> None:
    """Raise, naming it, if ``peer`` said that it ran out of file descriptors accepting connections."""
    if auth is None:
        return
    key = EXHAUSTED_KEY.format(auth.nonce.hex(), peer)
    try:
        why = store.get(key, timeout=0.01).decode("utf-8", "replace") if store.check([key]) else ""
    except Exception:  # noqa: BLE001 - the store is what it is: the caller's error stands
        return
    if why:
        raise DistNetworkError(
            f"tcp backend: rank {rank} cannot connect to rank {peer} at {addr}: rank {peer} cannot accept "
            f"connections: {why}"
        )


def _close_all(socks: Sequence[Any]) -> None:
    for sock in socks:
        sock.close()


def stream_count(options: Mapping[str, Any]) -> int:
    """The TCP connections this rank opens to each lower rank on another host
    (``streams`` option, else ``$TDIST_TCP_STREAMS``, else 1); a ValueError names a bad one."""
    raw = options.get("streams", os.environ.get(STREAMS_ENV, 1))
    try:
        streams = int(raw)
    except (TypeError, ValueError):
        streams = 0
    if not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"tcp backend: streams must be a whole number from 1 to {MAX_STREAMS}, got {raw!r}")
    return streams


def _missing_ranks(store: Any, ranks: list[int]) -> tuple[list[int], list[int]]:
    """Split ``ranks`` into those that never published an address and those that did."""
    absent: list[int] = []
    present: list[int] = []
    for peer in ranks:
        try:
            ok = store.check([ADDR_KEY.format(peer)])
        except Exception:
            ok = False
        (present if ok else absent).append(peer)
    return absent, present


def _timeout_error(
    rank: int, timeout: float, store: Any, missing: list[int], refusals: Sequence[str] = ()
) -> DistBackendTimeoutError:
    absent, present = _missing_ranks(store, missing)
    parts = []
    if absent:
        parts.append(f"ranks {absent} never arrived (no address published)")
    if present:
        parts.append(f"ranks {present} published an address but did not connect")
    if refusals:
        parts.append("refused: " + "; ".join(refusals))
    return DistBackendTimeoutError(
        f"tcp backend: rank {rank} timed out after {timeout:g} s setting up connections: " + "; ".join(parts)
    )


class Mesh(NamedTuple):
    """A group's connections: each peer's authenticated sockets (its streams, stream 0
    first), the group nonce and key."""

    sockets: dict[int, list[socket.socket]]
    nonce: bytes
    key: bytes


def connect_mesh(
    store: Any, rank: int, size: int, timeout: float, options: Mapping[str, Any], secret: bytes = b""
) -> Mesh:
    """Open one authenticated connection to every other rank of the group, within
    ``timeout`` seconds; ``secret`` is the factory's (empty: no authentication)."""
    deadline = time.monotonic() + timeout
    buffer_bytes = int(options.get("socket_buffer", DEFAULT_SOCKET_BUFFER))
    streams = stream_count(options)
    tls = _tls.mesh_tls(options, f"tcp backend rank {rank}")
    host = choose_host(store, options)
    port = int(options.get("port", 0))
    try:
        family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socktype, proto)
    except OSError as exc:
        why = descriptor_shortage(exc) or exc
        raise DistNetworkError(f"tcp backend: rank {rank} cannot listen on {host!r}: {why}") from None
    use_unix = _unix_enabled(options)
    unix_listener: Optional[socket.socket] = None
    acceptor: Optional[_Acceptor] = None
    connected: dict[int, list[socket.socket]] = {}
    try:
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            configure_socket(listener, buffer_bytes)
            listener.bind(sockaddr)
            listener.listen(max(128, size))
        except OSError as exc:
            raise DistNetworkError(
                f"tcp backend: rank {rank} cannot listen on {host}:{port} ({exc}); "
                f"set options['host'] or ${HOST_ENV} to this machine's address"
            ) from None
        bound_port = listener.getsockname()[1]
        if rank == 0:
            nonce = os.urandom(16)
            store.set(NONCE_KEY, nonce.hex())
        else:
            try:
                nonce = bytes.fromhex(store.get(NONCE_KEY, timeout=max(0.01, deadline - time.monotonic())).decode())
            except DistStoreTimeoutError:
                raise _timeout_error(rank, timeout, store, [0]) from None
        listeners = [listener]
        if use_unix and rank < size - 1:
            unix_listener, unix_name = _unix_listener(buffer_bytes, size)
            if unix_listener is not None:
                listeners.append(unix_listener)
                store.set(UNIX_KEY.format(rank), unix_name)
        auth = _Auth(nonce, group_key(secret, nonce), bool(secret))
        if rank < size - 1:
            acceptor = _Acceptor(listeners, rank, size, nonce, auth.key, auth.has_token, deadline, tls)
            acceptor.on_exhausted = lambda why: store.set(EXHAUSTED_KEY.format(nonce.hex(), rank), why)
            acceptor.start()
        store.set(ADDR_KEY.format(rank), _format_addr(host, bound_port))
        for peer in range(rank):
            try:
                connected[peer] = _connect_one(
                    store, peer, rank, size, secret, deadline, buffer_bytes, use_unix, tls, streams, auth
                )
            except DistStoreTimeoutError:
                raise _timeout_error(rank, timeout, store, [p for p in range(rank) if p not in connected]) from None
        if acceptor is not None:
            acceptor.join(max(0.0, deadline - time.monotonic()) + 0.5)
            connected.update(acceptor.complete())
            if acceptor.error is not None:
                error = descriptor_shortage(acceptor.error) or acceptor.error
                raise DistNetworkError(f"tcp backend: rank {rank} failed accepting connections: {error}")
            missing = [p for p in range(rank + 1, size) if p not in connected]
            if missing:
                exhausted = [acceptor.exhausted] if acceptor.exhausted else []
                raise _timeout_error(rank, timeout, store, missing, [*acceptor.refusals, *exhausted])
        return Mesh(connected, nonce, auth.key)
    except BaseException:
        if acceptor is not None:
            acceptor.stop.set()
            acceptor.join(2.0)
            for conns in acceptor.accepted.values():
                _close_all(list(conns.values()))
        for socks in connected.values():
            _close_all(socks)
        raise
    finally:
        listener.close()
        if unix_listener is not None:
            unix_listener.close()


def _unix_enabled(options: Mapping[str, Any]) -> bool:
    if not sys.platform.startswith("linux") or _AF_UNIX < 0:  # abstract socket names are Linux-only
        return False
    return flag(UNIX_ENV, True, options.get("unix"))


def _unix_listener(buffer_bytes: int, size: int) -> tuple[Optional[socket.socket], str]:
    """A listening Unix-domain socket with a random abstract name, and that name
    (without its leading NUL); (None, "") if unavailable."""
    name = "tdist-tcp-" + os.urandom(12).hex()
    try:
        sock = socket.socket(_AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None, ""
    try:
        configure_socket(sock, buffer_bytes)
        sock.bind("\0" + name)
        sock.listen(max(128, size))
        return sock, name
    except OSError:
        sock.close()
        return None, ""
