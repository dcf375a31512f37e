"""The connecting side of a link: open a connection to a peer and run the handshake.

A rank connects to a peer when it first needs it (:meth:`tdist_tcp.net.transport.Transport.connect`,
in the calling thread): a Unix-domain socket when the peer published one and runs on this
host, else ``streams`` TCP connections (optionally TLS, this rank the client). Each is
mutually authenticated (:mod:`tdist_tcp.protocol.auth`) before it carries a frame. The peer's
answer DUPLICATE means it keeps the connection it is opening to this rank at the same
time (the lower rank's wins). Retries until the deadline; a failed proof, a TLS refusal
or a shortage of file descriptors raises at once with the reason.
"""

from __future__ import annotations

import hmac
import socket
import struct
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence

from tdist.plugin import DistNetworkError, DistStoreTimeoutError, descriptor_shortage

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

__all__ = ["Address", "open_link", "configure_socket", "format_addr", "parse_addr", "HOST_ENV", "IFNAME_ENV"]

HOST_ENV = "TDIST_TCP_HOST"
IFNAME_ENV = "TDIST_TCP_IFNAME"
TOKEN_ENV = "TDIST_STORE_TOKEN"  # named in errors: the core derives the factory's secret from it
#: a rank whose listener ran out of file descriptors says so here (group nonce, rank), for its connectors
EXHAUSTED_KEY = "tcp/exhausted/{}/{}"
DEFAULT_SOCKET_BUFFER = 4 << 20
#: seconds a connection may take for its whole handshake
HANDSHAKE_LIMIT = 10.0
_AF_UNIX = getattr(socket, "AF_UNIX", -1)


def _interface_address(ifname: str) -> str:
    import fcntl  # Linux / BSD only

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", ifname.encode()[:15]))  # SIOCGIFADDR
        except OSError as exc:
            raise DistNetworkError(f"tcp backend: network interface {ifname!r} has no IPv4 address: {exc}") from None
    return socket.inet_ntoa(packed[20:24])


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_addr(value: bytes) -> tuple[str, int]:
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
) -> Optional[bool]:
    """Run the connector's side of the handshake with ``peer`` (for connection ``stream``
    of ``streams``): True once it accepted us, False if the other end is not ``peer`` of
    this group (retry later), None if ``peer`` keeps the connection it is opening to this
    rank instead (DUPLICATE); raises :class:`_AuthFailed` if either side's proof fails."""
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
    if verdict == DUPLICATE:
        return None
    if verdict != ACCEPTED:
        return False
    sock.settimeout(None)
    return True


class _Auth(NamedTuple):
    nonce: bytes
    key: bytes
    has_token: bool


def _connect_unix(name: str, peer: int, rank: int, size: int, auth: "_Auth", deadline: float, buffer_bytes: int) -> Any:
    """A Unix-domain connection to ``peer`` at abstract ``name`` (which exists only in its
    kernel's network namespace, so only on its host): the socket, None if it cannot be
    reached that way, or False if ``peer`` keeps its own connection (DUPLICATE)."""
    try:
        sock = socket.socket(_AF_UNIX, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        configure_socket(sock, buffer_bytes)
        sock.settimeout(max(0.05, min(2.0, deadline - time.monotonic())))
        sock.connect("\0" + name)
        verdict = _handshake(sock, auth.nonce, auth.key, auth.has_token, rank, size, peer, deadline)
        if verdict:
            return sock
        if verdict is None:
            sock.close()
            return False
    except OSError:
        pass
    except BaseException:
        sock.close()
        raise
    sock.close()
    return None


class Address(NamedTuple):
    """Where a rank listens: TCP ``host``:``port``, and its Unix-domain name ("" if none)."""

    host: str
    port: int
    unix: str


def open_link(
    lookup: Callable[[], Address],
    peer: int,
    rank: int,
    size: int,
    auth: _Auth,
    deadline: float,
    buffer_bytes: int,
    use_unix: bool,
    tls: Optional[_tls.MeshTls] = None,
    streams: int = 1,
    exhausted: Callable[[str], None] = lambda addr: None,
    refused_is_final: bool = False,
) -> Optional[list[Any]]:
    """Connect to ``peer`` (at ``lookup()``, asked again before each retry) and handshake,
    retrying until ``deadline``: its authenticated sockets (stream 0 first), or None if
    ``peer`` keeps the connection it is opening to this rank (the lower rank's wins).
    Same-host peers are reached through one Unix-domain socket when possible (several
    times TCP loopback's bandwidth), others through ``streams`` TCP connections. A failed
    authentication raises at once; ``exhausted(addr)`` raises if the peer said it ran out
    of file descriptors. With ``refused_is_final`` (the peer is known to have listened), a
    refused TCP connection raises ConnectionRefusedError at once: the peer is gone."""
    last: Optional[str] = None
    addr = "?"
    while True:
        if deadline - time.monotonic() <= 0:
            exhausted(addr)
            raise DistNetworkError(
                f"tcp backend: rank {rank} could not connect to rank {peer} at {addr} within the timeout: {last} "
                f"(if that address is wrong, set options['host'], ${HOST_ENV} or ${IFNAME_ENV} on rank {peer})"
            )
        opened: list[Any] = []
        try:
            where = lookup()
            host, port = where.host, where.port
            addr = format_addr(host, port)
            if use_unix and where.unix:
                unix = _connect_unix(where.unix, peer, rank, size, auth, deadline, buffer_bytes)
                if unix is False:
                    return None
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
                verdict = _handshake(
                    sock, auth.nonce, auth.key, auth.has_token, rank, size, peer, deadline, stream, streams
                )
                if verdict is None and stream == 0:
                    _close_all(opened)
                    return None
                if not verdict:
                    break
            else:
                return [_tls.TlsStream(s) if tls is not None else s for s in opened]
            last = "handshake refused (wrong group nonce, protocol version or world size)"
        except DistStoreTimeoutError:
            _close_all(opened)
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
        except ConnectionRefusedError:
            _close_all(opened)
            if refused_is_final:
                raise
            last = "connection refused"
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
                exhausted(addr)
        _close_all(opened)
        time.sleep(0.05)


def raise_if_exhausted(store: Any, auth: Optional[_Auth], rank: int, peer: int, addr: str) -> None:
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
