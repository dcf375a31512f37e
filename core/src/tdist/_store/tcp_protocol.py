"""The wire protocol of :class:`TCPStore` (big-endian, no pickle).

Handshake (mutual authentication when a token is set):

1. client -> server: ``MAGIC | version (u8) | client nonce (32 bytes)``
2. server -> client: ``MAGIC | version | auth (u8) | server nonce (32)`` and, when ``auth``
   is 1, ``HMAC-SHA256(token, "tdist-store/server" | client nonce | server nonce)``: the server
   proves it knows the token before the client reveals anything.
3. with ``auth``: client -> server ``HMAC-SHA256(token, "tdist-store/client" | both nonces)``;
   the server answers ``ACK``, or ``NAK`` and hangs up (a hang-up without ``NAK``, a connection
   shed under load or past the handshake deadline, is worth retrying).

A server configured for TLS (:mod:`.tls`) expects a TLS handshake first and runs the above
inside TLS; to a client that sends a plaintext hello it answers ``auth`` = 2 (``TLS_REQUIRED``)
and hangs up, so the client can say why. A server out of file descriptors (``EMFILE``)
answers ``auth`` = 3 (``OUT_OF_DESCRIPTORS``) to the connections it cannot keep, through
a descriptor it holds in reserve for this, and hangs up. A client holding a token refuses
a server that does not authenticate (no downgrade) and a server whose proof is wrong; a
server with a token refuses a client whose proof is wrong.
Fresh nonces on both sides make every proof single-use.

Requests: ``command (u8) | argument count (u32) | per argument: length (u32), bytes``.
Timeouts travel as a float64 (seconds), counters as decimal ASCII. Replies:
``status (u8) | payload length (u32) | payload``; status is OK, TIMEOUT (payload: the keys
still missing, encoded as a list), ERROR (UTF-8 text) or EMPTY (a non-blocking queue pop).
Lists (``multi_get`` values, ``list_keys``) are encoded like request arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .base import MAX_TIMEOUT_S

__all__ = [
    "MAGIC",
    "VERSION",
    "NONCE_BYTES",
    "PROOF_BYTES",
    "ACK",
    "NAK",
    "TLS_REQUIRED",
    "OUT_OF_DESCRIPTORS",
    "TOKEN_ENV",
    "token_bytes",
    "server_proof",
    "client_proof",
    "encode_request",
    "encode_reply",
    "encode_list",
    "decode_list",
    "parse_request",
    "RequestScan",
    "timeout_arg",
    "ProtocolError",
    "MAX_ARG_BYTES",
    "MAX_ARGS",
    "MAX_REQUEST_BYTES",
    "NAMES",
]

TOKEN_ENV = "TDIST_STORE_TOKEN"
MAGIC = b"TDSTORE"
VERSION = 2
NONCE_BYTES = 32
PROOF_BYTES = 32
ACK = b"\x01"
TLS_REQUIRED = 2  # the ``auth`` byte of a TLS server's answer to a plaintext hello
OUT_OF_DESCRIPTORS = 3  # the ``auth`` byte of a server with no file descriptor to serve the connection
NAK = b"\x00"  # a wrong proof; a connection closed without it (shed under load) is worth retrying
CLIENT_HELLO_BYTES = len(MAGIC) + 1 + NONCE_BYTES
SERVER_HELLO_BYTES = len(MAGIC) + 2 + NONCE_BYTES  # + PROOF_BYTES when the server authenticates

MAX_ARG_BYTES = 64 << 20
MAX_ARGS = 1 << 16
MAX_REQUEST_BYTES = 256 << 20

(
    SET,
    GET,
    ADD,
    COMPARE_SET,
    WAIT,
    CHECK,
    DELETE,
    NUM_KEYS,
    PING,
    APPEND,
    MULTI_GET,
    MULTI_SET,
    QUEUE_PUSH,
    QUEUE_POP,
    QUEUE_LEN,
    LIST_KEYS,
    BARRIER,
) = range(1, 18)
NAMES: Dict[int, str] = dict(
    enumerate(
        "SET GET ADD COMPARE_SET WAIT CHECK DELETE NUM_KEYS PING APPEND MULTI_GET MULTI_SET QUEUE_PUSH QUEUE_POP "
        "QUEUE_LEN LIST_KEYS BARRIER".split(),
        1,
    )
)
#: (fewest, most) arguments of each command. Blocking commands start with a timeout argument.
ARITY: Dict[int, Tuple[int, int]] = {
    SET: (2, 2),
    GET: (2, 2),
    ADD: (2, 2),
    COMPARE_SET: (3, 3),
    WAIT: (2, MAX_ARGS),
    CHECK: (1, MAX_ARGS),
    DELETE: (1, 1),
    NUM_KEYS: (0, 0),
    PING: (0, 1),
    APPEND: (2, 2),
    MULTI_GET: (2, MAX_ARGS),
    MULTI_SET: (2, MAX_ARGS),
    QUEUE_PUSH: (2, 2),
    QUEUE_POP: (3, 3),
    QUEUE_LEN: (1, 1),
    LIST_KEYS: (0, 0),
    BARRIER: (3, 3),
}
OK, TIMEOUT, ERROR, EMPTY = 0, 1, 2, 3

U32 = struct.Struct("!I")
F64 = struct.Struct("!d")
HEAD = struct.Struct("!BI")  # request: command, argument count; reply: status, payload length


class ProtocolError(Exception):
    """The peer broke the protocol: its connection is closed."""


def token_bytes(token: Union[str, bytes, None]) -> bytes:
    """The shared secret: ``token``, else ``$TDIST_STORE_TOKEN``; empty means no authentication."""
    if token is None:
        token = os.environ.get(TOKEN_ENV, "")
    return token.encode() if isinstance(token, str) else bytes(token)


def server_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, b"tdist-store/server" + client_nonce + server_nonce, hashlib.sha256).digest()


def client_proof(token: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(token, b"tdist-store/client" + client_nonce + server_nonce, hashlib.sha256).digest()


def encode_list(items: Sequence[bytes]) -> bytes:
    parts = [U32.pack(len(items))]
    for item in items:
        parts += [U32.pack(len(item)), item]
    return b"".join(parts)


def decode_list(payload: bytes) -> List[bytes]:
    (count,), pos, out = U32.unpack_from(payload, 0), 4, []
    for _ in range(count):
        (size,) = U32.unpack_from(payload, pos)
        out.append(payload[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return out


def encode_request(cmd: int, args: Sequence[bytes]) -> bytes:
    parts = [HEAD.pack(cmd, len(args))]
    for arg in args:
        parts += [U32.pack(len(arg)), arg]
    return b"".join(parts)


def encode_reply(status: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(status, len(payload)) + payload


class RequestScan:
    """How far :func:`parse_request` got into a request not yet complete, so that the next
    call resumes there instead of walking it again from its start: a request trickled in
    small pieces costs O(its bytes) in all, not O(bytes x pieces). ``steps`` counts the
    headers read (the request's and its arguments') over the connection's life."""

    __slots__ = ("cmd", "count", "seen", "offset", "total", "steps")

    def __init__(self) -> None:
        self.cmd = self.count = self.seen = self.offset = self.total = self.steps = 0


def parse_request(
    buf: Union[bytes, bytearray, memoryview],
    pos: int,
    scan: Optional[RequestScan] = None,
    _head: Any = HEAD.unpack_from,
    _u32: Any = U32.unpack_from,
) -> Optional[Tuple[int, List[bytes], int]]:
    """The request at ``buf[pos:]`` as ``(command, arguments, end)``, None while incomplete;
    raises ProtocolError for an unknown command, a wrong arity or an argument over the limits.

    With ``scan``, an incomplete request's progress is kept there and the next call (the
    same request at ``buf[pos:]``, more bytes after it) resumes where this one stopped."""
    n = len(buf)
    if scan is not None and scan.offset:  # resume: the head and ``seen`` lengths were checked
        cmd, count, seen, p, total = scan.cmd, scan.count, scan.seen, pos + scan.offset, scan.total
        steps = 0
    else:
        if n - pos < 5:
            return None
        cmd, count = _head(buf, pos)
        arity = ARITY.get(cmd)
        if arity is None or not arity[0] <= count <= arity[1]:
            raise ProtocolError(f"command {cmd} with {count} arguments")
        seen, p, total, steps = 0, pos + 5, 0, 1
    # walk the lengths first (cheap); copy only once the whole request is there
    steps -= seen
    while seen < count:
        if n - p < 4:
            break
        (size,) = _u32(buf, p)
        total += size
        if size > MAX_ARG_BYTES or total > MAX_REQUEST_BYTES:
            raise ProtocolError(f"an argument of {size} bytes is over the limit")
        p += 4 + size
        seen += 1
    steps += seen
    if seen < count or p > n:
        if scan is not None:
            scan.cmd, scan.count, scan.seen, scan.offset, scan.total = cmd, count, seen, p - pos, total
            scan.steps += steps
        return None
    if scan is not None:
        scan.offset = 0
        scan.steps += steps
    args, p = [], pos + 5
    for _ in range(count):
        (size,) = _u32(buf, p)
        p += 4
        args.append(bytes(buf[p : p + size]))
        p += size
    return cmd, args, p


def timeout_arg(arg: bytes) -> float:
    """A timeout argument in seconds; NaN or negative is a protocol error, larger than
    anything waitable is clamped (the server never computes a deadline that overflows)."""
    if len(arg) != F64.size:
        raise ProtocolError("bad timeout argument")
    (value,) = F64.unpack(arg)
    if math.isnan(value) or value < 0:
        raise ProtocolError("bad timeout value")
    return min(value, MAX_TIMEOUT_S)
