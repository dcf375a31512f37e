"""``TCPStore``: a store served over TCP by one process of the job.

Wire protocol (big-endian, no pickle):

* Handshake. The client sends ``b"TDSTORE" + version``; the server answers
  ``b"TDSTORE" + version + auth flag (u8) + 32-byte random nonce``. If the server
  has a shared secret, the client sends ``HMAC-SHA256(token, nonce)`` and the
  server answers one byte ``0x01``, or closes the connection if the digest is wrong.
* Requests: ``command (u8) | argument count (u32) | per argument: length (u32), bytes``.
  Timeouts travel as a float64 (seconds), counters as decimal ASCII.
* Replies: ``status (u8) | payload length (u32) | payload``; status is OK, TIMEOUT
  (payload: the missing keys, encoded like request arguments) or ERROR (UTF-8 text).

A malformed request, a wrong magic or version, or a failed authentication makes the
server drop that one connection; everyone else keeps being served.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import selectors
import socket
import struct
import threading
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from .._errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, Store, Value, as_bytes
from .hash_store import add_to_value, compare_set_result

__all__ = ["TCPStore", "TCPStoreServer", "StoreConnectionError", "TOKEN_ENV"]

log = logging.getLogger(__name__)

TOKEN_ENV = "TDIST_STORE_TOKEN"
MAGIC = b"TDSTORE"
VERSION = 1
MAX_ARG_BYTES = 64 << 20
MAX_ARGS = 1024
MAX_REQUEST_BYTES = 256 << 20
HANDSHAKE_TIMEOUT = 10.0
_SOCKET_MARGIN = 2.0  # a client waits this much longer than the server-side timeout

SET, GET, ADD, COMPARE_SET, WAIT, CHECK, DELETE, NUM_KEYS, PING = range(1, 10)
_NAMES = dict(enumerate("SET GET ADD COMPARE_SET WAIT CHECK DELETE NUM_KEYS PING".split(), 1))
_ARITY = {SET: (2, 2), GET: (2, 2), ADD: (2, 2), COMPARE_SET: (3, 3), WAIT: (2, MAX_ARGS),
          CHECK: (1, MAX_ARGS), DELETE: (1, 1), NUM_KEYS: (0, 0), PING: (0, 1)}
OK, TIMEOUT, ERROR = 0, 1, 2
_U32 = struct.Struct("!I")
_F64 = struct.Struct("!d")
_REPLY = struct.Struct("!BI")
_WORKERS_KEY = b"\x00tdist/workers"  # keys starting with NUL are internal: num_keys skips them


class StoreConnectionError(DistNetworkError, DistStoreError):
    """The connection to a TCPStore server failed or was lost (both a network and a store error)."""


class _Drop(Exception):
    """The peer broke the protocol: close its connection."""


def _token_bytes(token: Union[str, bytes, None]) -> bytes:
    """The shared secret: ``token``, else ``$TDIST_STORE_TOKEN``; empty means no authentication."""
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    return token.encode() if isinstance(token, str) else bytes(token)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed by peer ({len(buf)} of {n} bytes received)")
        buf += chunk
    return bytes(buf)


def _encode_args(args: Sequence[bytes]) -> bytes:
    parts = [_U32.pack(len(args))]
    for arg in args:
        parts += [_U32.pack(len(arg)), arg]
    return b"".join(parts)


def _decode_args(payload: bytes) -> List[bytes]:
    (count,), pos, out = _U32.unpack_from(payload, 0), 4, []
    for _ in range(count):
        (size,) = _U32.unpack_from(payload, pos)
        out.append(payload[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return out


def _timeout_arg(arg: bytes) -> Optional[float]:
    if len(arg) != 8:
        raise _Drop("bad timeout argument")
    (value,) = _F64.unpack(arg)
    if math.isnan(value) or value < 0:
        raise _Drop("bad timeout value")
    return None if math.isinf(value) else value


class TCPStoreServer:
    """The server side of :class:`TCPStore`: a key-value table served from daemon threads.

    Binds only to ``host`` (resolved; ``""`` or ``"0.0.0.0"`` means every interface,
    and only when asked); ``port=0`` picks a free port, see :attr:`port`. ``token``
    (default ``$TDIST_STORE_TOKEN``) makes every client prove it knows the secret.
    Call :meth:`start`, and :meth:`stop` to close the sockets and end the threads.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Union[str, bytes, None] = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self._host = host
        self._requested_port = int(port)
        self._token = _token_bytes(token)
        self._handshake_timeout = handshake_timeout
        self._data: Dict[bytes, bytes] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._sock: Optional[socket.socket] = None
        self._sockname: Tuple = ()
        self._wake_r: Optional[socket.socket] = None  # a socket pair that wakes the accept loop on stop()
        self._wake_w: Optional[socket.socket] = None
        self._conns: Set[socket.socket] = set()
        self._threads: Set[threading.Thread] = set()
        self._conns_lock = threading.Lock()
        self._accept_thread: Optional[threading.Thread] = None
        self._port = self._requested_port

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The port listened on (the chosen one when constructed with ``port=0``)."""
        return self.sockname[1]

    @property
    def sockname(self) -> Tuple:
        """The bound address, as ``socket.getsockname()`` gave it."""
        if not self._sockname:
            raise DistStoreError(f"TCPStoreServer {self._host}:{self._port}: not started")
        return self._sockname

    def __repr__(self) -> str:
        state = "listening" if self._sock is not None and not self._stopping else "stopped"
        return f"<TCPStoreServer {self._host}:{self._port} {state}>"

    def start(self) -> "TCPStoreServer":
        """Bind, listen and start the accept thread; returns ``self`` (a no-op once started: no restarts)."""
        if self._sock is not None:
            return self
        where = f"TCPStoreServer {self._host}:{self._requested_port}"
        host = None if self._host == "" else self._host
        try:
            infos = socket.getaddrinfo(host, self._requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as exc:
            raise DistNetworkError(f"{where}: cannot resolve the host: {exc}") from exc
        error: Optional[OSError] = None
        for family, socktype, proto, _, addr in infos:
            sock = socket.socket(family, socktype, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
                sock.listen(512)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            sock.setblocking(False)
            self._sock, self._sockname = sock, sock.getsockname()
            self._port = self._sockname[1]
            break
        if self._sock is None:
            raise DistNetworkError(f"{where}: cannot listen: {error}") from error
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"tdist-store-accept:{self._port}",
                                               daemon=True)
        self._accept_thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listening socket and every connection; wait up to ``timeout`` s for the threads."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        if self._wake_w is not None:
            self._wake_w.send(b"x")
        deadline = time.monotonic() + timeout
        if self._accept_thread is not None:
            self._accept_thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        with self._conns_lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        for wake in (self._wake_r, self._wake_w):
            if wake is not None:
                wake.close()

    def __enter__(self) -> "TCPStoreServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- threads
    def _accept_loop(self) -> None:
        assert self._sock is not None and self._wake_r is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._sock, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping:
                for key, _ in sel.select():
                    if key.fileobj is self._wake_r:
                        return
                    try:
                        conn, _addr = self._sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:  # e.g. out of file descriptors: back off
                        log.debug("TCPStoreServer: accept failed: %s", exc)
                        time.sleep(0.05)
                        continue
                    self._spawn(conn)

    def _spawn(self, conn: socket.socket) -> None:
        thread = threading.Thread(target=self._serve, args=(conn,), name=f"tdist-store-conn:{self._port}", daemon=True)
        with self._conns_lock:
            if self._stopping:
                conn.close()
                return
            self._conns.add(conn)
            # finished threads are pruned here, not by themselves, so that stop() joins every live one
            self._threads = {t for t in self._threads if t.is_alive()}
            self._threads.add(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._handshake_timeout)
            self._handshake(conn)
            conn.settimeout(None)
            rfile = conn.makefile("rb")
            while not self._stopping:
                head = rfile.read(5)
                if not head:
                    return  # the client hung up between requests
                cmd, count = _REPLY.unpack(head)  # same layout: u8 command, u32 argument count
                low, high = _ARITY.get(cmd, (1, 0))
                if not low <= count <= high:
                    raise _Drop(f"command {cmd} with {count} arguments")
                args: List[bytes] = []
                total = 0
                for _ in range(count):
                    (size,) = _U32.unpack(rfile.read(4))
                    total += size
                    if size > MAX_ARG_BYTES or total > MAX_REQUEST_BYTES:
                        raise _Drop(f"argument of {size} bytes is over the limit")
                    args.append(rfile.read(size))
                    if len(args[-1]) < size:
                        raise _Drop("truncated request")
                status, payload = self._dispatch(cmd, args)
                conn.sendall(_REPLY.pack(status, len(payload)) + payload)
        except (_Drop, OSError, ValueError, struct.error) as exc:
            log.debug("TCPStoreServer: dropping a connection: %s", exc)
        finally:
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _handshake(self, conn: socket.socket) -> None:
        if _recv_exact(conn, len(MAGIC) + 1) != MAGIC + bytes([VERSION]):
            raise _Drop("bad handshake magic or version")
        nonce = os.urandom(32)
        conn.sendall(MAGIC + bytes([VERSION, 1 if self._token else 0]) + nonce)
        if self._token:
            digest = _recv_exact(conn, 32)
            if not hmac.compare_digest(digest, hmac.new(self._token, nonce, hashlib.sha256).digest()):
                raise _Drop("authentication failed")
            conn.sendall(b"\x01")

    # ----------------------------------------------------------------- commands
    def _wait_locked(self, keys: Sequence[bytes], timeout: Optional[float]) -> List[bytes]:
        """Wait (condition held) until ``keys`` are set; return the missing ones on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._stopping:
                raise _Drop("server stopping")
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return []
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return missing
            self._cond.wait(remaining)

    def _dispatch(self, cmd: int, args: List[bytes]) -> Tuple[int, bytes]:
        data = self._data
        with self._cond:
            if cmd == SET:
                data[args[0]] = args[1]
                self._cond.notify_all()
            elif cmd in (GET, WAIT):
                missing = self._wait_locked(args[1:], _timeout_arg(args[0]))
                if missing:
                    return TIMEOUT, _encode_args(missing)
                return OK, data[args[1]] if cmd == GET else b""
            elif cmd == ADD:
                if len(args[1]) > 32:
                    raise _Drop("bad ADD amount")
                amount = int(args[1])  # ValueError drops the connection
                try:
                    key = args[0].decode(errors="replace")
                    data[args[0]] = add_to_value("TCPStore", key, data.get(args[0]), amount)
                except DistStoreError as exc:
                    return ERROR, str(exc).encode()
                self._cond.notify_all()
                return OK, data[args[0]]
            elif cmd == COMPARE_SET:
                store, result = compare_set_result(data.get(args[0]), args[1], args[2])
                if store:
                    data[args[0]] = result
                    self._cond.notify_all()
                return OK, result
            elif cmd == CHECK:
                return OK, b"\x01" if all(k in data for k in args) else b"\x00"
            elif cmd == DELETE:
                return OK, b"\x01" if data.pop(args[0], None) is not None else b"\x00"
            elif cmd == NUM_KEYS:
                return OK, str(sum(1 for k in data if not k.startswith(b"\x00"))).encode()
            elif cmd == PING:
                return OK, args[0] if args else b""
        return OK, b""


class TCPStore(Store):
    """A client of a :class:`TCPStoreServer`; with ``is_master=True`` it also runs the server.

    Connecting retries with backoff until ``timeout`` (the server may start later),
    then raises :class:`DistStoreTimeoutError` naming ``host:port``. On the master,
    ``wait_for_workers`` with a ``world_size`` blocks until ``world_size`` clients
    (the master's own included) have connected. ``token`` (default
    ``$TDIST_STORE_TOKEN``) is the shared secret for HMAC authentication; a refused
    client raises :class:`DistStoreError`. Methods are thread-safe. A lost connection
    raises :class:`StoreConnectionError` (a DistNetworkError and a DistStoreError); the
    next call tries once to reconnect. ``close()`` on the master also stops the server.
    """

    def __init__(self, host_name: str, port: int, world_size: Optional[int] = None, is_master: bool = False,
                 timeout: Timeout = DEFAULT_STORE_TIMEOUT, wait_for_workers: bool = True,
                 token: Union[str, bytes, None] = None) -> None:
        super().__init__(timeout)
        self._host = host_name
        self._port = int(port)
        self._is_master = is_master
        self._token = _token_bytes(token)
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        self._closed = False
        self._server: Optional[TCPStoreServer] = None
        start = time.monotonic()
        try:
            if is_master:
                self._server = TCPStoreServer(host_name, self._port, token=self._token).start()
                self._port = self._server.port
            self._sock = self._connect(self._timeout, retry=True)
            self._request(ADD, [_WORKERS_KEY, b"1"])
            if is_master and wait_for_workers and world_size:
                self._wait_for_workers(int(world_size), self._timeout - (time.monotonic() - start))
        except BaseException:
            self.close()
            raise

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The server's port (the one it picked when the master was given ``port=0``)."""
        return self._port

    @property
    def server(self) -> Optional[TCPStoreServer]:
        """The server this (master) store runs, else None."""
        return self._server

    def __repr__(self) -> str:
        return f"<TCPStore {self._where} master={self._is_master}>"

    @property
    def _where(self) -> str:
        return f"TCPStore {self._host}:{self._port}"

    # --------------------------------------------------------------- connection
    def _connect(self, limit: float, retry: bool) -> socket.socket:
        deadline = time.monotonic() + limit
        delay = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self._host, self._port), timeout=max(remaining, 0.05))
            except OSError as exc:
                error: Exception = exc
            else:
                try:
                    self._handshake(sock, min(HANDSHAKE_TIMEOUT, max(deadline - time.monotonic(), 0.05)))
                    sock.settimeout(None)
                    return sock
                except OSError as exc:  # e.g. the server shut down mid-handshake
                    sock.close()
                    error = exc
                except BaseException:
                    sock.close()
                    raise
            remaining = deadline - time.monotonic()
            if not retry:
                raise StoreConnectionError(f"{self._where}: cannot connect to the server: {error}") from error
            if remaining <= 0:
                raise DistStoreTimeoutError(
                    f"{self._where}: timed out after {limit:g} s connecting to the server (last error: {error})"
                ) from error
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 1.0)

    def _handshake(self, sock: socket.socket, limit: float) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(limit)
        sock.sendall(MAGIC + bytes([VERSION]))
        hello = _recv_exact(sock, len(MAGIC) + 2 + 32)
        if hello[: len(MAGIC) + 1] != MAGIC + bytes([VERSION]):
            raise DistStoreError(f"{self._where}: the server is not a tdist store of protocol version {VERSION}")
        if not hello[len(MAGIC) + 1]:
            return
        if not self._token:
            raise DistStoreError(f"{self._where}: authentication failed: the server requires a token "
                                 f"(pass token= or set {TOKEN_ENV})")
        sock.sendall(hmac.new(self._token, hello[-32:], hashlib.sha256).digest())
        try:
            ack = sock.recv(1)  # the server hangs up on a wrong digest
        except OSError:
            ack = b""
        if ack != b"\x01":
            raise DistStoreError(f"{self._where}: authentication failed (wrong token)")

    def _request(self, cmd: int, args: Sequence[bytes], wait: Optional[float] = None) -> Tuple[int, bytes]:
        """Send one request and read its reply; ``wait`` is the server-side timeout it may block for."""
        if any(len(arg) > MAX_ARG_BYTES for arg in args):
            raise DistStoreError(
                f"{self._where}: {_NAMES[cmd]}: an argument exceeds the {MAX_ARG_BYTES >> 20} MiB limit")
        frame = bytes([cmd]) + _encode_args(args)
        limit = (self._timeout if wait is None else wait) + _SOCKET_MARGIN
        with self._lock:
            if self._closed:
                raise DistStoreError(f"{self._where}: the store is closed")
            if self._sock is None:
                self._sock = self._connect(min(self._timeout, HANDSHAKE_TIMEOUT), retry=False)
            sock = self._sock
            try:
                sock.settimeout(None if math.isinf(limit) else limit)
                sock.sendall(frame)
                status, size = _REPLY.unpack(_recv_exact(sock, _REPLY.size))
                if size > MAX_REQUEST_BYTES:
                    raise ConnectionError(f"reply of {size} bytes is over the limit")
                payload = _recv_exact(sock, size)
            except socket.timeout as exc:
                self._drop_connection()
                raise DistStoreTimeoutError(f"{self._where}: no reply to {_NAMES[cmd]} within {limit:g} s; "
                                            "connection dropped") from exc
            except OSError as exc:
                self._drop_connection()
                raise StoreConnectionError(f"{self._where}: connection to the server lost during "
                                           f"{_NAMES[cmd]}: {exc}") from exc
        if status == ERROR:
            raise DistStoreError(f"{self._where}: {payload.decode('utf-8', 'replace')}")
        return status, payload

    def _drop_connection(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _wait_for_workers(self, world_size: int, limit: float) -> None:
        deadline = time.monotonic() + limit
        delay = 0.005
        while True:
            arrived = int(self._request(ADD, [_WORKERS_KEY, b"0"])[1])
            if arrived >= world_size:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistStoreTimeoutError(f"{self._where}: timed out after {self._timeout:g} s waiting for "
                                            f"workers: {arrived} of {world_size} arrived")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, 0.1)

    def _blocking(self, cmd: int, keys: Sequence[str], timeout: Timeout) -> bytes:
        limit = max(0.0, self._limit(timeout))
        deadline = time.monotonic() + limit
        payload = b""
        encoded = [k.encode() for k in keys]
        for i in range(0, max(len(encoded), 1), MAX_ARGS - 1):  # WAIT on many keys: in batches
            remaining = limit if math.isinf(limit) else max(0.0, deadline - time.monotonic())
            status, payload = self._request(cmd, [_F64.pack(remaining)] + encoded[i : i + MAX_ARGS - 1], remaining)
            if status == TIMEOUT:
                missing = [k.decode("utf-8", "replace") for k in _decode_args(payload)]
                raise DistStoreTimeoutError(f"{self._where}: timed out after {limit:g} s waiting for keys {missing}")
        return payload

    # --------------------------------------------------------------- Store API
    def set(self, key: str, value: Value) -> None:
        self._request(SET, [key.encode(), as_bytes(value)])

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        return self._blocking(GET, [key], timeout)

    def add(self, key: str, amount: int) -> int:
        return int(self._request(ADD, [key.encode(), str(int(amount)).encode()])[1])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._request(COMPARE_SET, [key.encode(), as_bytes(expected), as_bytes(desired)])[1]

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        if keys:
            self._blocking(WAIT, list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        encoded = [k.encode() for k in keys]
        return all(self._request(CHECK, encoded[i : i + MAX_ARGS])[1] == b"\x01"
                   for i in range(0, len(encoded), MAX_ARGS))

    def delete_key(self, key: str) -> bool:
        return self._request(DELETE, [key.encode()])[1] == b"\x01"

    def num_keys(self) -> int:
        return int(self._request(NUM_KEYS, [])[1])

    def ping(self, payload: bytes = b"") -> bytes:
        """Round-trip ``payload`` through the server (a liveness check)."""
        return self._request(PING, [payload] if payload else [])[1]

    def close(self) -> None:
        """Close the connection; on the master, also stop the server."""
        self._closed = True
        sock = self._sock
        if sock is not None:  # wake a request blocked in another thread without taking its lock
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        with self._lock:
            self._drop_connection()
        if self._server is not None:
            self._server.stop()
