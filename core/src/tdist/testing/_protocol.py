"""The control channel between a :class:`~tdist.testing.World` and its workers.

A connection starts with a mutual handshake in raw bytes (no pickle): the worker
sends ``MAGIC`` and a 32-byte nonce; the controller answers with its own nonce and
``HMAC-SHA256(token, "controller" | worker nonce | controller nonce)``; the worker
checks it and answers ``HMAC-SHA256(token, "worker" | controller nonce | worker
nonce)``, which the controller checks. The token is a random secret the controller
hands its workers in their environment. Either side hangs up on a wrong answer, and
nothing received is unpickled before the other side has proved it knows the token:
a local process that connects to the controller (or poses as one) runs no code.

After the handshake, frames are an 8-byte big-endian length followed by a pickle:
results and exceptions are arbitrary Python objects. Tensors under test never
travel through it (bodies return small values). The controller listens on
127.0.0.1 only.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import queue
import socket
import struct
import time
from typing import Any, Optional

__all__ = [
    "send_msg",
    "recv_msg",
    "ChannelClosed",
    "AuthenticationFailed",
    "accept_worker",
    "join_controller",
    "HANDSHAKE_TIMEOUT",
]

_HEADER = struct.Struct(">Q")
_MAX_FRAME = 256 * 1024 * 1024
MAGIC = b"TDKIT\x00\x00\x01"
_NONCE = 32
_DIGEST = hashlib.sha256().digest_size
#: Seconds a whole handshake may take (each side), however the bytes trickle in.
HANDSHAKE_TIMEOUT = 10.0


class ChannelClosed(ConnectionError):
    """The other end of the control channel went away."""


class AuthenticationFailed(ConnectionError):
    """The other end of a new connection did not prove it knows the world's token."""


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one pickled frame."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int, deadline: float = 0.0) -> bytes:
    """``n`` bytes; with a ``deadline`` (time.monotonic), a socket.timeout once it passes."""
    chunks = []
    while n:
        if deadline:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise socket.timeout("handshake deadline passed")
            sock.settimeout(remaining)
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ChannelClosed("control channel closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket) -> Any:
    """Receive one frame (blocking); raise :class:`ChannelClosed` at EOF.
    Only for a connection that passed the handshake."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > _MAX_FRAME:
        raise ChannelClosed(f"control frame of {length} bytes is too large")
    return pickle.loads(_recv_exact(sock, length))


def _proof(token: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token, role + first + second, hashlib.sha256).digest()


def accept_worker(sock: socket.socket, token: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Controller side: authenticate a new connection both ways within ``timeout``
    seconds; raise :class:`AuthenticationFailed` (or OSError) otherwise. Reads raw bytes only."""
    deadline = time.monotonic() + timeout
    hello = _recv_exact(sock, len(MAGIC) + _NONCE, deadline)
    if not hmac.compare_digest(hello[: len(MAGIC)], MAGIC):
        raise AuthenticationFailed("not a tdist.testing worker (bad magic)")
    worker_nonce, my_nonce = hello[len(MAGIC) :], os.urandom(_NONCE)
    sock.sendall(my_nonce + _proof(token, b"controller", worker_nonce, my_nonce))
    answer = _recv_exact(sock, _DIGEST, deadline)
    if not hmac.compare_digest(answer, _proof(token, b"worker", my_nonce, worker_nonce)):
        raise AuthenticationFailed("the worker does not know the world's token")
    sock.settimeout(None)


def join_controller(sock: socket.socket, token: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Worker side: prove knowledge of ``token`` and check that the controller knows it
    too, before anything it sends is unpickled."""
    deadline = time.monotonic() + timeout
    my_nonce = os.urandom(_NONCE)
    sock.sendall(MAGIC + my_nonce)
    reply = _recv_exact(sock, _NONCE + _DIGEST, deadline)
    controller_nonce, proof = reply[:_NONCE], reply[_NONCE:]
    if not hmac.compare_digest(proof, _proof(token, b"controller", my_nonce, controller_nonce)):
        raise AuthenticationFailed("the controller does not know the world's token")
    sock.sendall(_proof(token, b"worker", controller_nonce, my_nonce))
    sock.settimeout(None)


def worker_hello(conn: socket.socket, token: bytes) -> Optional[tuple[Any, Any]]:
    """Controller side: a new connection's first message, ``(kind, hello)``, once it has
    authenticated (:func:`accept_worker`) -- nothing is unpickled before -- or None, the
    connection closed, if it did not (a bad token, a timeout, a malformed hello)."""
    try:
        accept_worker(conn, token)
        conn.settimeout(HANDSHAKE_TIMEOUT)
        kind, hello = recv_msg(conn)
    except Exception:  # noqa: BLE001 - ChannelClosed, AuthenticationFailed, timeouts, a bad hello
        conn.close()
        return None
    return kind, hello


def read_messages(rank: int, conn: socket.socket, inbox: "queue.Queue[tuple[int, Any]]") -> None:
    """Put every message of an authenticated connection into ``inbox`` as ``(rank,
    message)``; at its end (EOF or error) ``(rank, ("eof", why))``."""
    try:
        while True:
            inbox.put((rank, recv_msg(conn)))
    except BaseException as exc:
        inbox.put((rank, ("eof", f"{type(exc).__name__}: {exc}")))
