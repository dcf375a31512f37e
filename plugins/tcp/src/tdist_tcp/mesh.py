"""Connection setup: every rank listens, publishes ``tcp/addr/<rank>`` in the group's
store, then rank i connects to every rank j < i and accepts every rank j > i.

Each connection starts with a :data:`~tdist_tcp.wire.HELLO` from the connector
(magic, protocol version, the group nonce rank 0 published as ``tcp/nonce``, the
connector's rank, the world size) answered by the acceptor's own HELLO. A
connection whose HELLO does not match is closed and the acceptor keeps listening.
Everything honours one deadline; on timeout the error names the missing ranks.
"""

from __future__ import annotations

import os
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any, Mapping, Optional

from tdist._errors import DistBackendTimeoutError, DistNetworkError, DistStoreTimeoutError

from .wire import HELLO, HELLO_MAGIC, PROTOCOL_VERSION

__all__ = ["choose_host", "configure_socket", "connect_mesh", "HOST_ENV", "IFNAME_ENV"]

HOST_ENV = "TDIST_TCP_HOST"
IFNAME_ENV = "TDIST_TCP_IFNAME"
UNIX_ENV = "TDIST_TCP_UNIX"
ADDR_KEY = "tcp/addr/{}"
UNIX_KEY = "tcp/unix/{}"
_AF_UNIX = getattr(socket, "AF_UNIX", -1)
NONCE_KEY = "tcp/nonce"
DEFAULT_SOCKET_BUFFER = 4 << 20


# ------------------------------------------------------------------ addresses
def _store_endpoint(store: Any) -> tuple[Optional[str], Optional[int]]:
    """The (host, port) of the store's server, looking through wrapping stores."""
    seen: set[int] = set()
    current = store
    for _ in range(8):
        if current is None or id(current) in seen:
            break
        seen.add(id(current))
        host = getattr(current, "host", None)
        if isinstance(host, str) and host:
            port = getattr(current, "port", None)
            return host, port if isinstance(port, int) else None
        nxt = None
        for attr in ("underlying_store", "_store"):  # PrefixStore and similar wrappers
            candidate = getattr(current, attr, None)
            if candidate is not None and hasattr(candidate, "get") and hasattr(candidate, "set"):
                nxt = candidate
                break
        current = nxt
    return None, None


def _interface_address(ifname: str) -> str:
    import fcntl  # Linux / BSD only

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            raise DistNetworkError(f"tcp backend: network interface {ifname!r} has no IPv4 address: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def _route_address(host: str, port: Optional[int]) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port or 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


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
    store_host, store_port = _store_endpoint(store)
    if store_host:
        try:
            return _route_address(store_host, store_port)
        except OSError:
            pass
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


def _hello(nonce: bytes, rank: int, size: int) -> bytes:
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, nonce, rank, size)


def _check_hello(data: bytes, nonce: bytes, size: int) -> Optional[int]:
    """The sender's rank if ``data`` is a valid HELLO of this group, else None."""
    if len(data) != HELLO.size:
        return None
    magic, version, their_nonce, rank, their_size = HELLO.unpack(data)
    if magic != HELLO_MAGIC or version != PROTOCOL_VERSION or their_nonce != nonce or their_size != size:
        return None
    return rank


class _Acceptor(threading.Thread):
    """Accepts the higher ranks' connections until all arrived, the deadline passes or it is stopped.

    Handshakes are read without blocking (a silent or garbage connection is
    dropped without delaying the others).
    """

    def __init__(self, listeners: list[socket.socket], rank: int, size: int, nonce: bytes, deadline: float,
                 buffer_bytes: int) -> None:
        super().__init__(name=f"tdist-tcp-accept-r{rank}", daemon=True)
        self.listeners = listeners
        self.rank = rank
        self.size = size
        self.nonce = nonce
        self.deadline = deadline
        self.buffer_bytes = buffer_bytes
        self.accepted: dict[int, socket.socket] = {}
        self.refused = 0
        self.error: Optional[BaseException] = None
        self.stop = threading.Event()

    def run(self) -> None:
        wanted = set(range(self.rank + 1, self.size))
        pending: dict[socket.socket, tuple[bytearray, float]] = {}
        sel = selectors.DefaultSelector()
        try:
            for listener in self.listeners:
                listener.setblocking(False)
                sel.register(listener, selectors.EVENT_READ)
            while wanted - set(self.accepted) and not self.stop.is_set() and time.monotonic() < self.deadline:
                for key, _ in sel.select(timeout=0.05):
                    sock = key.fileobj
                    if sock in self.listeners:
                        try:
                            conn, _addr = sock.accept()
                        except (BlockingIOError, InterruptedError):
                            continue
                        conn.setblocking(False)
                        pending[conn] = (bytearray(), time.monotonic() + 10.0)
                        sel.register(conn, selectors.EVENT_READ)
                        continue
                    buf, _limit = pending[sock]
                    try:
                        chunk = sock.recv(HELLO.size - len(buf))
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        chunk = b""
                    if chunk:
                        buf += chunk
                        if len(buf) < HELLO.size:
                            continue
                    sel.unregister(sock)
                    del pending[sock]
                    peer = _check_hello(bytes(buf), self.nonce, self.size) if chunk else None
                    if peer is None or peer not in wanted or peer in self.accepted:
                        self.refused += 1
                        sock.close()
                        continue
                    try:
                        sock.setblocking(True)
                        configure_socket(sock, 0)
                        sock.sendall(_hello(self.nonce, self.rank, self.size))
                    except OSError:
                        sock.close()
                        continue
                    self.accepted[peer] = sock
                now = time.monotonic()
                for sock in [s for s, (_, limit) in pending.items() if limit < now]:  # silent connections
                    sel.unregister(sock)
                    del pending[sock]
                    sock.close()
        except BaseException as exc:  # reported by connect_mesh
            self.error = exc
        finally:
            for sock in pending:
                sock.close()
            sel.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _handshake(sock: socket.socket, nonce: bytes, rank: int, size: int, peer: int, deadline: float) -> bool:
    """Send our HELLO on a connected socket; True if ``peer`` answered with its own."""
    sock.sendall(_hello(nonce, rank, size))
    sock.settimeout(max(0.05, deadline - time.monotonic()))
    reply = _recv_exact(sock, HELLO.size)
    if _check_hello(reply, nonce, size) == peer:
        sock.settimeout(None)
        return True
    return False


def _connect_unix(store: Any, peer: int, rank: int, size: int, nonce: bytes, deadline: float,
                  buffer_bytes: int) -> Optional[socket.socket]:
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
        if _handshake(sock, nonce, rank, size, peer, deadline):
            return sock
    except OSError:
        pass
    sock.close()
    return None


def _connect_one(store: Any, peer: int, rank: int, size: int, deadline: float, buffer_bytes: int,
                 use_unix: bool) -> socket.socket:
    """Connect to lower rank ``peer`` and handshake, retrying (re-reading the store, so a
    stale address or nonce is replaced by the fresh one) until ``deadline``. Same-host
    peers are reached through a Unix-domain socket when possible (several times TCP
    loopback's bandwidth), others through TCP."""
    last: Optional[str] = None
    addr = "?"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistNetworkError(
                f"tcp backend: rank {rank} could not connect to rank {peer} at {addr} within the timeout: {last} "
                f"(if that address is wrong, set options['host'], ${HOST_ENV} or ${IFNAME_ENV} on rank {peer})"
            )
        try:
            nonce = bytes.fromhex(store.get(NONCE_KEY, timeout=remaining).decode())
            raw = store.get(ADDR_KEY.format(peer), timeout=max(0.01, deadline - time.monotonic()))
            if use_unix:
                unix = _connect_unix(store, peer, rank, size, nonce, deadline, buffer_bytes)
                if unix is not None:
                    return unix
            host, port = _parse_addr(raw)
            addr = _format_addr(host, port)
            family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            sock = socket.socket(family, socktype, proto)
        except DistStoreTimeoutError:
            raise
        except (OSError, ValueError) as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
            continue
        try:
            configure_socket(sock, buffer_bytes)
            sock.settimeout(max(0.05, min(10.0, deadline - time.monotonic())))
            sock.connect(sockaddr)
            if _handshake(sock, nonce, rank, size, peer, deadline):
                return sock
            last = "handshake refused (wrong group nonce, protocol version or world size)"
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
        sock.close()
        time.sleep(0.05)


def _missing_ranks(store: Any, ranks: list[int]) -> tuple[list[int], list[int]]:
    """Split ``ranks`` into those that never published an address and those that did."""
    absent, present = [], []
    for peer in ranks:
        try:
            ok = store.check([ADDR_KEY.format(peer)])
        except Exception:
            ok = False
        (present if ok else absent).append(peer)
    return absent, present


def _timeout_error(rank: int, timeout: float, store: Any, missing: list[int]) -> DistBackendTimeoutError:
    absent, present = _missing_ranks(store, missing)
    parts = []
    if absent:
        parts.append(f"ranks {absent} never arrived (no address published)")
    if present:
        parts.append(f"ranks {present} published an address but did not connect")
    return DistBackendTimeoutError(
        f"tcp backend: rank {rank} timed out after {timeout:g} s setting up connections: " + "; ".join(parts)
    )


def connect_mesh(
    store: Any, rank: int, size: int, timeout: float, options: Mapping[str, Any]
) -> dict[int, socket.socket]:
    """Open one connected socket to every other rank of the group, within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    buffer_bytes = int(options.get("socket_buffer", DEFAULT_SOCKET_BUFFER))
    host = choose_host(store, options)
    port = int(options.get("port", 0))
    try:
        family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socktype, proto)
    except OSError as exc:
        raise DistNetworkError(f"tcp backend: rank {rank} cannot listen on {host!r}: {exc}") from None
    use_unix = _unix_enabled(options)
    unix_listener: Optional[socket.socket] = None
    acceptor: Optional[_Acceptor] = None
    connected: dict[int, socket.socket] = {}
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
        if rank < size - 1:
            acceptor = _Acceptor(listeners, rank, size, nonce, deadline, buffer_bytes)
            acceptor.start()
        store.set(ADDR_KEY.format(rank), _format_addr(host, bound_port))
        for peer in range(rank):
            try:
                connected[peer] = _connect_one(store, peer, rank, size, deadline, buffer_bytes, use_unix)
            except DistStoreTimeoutError:
                raise _timeout_error(rank, timeout, store, [p for p in range(rank) if p not in connected]) from None
        if acceptor is not None:
            acceptor.join(max(0.0, deadline - time.monotonic()) + 0.5)
            connected.update(acceptor.accepted)
            if acceptor.error is not None:
                raise DistNetworkError(f"tcp backend: rank {rank} failed accepting connections: {acceptor.error}")
            missing = [p for p in range(rank + 1, size) if p not in connected]
            if missing:
                raise _timeout_error(rank, timeout, store, missing)
        return connected
    except BaseException:
        if acceptor is not None:
            acceptor.stop.set()
            acceptor.join(2.0)
            for sock in acceptor.accepted.values():
                sock.close()
        for sock in connected.values():
            sock.close()
        raise
    finally:
        listener.close()
        if unix_listener is not None:
            unix_listener.close()


def _unix_enabled(options: Mapping[str, Any]) -> bool:
    if not sys.platform.startswith("linux") or _AF_UNIX < 0:  # abstract socket names are Linux-only
        return False
    flag = options.get("unix", os.environ.get(UNIX_ENV, "1"))
    return str(flag).lower() not in ("0", "false", "no", "off", "")


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
