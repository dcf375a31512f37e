"""The control channel between a :class:`~tdist.testing.World` and its workers.

Frames are an 8-byte big-endian length followed by a pickle. The channel uses
pickle on purpose: it is a test harness talking to processes it started itself on
127.0.0.1, never a network service, and results/exceptions are arbitrary Python
objects. Tensors under test never travel through it (bodies return small values).
"""

from __future__ import annotations

import pickle
import socket
import struct
from typing import Any

__all__ = ["send_msg", "recv_msg", "ChannelClosed"]

_HEADER = struct.Struct(">Q")
_MAX_FRAME = 256 * 1024 * 1024


class ChannelClosed(ConnectionError):
    """The other end of the control channel went away."""


def send_msg(sock: socket.socket, obj: Any) -> None:
    """Send one pickled frame."""
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise ChannelClosed("control channel closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv_msg(sock: socket.socket) -> Any:
    """Receive one frame (blocking); raise :class:`ChannelClosed` at EOF."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if length > _MAX_FRAME:
        raise ChannelClosed(f"control frame of {length} bytes is too large")
    return pickle.loads(_recv_exact(sock, length))
