"""``TCPStore``: a store served over TCP by one process of the job (torch.distributed.TCPStore's API).

The client speaks the protocol of :mod:`.tcp_protocol` to a :class:`TCPStoreServer`; the
master (``is_master=True``) runs that server in its process. Every operation, extended ones
included, is one request and one reply, done atomically by the server.
"""

from __future__ import annotations

import hmac
import os
import socket
import ssl
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from .._errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from .._oserror import describe, out_of_descriptors
from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, QueueEmptyError, Store, Value, as_bytes, wait_timeout_error
from .table import INTERNAL_PREFIX
from .tcp_protocol import (
    ACK,
    ADD,
    APPEND,
    BARRIER,
    CHECK,
    COMPARE_SET,
    DELETE,
    EMPTY,
    ERROR,
    F64,
    GET,
    HEAD,
    LIST_KEYS,
    MAGIC,
    MAX_ARG_BYTES,
    MAX_ARGS,
    MAX_REQUEST_BYTES,
    MULTI_GET,
    MULTI_SET,
    NAMES,
    NONCE_BYTES,
    NUM_KEYS,
    PING,
    PROOF_BYTES,
    QUEUE_LEN,
    QUEUE_POP,
    QUEUE_PUSH,
    SERVER_HELLO_BYTES,
    SET,
    TIMEOUT,
    TLS_REQUIRED,
    OUT_OF_DESCRIPTORS,
    TOKEN_ENV,
    VERSION,
    WAIT,
    client_proof,
    decode_list,
    encode_request,
    server_proof,
    token_bytes,
)
from .tcp_server import HANDSHAKE_TIMEOUT, TCPStoreServer, UnresolvableHostError
from .tls import WOULD_BLOCK, TlsConfig, describe_ssl_error

__all__ = ["TCPStore", "TCPStoreServer", "StoreConnectionError", "StoreConnectTimeoutError", "TOKEN_ENV"]

_SOCKET_MARGIN = 2.0  # a client waits this much longer than the server-side timeout
#: the longest pause between a client's attempts to reach a server not up yet: waking late
#: costs every rank of an init that much (10 ms, doubling: at most 0.1 s of lateness)
CONNECT_RETRY_MAX_S = 0.1
_INIT_KEY = INTERNAL_PREFIX + b"tdist/init"  # counts the stores that joined with a known world size
_AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


class StoreConnectionError(DistNetworkError, DistStoreError):
    """The connection to a TCPStore server failed or was lost (both a network and a store error)."""


class StoreConnectTimeoutError(StoreConnectionError, DistStoreTimeoutError):
    """No connection to the TCPStore server could be made within the timeout."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"connection closed by peer ({len(buf)} of {n} bytes received)")
        buf += chunk
    return bytes(buf)


def _set_io_timeout(sock: socket.socket, limit: float) -> None:
    """Bound every send and receive on the blocking ``sock`` by ``limit`` seconds in the kernel
    (a socket with a Python timeout would poll() before every call: two more system calls a request)."""
    limit = max(limit, 0.001)
    timeval = struct.pack("@ll", int(limit), int((limit % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def _ms(seconds: float) -> int:
    return int(round(seconds * 1000))


class _ServerLease:
    """A server shared by the stores that use it (a master, its clones, multi-tenant stores):
    the last one to close stops it."""

    def __init__(self, server: TCPStoreServer, tenant_port: Optional[int]) -> None:
        self.server = server
        self.users = 1
        self.tenant_port = tenant_port

    def acquire(self) -> "_ServerLease":
        with _TENANTS_LOCK:
            self.users += 1
        return self

    def release(self) -> None:
        with _TENANTS_LOCK:
            self.users -= 1
            last = self.users == 0
            if last and self.tenant_port is not None and _TENANTS.get(self.tenant_port) is self:
                del _TENANTS[self.tenant_port]
        if last:
            self.server.stop()


_TENANTS: Dict[int, _ServerLease] = {}  # multi_tenant servers of this process, by port (as torch keys them)
_TENANTS_LOCK = threading.Lock()


def _agent_store_serves(port: int) -> bool:
    """torchelastic's agent already serves ``port`` (TORCHELASTIC_USE_AGENT_STORE and MASTER_PORT say so)."""
    return os.environ.get(_AGENT_STORE_ENV, "") in ("1", "True", "true") and os.environ.get("MASTER_PORT", "") == str(
        port
    )


class TCPStore(Store):
    """A client of a :class:`TCPStoreServer`; with ``is_master=True`` it also runs the server.

    torch's signature and semantics: ``world_size`` (None: unknown; 0 raises ValueError at
    once) with ``wait_for_workers`` makes every store count in, and the master wait until
    ``world_size`` have; ``multi_tenant=True`` lets several masters of one process share the
    server on a port; ``master_listen_fd`` takes over a bound socket; ``use_libuv`` is
    accepted and reported by :attr:`libuvBackend` (tdist has one server, an event loop like
    torch's libuv one). With ``TORCHELASTIC_USE_AGENT_STORE`` set and ``MASTER_PORT`` equal to
    ``port``, a master whose port is taken joins the agent's server as a client (as torch does).

    Connecting retries with backoff (10 ms doubling to :data:`CONNECT_RETRY_MAX_S`) until
    ``timeout`` (the server may start later, its name may not resolve yet), then raises :class:`StoreConnectTimeoutError` (a DistNetworkError
    and a DistStoreTimeoutError) naming ``host:port``. ``token`` (default ``$TDIST_STORE_TOKEN``)
    is the shared secret: the server and the client each prove they know it (HMAC over two
    fresh nonces); a client holding a token refuses a server that does not authenticate.
    ``tls`` (default: from the ``TDIST_TLS_*`` variables, see :mod:`tdist._store.tls`; False:
    off) runs the connection, and the master's server, over TLS; the token handshake then
    runs inside it. A TLS client refuses a server without TLS, and the other way round.
    Methods are thread-safe (one request at a time per store: ``clone()`` gives another
    connection for another thread). A lost connection raises :class:`StoreConnectionError`;
    the next call tries once to reconnect. ``close()`` (or dropping the last reference) ends
    the connection; the server stops when its last user closes.
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: Timeout = DEFAULT_STORE_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
        *,
        token: Union[str, bytes, None] = None,
        tls: Union[TlsConfig, None, bool] = None,
    ) -> None:
        self._sock: Optional[socket.socket] = None
        self._io_limit = -1.0  # the send/receive timeout set on _sock
        self._lease: Optional[_ServerLease] = None
        self._closed = False
        if world_size is not None and int(world_size) == 0:
            raise ValueError("TCPStore world size cannot be 0")
        super().__init__(timeout)
        self._host = host_name
        self._port = int(port)
        self._world_size = None if world_size is None or int(world_size) < 0 else int(world_size)
        self._use_libuv = bool(use_libuv)
        self._token = token_bytes(token)
        self._tls = TlsConfig.resolve(tls)
        self._tls_ctx = self._tls.client_context(self._where) if self._tls is not None else None
        self._lock = threading.Lock()
        deadline = time.monotonic() + self._timeout
        try:
            if is_master:
                self._lease = self._serve(multi_tenant, master_listen_fd, deadline)
            self._sock = self._connect(deadline)
            if self._world_size is not None and wait_for_workers:
                self._count_in(is_master and self._lease is not None, deadline)
        except BaseException:
            self.close()
            raise

    @classmethod
    def _clone_of(cls, other: "TCPStore") -> "TCPStore":
        """Another connection to ``other``'s server, sharing its lease on the server."""
        clone = cls.__new__(cls)
        Store.__init__(clone, other.timeout)
        clone._sock, clone._closed, clone._io_limit = None, False, -1.0
        clone._host, clone._port, clone._world_size = other._host, other._port, other._world_size
        clone._use_libuv, clone._token, clone._lock = other._use_libuv, other._token, threading.Lock()
        clone._tls, clone._tls_ctx = other._tls, other._tls_ctx
        clone._lease = other._lease.acquire() if other._lease is not None else None
        try:
            clone._sock = clone._connect(time.monotonic() + clone._timeout)
        except BaseException:
            clone.close()
            raise
        return clone

    # --------------------------------------------------------------- properties
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one it picked when the master was given ``port=0``)."""
        return self._port

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's name
        """The ``use_libuv`` flag the store was made with (torch reports which of its two servers
        runs; tdist's single server is an event loop and serves both settings)."""
        return self._use_libuv

    @property
    def server(self) -> Optional[TCPStoreServer]:
        """The server this store (a master or its clone) keeps running, else None."""
        return self._lease.server if self._lease is not None else None

    def __repr__(self) -> str:
        role = f"server=TCPStoreServer(port={self._port})" if self._lease is not None else "server=None"
        return f"TCPStore({self._host}:{self._port}, {role})"

    @property
    def _where(self) -> str:
        return f"TCPStore {self._host}:{self._port}"

    # --------------------------------------------------------------- setup
    def _serve(self, multi_tenant: bool, listen_fd: Optional[int], deadline: float) -> Optional[_ServerLease]:
        """Start (or, multi-tenant, share) the server; None when torchelastic's agent serves the port."""
        if multi_tenant:
            with _TENANTS_LOCK:
                lease = _TENANTS.get(self._port)
                if lease is not None and lease.users > 0:
                    if not lease.server.token_matches(self._token):
                        raise DistStoreError(
                            f"{self._where}: multi_tenant: the server on this port runs with another token"
                        )
                    lease.users += 1
                    return lease
        delay = 0.05
        while True:
            server = TCPStoreServer(
                self._host, self._port, token=self._token, listen_fd=listen_fd, tls=self._tls or False
            )
            try:
                server.start()
                break
            except UnresolvableHostError as exc:  # retry: the name may appear (new machines' DNS entries)
                if time.monotonic() >= deadline:
                    raise StoreConnectTimeoutError(
                        f"{self._where}: the client socket has timed out after {_ms(self._timeout)}ms while trying "
                        f"to connect to ({self._host}, {self._port}): {exc}"
                    ) from exc
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 1.0)
            except DistNetworkError:
                if listen_fd is None and _agent_store_serves(self._port):
                    return None  # torchelastic's agent serves this port: join it as a client
                raise
        self._port = server.port
        lease = _ServerLease(server, self._port if multi_tenant else None)
        if multi_tenant:
            with _TENANTS_LOCK:
                _TENANTS[self._port] = lease
        return lease

    def _connect(self, deadline: float, retry: bool = True) -> socket.socket:
        """Connect and authenticate, retrying until ``deadline`` (once only without ``retry``)."""
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(remaining, 0.05))
            except OSError as exc:
                if out_of_descriptors(exc):  # waiting would not give this process a descriptor back
                    raise StoreConnectionError(
                        f"{self._where}: cannot open a connection to the server: {describe(exc)}"
                    ) from exc
                error: Exception = exc
            else:
                try:
                    limit = min(HANDSHAKE_TIMEOUT, max(deadline - time.monotonic(), 0.05))
                    if self._tls_ctx is not None:
                        sock = self._tls_handshake(sock, limit)
                    self._handshake(sock, limit)
                    sock.settimeout(None)  # blocking: requests are bounded by SO_RCVTIMEO/SO_SNDTIMEO instead
                    self._io_limit = -1.0
                    return sock
                except OSError as exc:  # e.g. the server shut down, or shed us, mid-handshake
                    sock.close()
                    error = exc
                except BaseException:
                    sock.close()
                    raise
            remaining = deadline - time.monotonic()
            if not retry:
                raise StoreConnectionError(f"{self._where}: cannot connect to the server: {error}") from error
            if remaining <= 0:
                raise StoreConnectTimeoutError(
                    f"{self._where}: the client socket has timed out after {_ms(self._timeout)}ms while trying to "
                    f"connect to ({self._host}, {self._port}) (last error: {error})"
                ) from error
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, CONNECT_RETRY_MAX_S)

    def _tls_handshake(self, sock: socket.socket, limit: float) -> socket.socket:
        """Wrap ``sock`` in TLS and shake hands within ``limit`` s; a refused certificate or a
        server without TLS raises DistStoreError (not retried: retrying cannot fix it)."""
        assert self._tls_ctx is not None
        sock.settimeout(limit)
        try:
            tls_sock = self._tls_ctx.wrap_socket(sock, server_hostname=self._host)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            raise
        except ssl.SSLError as exc:
            sock.close()
            raise DistStoreError(f"{self._where}: refusing the server: {describe_ssl_error(exc)}") from exc
        return tls_sock

    def _handshake(self, sock: socket.socket, limit: float) -> None:
        try:
            self._token_handshake(sock, limit)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) + WOULD_BLOCK:
            raise
        except ssl.SSLError as exc:  # e.g. the server refused our certificate (TLS 1.3 says so only now)
            raise DistStoreError(
                f"{self._where}: the server refused the connection: {describe_ssl_error(exc)}"
            ) from exc

    def _token_handshake(self, sock: socket.socket, limit: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(limit)
        nonce = os.urandom(NONCE_BYTES)
        sock.sendall(MAGIC + bytes([VERSION]) + nonce)
        hello = _recv_exact(sock, SERVER_HELLO_BYTES)
        if hello[: len(MAGIC) + 1] != MAGIC + bytes([VERSION]):
            raise DistStoreError(
                f"{self._where}: the server is not a tdist store of protocol version {VERSION} "
                "(another program, or torch's TCPStore, listens there)"
            )
        authenticates, server_nonce = hello[len(MAGIC) + 1], hello[len(MAGIC) + 2 :]
        if authenticates == OUT_OF_DESCRIPTORS:
            raise StoreConnectionError(
                f"{self._where}: the server ran out of file descriptors (EMFILE or ENFILE: too many open files) and "
                "cannot take this connection: raise the open-file limit (ulimit -n) of the process that hosts "
                "the store (rank 0's, the launcher's), or start fewer processes"
            )
        if authenticates == TLS_REQUIRED:
            raise DistStoreError(
                f"{self._where}: the server requires TLS and this store has none: set TDIST_TLS_CA "
                "(and TDIST_TLS_CERT / TDIST_TLS_KEY when it asks for client certificates)"
            )
        if not authenticates:
            if self._token:
                raise DistStoreError(
                    f"{self._where}: refusing the server: this store holds a token but the server does not "
                    "authenticate (token downgrade); a process without the token may be squatting the port"
                )
            return
        if not self._token:
            raise DistStoreError(
                f"{self._where}: authentication failed: the server requires a token (pass token= or set {TOKEN_ENV})"
            )
        proof = _recv_exact(sock, PROOF_BYTES)
        if not hmac.compare_digest(proof, server_proof(self._token, nonce, server_nonce)):
            raise DistStoreError(
                f"{self._where}: authentication failed: the server could not prove it knows "
                "this store's token (the tokens differ, or an impostor squats the port); refusing it"
            )
        sock.sendall(client_proof(self._token, nonce, server_nonce))
        ack = sock.recv(1)
        if not ack:  # shed under load or past the deadline, not refused: the caller retries
            raise ConnectionError("the server closed the connection during the handshake")
        if ack != ACK:
            raise DistStoreError(f"{self._where}: authentication failed (wrong token)")

    def _count_in(self, master: bool, deadline: float) -> None:
        """torch's worker count: every store with a known world size adds one; the master waits
        for all (one BARRIER request: add, then wait for the count)."""
        if not master:
            self._request(ADD, [_INIT_KEY, b"1"])
            return
        limit = max(0.0, deadline - time.monotonic())
        status, payload = self._request(BARRIER, [F64.pack(limit), _INIT_KEY, str(self._world_size).encode()], limit)
        if status == TIMEOUT:
            arrived = int(decode_list(payload)[1])
            raise DistStoreTimeoutError(
                f"{self._where}: Timed out after {int(round(self._timeout))} seconds waiting for clients. "
                f"{arrived}/{self._world_size} clients joined. (timeout {self._timeout:g} s: every rank must create "
                "its TCPStore within it)"
            )

    # --------------------------------------------------------------- requests
    def _request(self, cmd: int, args: Sequence[bytes], wait: Optional[float] = None) -> Tuple[int, bytes]:
        """Send one request and read its reply; ``wait`` is the server-side timeout it may block for."""
        frame = encode_request(cmd, args)
        if len(frame) > MAX_ARG_BYTES and any(len(arg) > MAX_ARG_BYTES for arg in args):
            raise DistStoreError(
                f"{self._where}: {NAMES[cmd]}: an argument exceeds the {MAX_ARG_BYTES >> 20} MiB limit"
            )
        limit = (self._timeout if wait is None else wait) + _SOCKET_MARGIN
        with self._lock:
            if self._closed:
                raise DistStoreError(f"{self._where}: the store is closed")
            if self._sock is None:
                self._sock = self._connect(time.monotonic() + min(self._timeout, HANDSHAKE_TIMEOUT), retry=False)
            sock = self._sock
            try:
                if limit != self._io_limit:
                    _set_io_timeout(sock, limit)
                    self._io_limit = limit
                sock.sendall(frame)
                status, payload = self._read_reply(sock)
            except (socket.timeout, BlockingIOError) + WOULD_BLOCK as exc:  # SO_RCVTIMEO/SO_SNDTIMEO expired
                self._drop_connection()
                raise DistStoreTimeoutError(
                    f"{self._where}: {NAMES[cmd]}: no reply within {limit:g} s (timeout); connection dropped"
                ) from exc
            except OSError as exc:
                self._drop_connection()
                raise StoreConnectionError(
                    f"{self._where}: connection to the server lost during {NAMES[cmd]}: {exc}"
                ) from exc
        if status == ERROR:
            raise DistStoreError(f"{self._where}: {payload.decode('utf-8', 'replace')}")
        return status, payload

    @staticmethod
    def _read_reply(sock: socket.socket) -> Tuple[int, bytes]:
        data = sock.recv(16384)  # most replies are small; a large one is read to its end below
        while len(data) < HEAD.size:
            if not data:
                raise ConnectionError("connection closed by the server")
            more = sock.recv(16384)
            if not more:
                raise ConnectionError("connection closed by the server")
            data += more
        status, size = HEAD.unpack_from(data)
        if size > MAX_REQUEST_BYTES:
            raise ConnectionError(f"reply of {size} bytes is over the limit")
        end = HEAD.size + size
        if len(data) < end:
            data = data + _recv_exact(sock, end - len(data))
        elif len(data) > end:
            raise ConnectionError("the server sent more than one reply")
        return status, data[HEAD.size :]

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _blocking(self, cmd: int, keys: Sequence[str], timeout: Timeout, prefix: Sequence[bytes] = ()) -> List[bytes]:
        """A blocking request on ``keys`` (in batches of what one request takes), sharing one deadline;
        returns each reply's payload. Raises the wait-timeout error naming the missing keys."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        encoded = [k.encode() for k in keys]
        payloads = []
        step = MAX_ARGS - 1 - len(prefix)
        for i in range(0, max(len(encoded), 1), step):
            remaining = max(0.0, deadline - time.monotonic())
            status, payload = self._request(cmd, [*prefix, F64.pack(remaining), *encoded[i : i + step]], remaining)
            if status == TIMEOUT:
                missing = [k.decode("utf-8", "replace") for k in decode_list(payload)]
                raise wait_timeout_error(self._where, limit, missing)
            payloads.append(payload)
        return payloads

    # --------------------------------------------------------------- Store API
    def set(self, key: str, value: Value) -> None:
        self._request(SET, [key.encode(), as_bytes(value)])

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        return self._blocking(GET, [key], timeout)[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._request(ADD, (key.encode(), b"%d" % int(amount)))[1])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._request(COMPARE_SET, [key.encode(), as_bytes(expected), as_bytes(desired)])[1]

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        if keys:
            self._blocking(WAIT, list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        encoded = [k.encode() for k in keys]
        return all(
            self._request(CHECK, encoded[i : i + MAX_ARGS])[1] == b"\x01" for i in range(0, len(encoded), MAX_ARGS)
        )

    def delete_key(self, key: str) -> bool:
        return self._request(DELETE, [key.encode()])[1] == b"\x01"

    def num_keys(self) -> int:
        return int(self._request(NUM_KEYS, [])[1])

    # --------------------------------------------------------------- extended API
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: Value) -> None:
        self._request(APPEND, [key.encode(), as_bytes(value)])

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        if not keys:
            return []
        return [v for payload in self._blocking(MULTI_GET, list(keys), None) for v in decode_list(payload)]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{self._where}: multi_set: {len(keys)} keys but {len(values)} values")
        args = [b for k, v in zip(keys, values) for b in (k.encode(), as_bytes(v))]
        for i in range(0, len(args), MAX_ARGS):  # one atomic request up to 32768 keys
            self._request(MULTI_SET, args[i : i + MAX_ARGS])

    def list_keys(self) -> List[str]:
        return [k.decode("utf-8", "replace") for k in decode_list(self._request(LIST_KEYS, [])[1])]

    def queue_push(self, key: str, value: Value) -> None:
        self._request(QUEUE_PUSH, [key.encode(), as_bytes(value)])

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        if not block:
            status, payload = self._request(QUEUE_POP, [b"\x00", F64.pack(0.0), key.encode()])
            if status == EMPTY:
                raise QueueEmptyError(f"{self._where}: queue_pop: queue {key!r} is empty")
            return payload
        return self._blocking(QUEUE_POP, [key], timeout, prefix=[b"\x01"])[0]

    def queue_len(self, key: str) -> int:
        return int(self._request(QUEUE_LEN, [key.encode()])[1])

    def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        limit = self._limit(timeout)
        status, payload = self._request(BARRIER, [F64.pack(limit), key.encode(), str(int(world_size)).encode()], limit)
        if status == TIMEOUT:
            arrived = decode_list(payload)[1].decode()
            raise DistStoreTimeoutError(
                f"{self._where}: barrier timeout after {_ms(limit)}ms, key: {key} ({arrived} of {world_size} arrived)"
            )

    def clone(self) -> "TCPStore":
        """Another connection to the same server (for another thread); it keeps the server alive too."""
        with self._lock:
            if self._closed:
                raise DistStoreError(f"{self._where}: the store is closed")
        return TCPStore._clone_of(self)

    def ping(self, payload: bytes = b"") -> bytes:
        """Round-trip ``payload`` through the server (a liveness check)."""
        return self._request(PING, [payload] if payload else [])[1]

    def close(self) -> None:
        """Close the connection; the server stops when its last user (master, clone) closes."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:  # wake a request blocked in another thread without taking its lock
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        lock = getattr(self, "_lock", None)
        if lock is not None:
            with lock:
                self._drop_connection()
        else:
            self._drop_connection()
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing to report to
            pass
