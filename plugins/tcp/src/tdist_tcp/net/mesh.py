"""A group's connections: its listeners, its peers' addresses, and connections made when first needed.

Every rank listens (TCP, and a Unix-domain socket with an abstract name on Linux,
:func:`open_listeners`) and says where in its record of the group's setup
(:mod:`tdist_tcp.net.roster`). Its listeners are served by the I/O loop
(:mod:`tdist_tcp.net.acceptor`) for the group's lifetime. Connections are made when first
needed (:meth:`Mesh.connect`, called by the transport), and a peer's address is read
from its record then, unless known already (:meth:`Mesh.address`): a rank reads only
the addresses of the peers it connects to. The ``connect`` option says which are made
at setup already (:meth:`Mesh.connect_at_setup`): ``ring`` (the default: each rank's
two ring neighbours, which the large collectives use first, and which checks at setup
that the ranks agree on the token and TLS), ``lazy`` (none) or ``all`` (every pair, the
old full mesh). At setup the higher rank of a pair connects and the lower one waits for it.

Every connection (TCP or Unix-domain) is mutually authenticated before it carries a
frame (see :mod:`tdist_tcp.protocol.auth`, :mod:`tdist_tcp.net.connect`). Everything at setup honours
one deadline; on timeout the error names the missing ranks (and why connections claiming
to be them were refused).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from tdist.plugin import (
    DistBackendTimeoutError,
    DistNetworkError,
    descriptor_shortage,
    flag,
    route_address,
    store_endpoint,
)

from ..protocol import tls as _tls
from .acceptor import MAX_PENDING, Acceptor
from ..protocol.auth import MAX_STREAMS, group_key
from .connect import (
    DEFAULT_SOCKET_BUFFER,
    EXHAUSTED_KEY,
    HOST_ENV,
    IFNAME_ENV,
    Address,
    _Auth,
    _interface_address,
    configure_socket,
    open_link,
    raise_if_exhausted,
)
from .roster import RECORD_KEY, Record, first_record, lookup

if TYPE_CHECKING:
    from .transport import Transport

__all__ = [
    "choose_host",
    "configure_socket",
    "open_listeners",
    "connect_mode",
    "stream_count",
    "Mesh",
    "HOST_ENV",
    "IFNAME_ENV",
    "STREAMS_ENV",
    "CONNECT_ENV",
    "MAX_PENDING",
]

UNIX_ENV = "TDIST_TCP_UNIX"
STREAMS_ENV = "TDIST_TCP_STREAMS"
CONNECT_ENV = "TDIST_TCP_CONNECT"
CONNECT_MODES = ("ring", "lazy", "all")
_AF_UNIX = getattr(socket, "AF_UNIX", -1)


# ------------------------------------------------------------------ addresses
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


def connect_mode(options: Mapping[str, Any]) -> str:
    """Which connections setup makes (``connect`` option, else ``$TDIST_TCP_CONNECT``, else
    ``ring``): ``ring``, ``lazy`` or ``all``; a ValueError names a bad one."""
    raw = options.get("connect") or os.environ.get(CONNECT_ENV) or "ring"
    mode = str(raw).strip().lower()
    if mode not in CONNECT_MODES:
        raise ValueError(f"tcp backend: option connect must be one of {', '.join(CONNECT_MODES)}, got {raw!r}")
    return mode


def _setup_peers(mode: str, rank: int, size: int) -> list[int]:
    """The peers this rank connects to (or waits for) at setup."""
    if mode == "all":
        return [q for q in range(size) if q != rank]
    if mode == "ring":
        return sorted({(rank - 1) % size, (rank + 1) % size} - {rank})
    return []


def _missing_ranks(store: Any, ranks: list[int]) -> tuple[list[int], list[int]]:
    """Split ``ranks`` into those that never published an address and those that did."""
    absent: list[int] = []
    present: list[int] = []
    for peer in ranks:
        try:
            ok = store.check([RECORD_KEY.format(peer)])
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


class Mesh:
    """A group's listeners, its ranks' addresses and its authentication: makes the group's
    connections (:meth:`connect`) and accepts the peers' (handed to the transport it
    serves, :meth:`serve`; before that, kept in :attr:`sockets`)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        auth: _Auth,
        listeners: list[socket.socket],
        options: Mapping[str, Any],
        tls: Optional[_tls.MeshTls],
    ) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.auth = auth
        self.nonce = auth.nonce
        self.key = auth.key
        self.tls = tls
        self.buffer_bytes = int(options.get("socket_buffer", DEFAULT_SOCKET_BUFFER))
        self.streams = stream_count(options)
        self.use_unix = _unix_enabled(options)
        #: the peers' addresses known so far (the others are read from their records when needed)
        self.addresses: dict[int, Address] = {}
        #: finds an unknown peer's address by (peer, deadline); default: its record in ``store``
        self.directory: Callable[[int, float], Address] = self._read_record
        #: connections made or accepted before a transport took them, by peer (stream 0 first)
        self.sockets: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._transport: Optional["Transport"] = None
        self.acceptor = Acceptor(
            listeners, rank, size, auth.nonce, auth.key, auth.has_token, self._admit, self._complete, self._failed, tls
        )
        self.acceptor.on_exhausted = lambda why: store.set(EXHAUSTED_KEY.format(auth.nonce.hex(), rank), why)

    # ------------------------------------------------------------ addresses
    def learn(self, records: Mapping[int, Record]) -> None:
        """Remember these ranks' addresses (from their records)."""
        with self._lock:
            for peer, record in records.items():
                if peer != self.rank:
                    self.addresses[peer] = record.address

    def address(self, peer: int, deadline: float) -> Address:
        """``peer``'s address: known, or read from its record in the store (waited for until
        ``deadline``; a DistBackendTimeoutError names ``peer`` if it never appears)."""
        with self._lock:
            known = self.addresses.get(peer)
        if known is not None:
            return known
        found = self.directory(peer, deadline)
        with self._lock:
            self.addresses[peer] = found
        return found

    def _read_record(self, peer: int, deadline: float) -> Address:
        return lookup(self.store, [peer], deadline, self.rank)[peer].address

    # ------------------------------------------------------------ connecting
    def connect(self, peer: int, deadline: float) -> Optional[list[Any]]:
        """Open ``peer``'s connections (its streams, stream 0 first) within ``deadline``;
        None if ``peer`` keeps the connection it is opening to this rank (the lower rank's wins)."""
        where = self.address(peer, deadline)

        def exhausted(addr: str) -> None:
            raise_if_exhausted(self.store, self.auth, self.rank, peer, addr)

        return open_link(
            lambda: where,
            peer,
            self.rank,
            self.size,
            self.auth,
            deadline,
            self.buffer_bytes,
            self.use_unix,
            self.tls,
            self.streams,
            exhausted,
            refused_is_final=True,  # it listened before it published its address: refusing, it is gone
        )

    # ------------------------------------------------------------- accepting
    def serve(self, transport: "Transport") -> None:
        """Hand every connection made so far to ``transport``, and the later ones as they come."""
        with self._lock:
            self._transport = transport
            made, self.sockets = self.sockets, {}
            for peer, socks in made.items():
                transport.attach(peer, socks)

    def _admit(self, peer: int) -> bool:
        with self._lock:
            if self._transport is not None:
                return self._transport.admit(peer)
            return peer not in self.sockets

    def _complete(self, peer: int, socks: list[Any]) -> None:
        with self._lock:
            if self._transport is not None:
                self._transport.attach(peer, socks)
            elif peer in self.sockets:
                for sock in socks:
                    sock.close()
            else:
                self.sockets[peer] = socks
            self._changed.notify_all()

    def _failed(self, peer: int) -> None:
        with self._lock:
            if self._transport is not None:
                self._transport.incoming_failed(peer)

    def connect_at_setup(self, mode: str, deadline: float, timeout: float) -> None:
        """Make the connections the ``connect`` option asks for at setup (``mode``, see
        :func:`connect_mode`), within ``deadline``: connect to the lower peers, wait for the
        higher ones; a timeout names the ranks that did not connect."""
        setup = _setup_peers(mode, self.rank, self.size)
        lower = [q for q in setup if q < self.rank]
        unknown = [q for q in lower if q not in self.addresses]
        if unknown:
            try:
                self.learn(lookup(self.store, unknown, deadline, self.rank))
            except DistBackendTimeoutError:
                raise _timeout_error(self.rank, timeout, self.store, unknown) from None
        for peer in lower:
            socks = self.connect(peer, deadline)
            if socks is not None:
                self._complete(peer, socks)
        missing = self.wait_for(setup, deadline)
        if missing:
            exhausted = [self.acceptor.exhausted] if self.acceptor.exhausted else []
            raise _timeout_error(self.rank, timeout, self.store, missing, [*self.acceptor.refusals, *exhausted])

    def wait_for(self, peers: Sequence[int], deadline: float) -> list[int]:
        """Wait until every one of ``peers`` connected (before a transport serves); the missing."""
        with self._lock:
            while True:
                missing = [q for q in peers if q not in self.sockets]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    return missing
                self._changed.wait(min(left, 0.1))

    def close(self) -> None:
        """Close the listeners, the handshakes and the connections no transport took."""
        self.acceptor.close()
        with self._lock:
            made, self.sockets = self.sockets, {}
        for socks in made.values():
            for sock in socks:
                sock.close()


def _listen(rank: int, size: int, host: str, port: int, buffer_bytes: int) -> socket.socket:
    try:
        family, socktype, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        listener = socket.socket(family, socktype, proto)
    except OSError as exc:
        why = descriptor_shortage(exc) or exc
        raise DistNetworkError(f"tcp backend: rank {rank} cannot listen on {host!r}: {why}") from None
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        configure_socket(listener, buffer_bytes)
        listener.bind(sockaddr)
        listener.listen(max(128, size))
    except OSError as exc:
        listener.close()
        raise DistNetworkError(
            f"tcp backend: rank {rank} cannot listen on {host}:{port} ({exc}); "
            f"set options['host'] or ${HOST_ENV} to this machine's address"
        ) from None
    return listener


def open_listeners(store: Any, rank: int, size: int, options: Mapping[str, Any]) -> tuple[list[socket.socket], Address]:
    """This rank's listeners (TCP first, then the Unix-domain one where enabled and
    possible) and the address to publish for them (see :func:`choose_host`)."""
    host = choose_host(store, options)
    buffer_bytes = int(options.get("socket_buffer", DEFAULT_SOCKET_BUFFER))
    listeners = [_listen(rank, size, host, int(options.get("port", 0)), buffer_bytes)]
    unix_name = ""
    if _unix_enabled(options):
        unix_listener, unix_name = _unix_listener(buffer_bytes, size)
        if unix_listener is not None:
            listeners.append(unix_listener)
    return listeners, Address(host, listeners[0].getsockname()[1], unix_name)


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
) -> Optional[list[Any]]:
    """:func:`~tdist_tcp.net.connect.open_link` to ``peer`` with its address and the group nonce
    read from the records in ``store``, as a rank that did not join the group would (tests)."""
    nonce = first_record(store, rank, max(0.01, deadline - time.monotonic())).nonce
    auth = _Auth(nonce, group_key(secret, nonce), bool(secret))

    def exhausted(addr: str) -> None:
        raise_if_exhausted(store, auth, rank, peer, addr)

    where = lookup(store, [peer], deadline, rank)[peer].address
    return open_link(lambda: where, peer, rank, size, auth, deadline, buffer_bytes, use_unix, tls, streams, exhausted)


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
