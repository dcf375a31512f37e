"""Mutual authentication of the mesh's connections and of the shared-memory segment.

Keys. The factory receives ``secret`` from the core (a key derived from the job's
store token; empty without one). A group's key is
``HMAC-SHA256(secret, "tdist-tcp group key v2" || group nonce)``, the group nonce
being the 16 random bytes rank 0 publishes as ``tcp/nonce`` when the group is
created, so every group, and every re-creation of one, has its own key.

Handshake on every connection (TCP and Unix-domain alike), connector C to acceptor A:

1. C -> A: ``HELLO`` (magic, protocol version, group nonce, C's rank, world size,
   flags — the token bit, and which of how many parallel streams of the pair this
   connection is —, 16 fresh random bytes ``nc``);
2. A -> C: A's ``HELLO`` (with its own fresh ``na``) and
   ``HMAC(group key, "A" || hello_C || hello_A)``;
3. C -> A: ``HMAC(group key, "C" || hello_C || hello_A)``;
4. A -> C: one byte, :data:`ACCEPTED`, :data:`REFUSED` or :data:`DUPLICATE` (the proof is
   good but A keeps the connection it is opening to C itself: A is the lower rank, see
   :mod:`tdist_tcp.net.transport`; C then waits for that one).

Each side proves it knows the group key over the other side's fresh nonce, so a
recorded handshake cannot be replayed and neither side can be impersonated by
someone who only read the store (which holds the nonce and the addresses, never a
key). Without a token the same exchange runs with an empty key: it then checks the
protocol and the group, and proves nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from typing import NamedTuple, Optional

from .wire import HELLO_MAGIC, PROTOCOL_VERSION

__all__ = [
    "Hello",
    "HELLO",
    "MAC_SIZE",
    "ACCEPTED",
    "REFUSED",
    "DUPLICATE",
    "FLAG_TOKEN",
    "MAX_STREAMS",
    "group_key",
    "mac",
    "make_hello",
    "parse_hello",
]

#: magic, protocol version, group nonce, sender's group rank, world size, flags, connection nonce
HELLO = struct.Struct("<8sI16sIII16s")
MAC_SIZE = 32
ACCEPTED, REFUSED, DUPLICATE = b"\x01", b"\x00", b"\x02"
#: set in a HELLO's flags by a rank that holds a token (only used to explain a refusal)
FLAG_TOKEN = 1
#: the most connections (streams) one pair of ranks may use
MAX_STREAMS = 64
_STREAM_SHIFT, _STREAMS_SHIFT = 8, 16

_GROUP_LABEL = b"tdist-tcp group key v2\0"


class Hello(NamedTuple):
    nonce: bytes  # the group's
    rank: int
    size: int
    flags: int
    conn_nonce: bytes
    stream: int = 0  # this connection's index among the pair's streams
    streams: int = 1  # how many connections the pair uses


def group_key(secret: bytes, group_nonce: bytes) -> bytes:
    """The key of one group (every connection and the shared segment are proved with it)."""
    return hmac.new(secret, _GROUP_LABEL + group_nonce, hashlib.sha256).digest()


def make_hello(group_nonce: bytes, rank: int, size: int, has_token: bool, stream: int = 0, streams: int = 1) -> bytes:
    """The HELLO of connection ``stream`` of the ``streams`` a connector opens to one peer."""
    flags = (FLAG_TOKEN if has_token else 0) | stream << _STREAM_SHIFT | streams << _STREAMS_SHIFT
    return HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, group_nonce, rank, size, flags, os.urandom(16))


def parse_hello(data: bytes, group_nonce: bytes, size: int) -> Optional[Hello]:
    """``data`` as a HELLO of this group (protocol, nonce and world size checked), else None."""
    if len(data) != HELLO.size:
        return None
    magic, version, nonce, rank, their_size, flags, conn_nonce = HELLO.unpack(data)
    if (
        magic != HELLO_MAGIC
        or version != PROTOCOL_VERSION
        or nonce != group_nonce
        or their_size != size
        or not 0 <= rank < size
    ):
        return None
    stream, streams = flags >> _STREAM_SHIFT & 0xFF, flags >> _STREAMS_SHIFT & 0xFF
    if not 0 <= stream < streams <= MAX_STREAMS:
        return None
    return Hello(nonce, rank, their_size, flags, conn_nonce, stream, streams)


def mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    """``HMAC(key, role || parts...)``; ``role`` is b"A" (acceptor), b"C" (connector) or b"S" (segment)."""
    h = hmac.new(key, role, hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.digest()


def token_mismatch_hint(mine: bool, theirs_flags: int) -> str:
    """Why two ranks' proofs may differ, from the flags the other one sent (unauthenticated: a hint)."""
    theirs = bool(theirs_flags & FLAG_TOKEN)
    if mine and not theirs:
        return "this rank has a token and that one says it has none"
    if theirs and not mine:
        return "that rank says it has a token and this one has none"
    return "the ranks hold different tokens" if mine else "a corrupted exchange"
