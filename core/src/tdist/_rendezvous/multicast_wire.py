"""The datagrams of the multicast ``tcp://`` rendezvous (big-endian, fixed layout, no pickle).

Every datagram: ``MAGIC | version (u8) | kind (u8) | authenticated (u8) | job tag (16) |
sender (16) | world size (u32) | rank (i32) | recipient (16) | port (u16) | source address (16) |
source port (u16) | text length (u8) | text`` and, when authenticated, ``HMAC-SHA256(key,
everything before)``, where ``key`` is derived from the token for this purpose alone
(``HMAC-SHA256(token, LABEL)``): no MAC a datagram carries can stand in for a proof in the
store's handshake.

The source address and port are where the sender's datagrams come from, as the group sees
them (an IPv4 address as IPv4-mapped IPv6), learned from its own first datagram (port 0
until then): covered by the MAC, and checked against the address and port each datagram
arrives from (:func:`source_of`), so a captured datagram replayed from anywhere else is
dropped, however well it is authenticated.

- ``ANNOUNCE``: a process looking for its job; ``rank`` is its given rank (-1: none), ``text``
  its host name (for error messages); ``recipient`` and ``port`` are zero.
- ``OFFER``: the process hosting the job's store tells ``recipient`` its ``rank`` and where
  the store is (``text``: the host's address, ``port``).

The job tag is a digest of the group name: datagrams of other groups sharing the address are
dropped before anything else is read. Process ids are 16 random bytes, fresh for every
rendezvous, so an OFFER can only be meant for the process it names. With a token
(``$TDIST_STORE_TOKEN``), a datagram without a valid MAC is rejected: an outsider can neither
take part in the election nor point a process at another store.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import ipaddress
import struct
from dataclasses import dataclass
from typing import Union

__all__ = ["ANNOUNCE", "OFFER", "ID_BYTES", "Datagram", "Rejected", "job_tag", "pack", "unpack", "source_of"]

MAGIC = b"TDMC"
VERSION = 2  # 2: the source address and port
ANNOUNCE, OFFER = 1, 2
ID_BYTES = 16
MAC_BYTES = 32
_LABEL = b"tdist multicast rendezvous key v1\0"
_HEAD = struct.Struct(f"!4sBBB{ID_BYTES}s{ID_BYTES}sIi{ID_BYTES}sH16sHB")
MAX_TEXT = 255


class Rejected(enum.Enum):
    """Why a datagram of this job was dropped (counted for the timeout message)."""

    MALFORMED = "malformed"
    BAD_MAC = "failed authentication (another token)"
    UNAUTHENTICATED = "carried no authentication while this process has a token"
    UNEXPECTED_MAC = "were authenticated while this process has no TDIST_STORE_TOKEN"
    WRONG_SOURCE = "came from another address or port than they name (replayed?)"


@dataclass(frozen=True)
class Datagram:
    kind: int
    sender: bytes
    world_size: int
    rank: int
    recipient: bytes = bytes(ID_BYTES)
    port: int = 0
    text: str = ""
    source: bytes = bytes(16)  # where the sender's datagrams come from (see the module doc)
    source_port: int = 0  # 0: the sender does not know yet


def source_of(address: tuple) -> tuple[bytes, int]:
    """``(source, source_port)`` as a datagram names them, of ``recvfrom``'s address."""
    parsed = ipaddress.ip_address(str(address[0]).partition("%")[0])
    if parsed.version == 4:
        return bytes(10) + b"\xff\xff" + parsed.packed, int(address[1])
    return parsed.packed, int(address[1])


def job_tag(group_name: str) -> bytes:
    """The 16 bytes that mark a datagram as one of job ``group_name``'s."""
    return hashlib.sha256(b"tdist-multicast-group\0" + group_name.encode()).digest()[:ID_BYTES]


def _mac(token: bytes, body: bytes) -> bytes:
    key = hmac.new(token, _LABEL, hashlib.sha256).digest()
    return hmac.new(key, body, hashlib.sha256).digest()


def pack(datagram: Datagram, tag: bytes, token: bytes) -> bytes:
    """The bytes of ``datagram`` for job ``tag``, authenticated when ``token`` is not empty."""
    text = datagram.text.encode()[:MAX_TEXT]
    body = (
        _HEAD.pack(
            MAGIC,
            VERSION,
            datagram.kind,
            1 if token else 0,
            tag,
            datagram.sender,
            datagram.world_size,
            datagram.rank,
            datagram.recipient,
            datagram.port,
            datagram.source,
            datagram.source_port,
            len(text),
        )
        + text
    )
    return body + _mac(token, body) if token else body


def unpack(data: bytes, tag: bytes, token: bytes) -> Union[Datagram, Rejected, None]:
    """The datagram in ``data``; None when it is not one of job ``tag``'s (another program,
    another group, another protocol version); a :class:`Rejected` reason when it claims to be
    but cannot be trusted or read."""
    if len(data) < _HEAD.size or data[:4] != MAGIC or data[4] != VERSION:
        return None
    (
        magic,
        version,
        kind,
        authenticated,
        their_tag,
        sender,
        world_size,
        rank,
        recipient,
        port,
        source,
        source_port,
        size,
    ) = _HEAD.unpack_from(data)
    if their_tag != tag:
        return None
    body_end = _HEAD.size + size
    if len(data) != body_end + (MAC_BYTES if authenticated else 0):
        return Rejected.MALFORMED
    if token and not authenticated:
        return Rejected.UNAUTHENTICATED
    if authenticated and not token:
        return Rejected.UNEXPECTED_MAC
    if token and not hmac.compare_digest(data[body_end:], _mac(token, data[:body_end])):
        return Rejected.BAD_MAC
    if kind not in (ANNOUNCE, OFFER) or world_size < 1 or rank < -1 or rank >= world_size:
        return Rejected.MALFORMED
    try:
        text = data[_HEAD.size : body_end].decode()
    except UnicodeDecodeError:
        return Rejected.MALFORMED
    return Datagram(kind, sender, world_size, rank, recipient, port, text, source, source_port)
