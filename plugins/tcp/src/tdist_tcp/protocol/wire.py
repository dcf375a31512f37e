"""The tcp backend's wire format: frame headers, handshake, dtype and operation codes,
and zero-copy byte views of tensors.

Every message is one *frame*: a fixed :data:`HEADER` followed by ``ndim`` int64
shape entries and ``nbytes`` raw bytes (a tensor's memory as it is, never pickle).

Header fields (little endian): magic, kind (:data:`COLL`, :data:`P2P`, :data:`ABORT`,
:data:`BYE`, :data:`PROBE`, :data:`STATE`, :data:`MARK`), operation code, reduce-op code, dtype code, ndim, tag (P2P), sequence
number (the group's collective counter, or the per-pair P2P counter) and payload size.
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any, Optional

from tdist.plugin import OPERATION_CODES

if TYPE_CHECKING:
    import torch

__all__ = [
    "FRAME_MAGIC",
    "HEADER",
    "HELLO_MAGIC",
    "PROTOCOL_VERSION",
    "COLL",
    "P2P",
    "ABORT",
    "BYE",
    "PROBE",
    "STATE",
    "MARK",
    "KIND_NAMES",
    "OP_NAMES",
    "OP_CODES",
    "OP_ACK",
    "PART_FOLD",
    "PART_UNFOLD",
    "REDOP_NAMES",
    "redop_code",
    "dtype_code",
    "dtype_name",
    "pack_header",
    "byte_view",
    "describe",
    "part_name",
]

PROTOCOL_VERSION = 3  # 2: mutually authenticated handshake (tdist_tcp.protocol.auth); 3: streams in its flags
FRAME_MAGIC = 0x46544454  # b"TDTF" little endian
#: magic, kind, op, redop, dtype, ndim, (3 pad), tag (P2P tag; for collectives the
#: algorithm's part number: step << 32 | segment), seq, nbytes
HEADER = struct.Struct("<IBBBBB3xqqQ")
HELLO_MAGIC = b"TDISTTCP"  # starts every connection's handshake (tdist_tcp.protocol.auth.HELLO)

#: ABORT's payload is JSON: {"reason": str, "timeout": bool, "missing": [group ranks]};
#: PROBE asks a peer which collective it has reached (``seq``: the probe's number) and
#: STATE answers it (``seq``: that number, ``tag``: the collectives it has issued);
#: MARK starts a new epoch of the link (``seq``: the epoch): the frames after it belong
#: to the group the link was handed to by ``shrink_group`` (see :mod:`tdist_tcp.regroup`)
COLL, P2P, ABORT, BYE, PROBE, STATE, MARK = 1, 2, 3, 4, 5, 6, 7
KIND_NAMES = {
    COLL: "collective",
    P2P: "p2p",
    ABORT: "abort",
    BYE: "bye",
    PROBE: "probe",
    STATE: "state",
    MARK: "epoch mark",
}

#: an operation's code on the wire: tdist's (``OPERATION_CODES``), and one more for "ack"
OP_CODES = {**OPERATION_CODES, "ack": max(OPERATION_CODES.values()) + 1}
OP_NAMES = {code: name for name, code in OP_CODES.items()}
#: the empty frame a receiver returns to a rank that would otherwise only send
#: (broadcast/scatter roots, reduce/gather senders), so every rank of a collective
#: learns that its peers agreed on what it was
OP_ACK = OP_CODES["ack"]
#: part numbers of the extra ranks' fold into, and unfold from, recursive doubling
PART_FOLD, PART_UNFOLD = 1 << 62, (1 << 62) + 1

REDOP_NAMES = ("", "SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM")
_REDOP_CODES = {name: code for code, name in enumerate(REDOP_NAMES)}


_redop_by_member: dict = {}


def redop_code(reduction: Any) -> int:
    """The wire code of a :class:`tdist.Reduction` (0 for none)."""
    if reduction is None:
        return 0
    member = reduction.op
    code = _redop_by_member.get(id(member))  # enum members: singletons, slow to hash and to name
    if code is None:
        code = _redop_by_member[id(member)] = _REDOP_CODES.get(member.name, 0)
    return code


# Every torch dtype the wire knows by name; unknown ones travel as code 255 (bytes
# still move, but a mismatch between two unknown dtypes cannot be detected).
_DTYPE_NAMES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "complex64",
    "complex128",
    "complex32",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "bits8",
    "bits16",
    "bits1x8",
    "bits2x4",
    "bits4x2",
)
_dtype_codes: Optional[dict] = None
_dtype_by_code: dict[int, str] = {0: "-", 255: "unknown dtype"}


def _init_dtypes() -> dict:
    global _dtype_codes
    import torch

    codes = {}
    for index, name in enumerate(_DTYPE_NAMES, start=1):
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            codes[dtype] = index
            _dtype_by_code[index] = name
    _dtype_codes = codes
    return codes


def dtype_code(dtype: "torch.dtype") -> int:
    """The wire code of ``dtype`` (255 if this table does not know it)."""
    codes = _dtype_codes if _dtype_codes is not None else _init_dtypes()
    return codes.get(dtype, 255)


def dtype_name(code: int) -> str:
    if _dtype_codes is None:
        _init_dtypes()
    return _dtype_by_code.get(code, f"dtype#{code}")


def pack_header(
    kind: int, op: int, redop: int, dtype: int, tag: int, seq: int, nbytes: int, shape: tuple = ()
) -> bytes:
    """One frame header; ``shape`` is informational (receivers check sizes, not shapes)."""
    ndim = len(shape)
    if ndim > 64:  # keep frames small; only the element count matters
        shape, ndim = (nbytes,), 1
    head = HEADER.pack(FRAME_MAGIC, kind, op, redop, dtype, ndim, tag, seq, nbytes)
    if ndim:
        return head + struct.pack(f"<{ndim}q", *shape)
    return head


_EMPTY = memoryview(bytearray(0))
_array_types: dict[int, Any] = {}


def byte_view(flat: "torch.Tensor") -> memoryview:
    """A writable uint8 memoryview of a contiguous tensor's memory (every dtype, zero copy).

    The view keeps the tensor alive. ``flat`` must be contiguous and must not be a
    conjugate or negative view (resolve those first); CPU tensors only.
    """
    nbytes = flat.nbytes
    if nbytes == 0:
        return _EMPTY
    array_type = _array_types.get(nbytes)
    if array_type is None:
        if len(_array_types) > 4096:
            _array_types.clear()
        array_type = _array_types[nbytes] = ctypes.c_ubyte * nbytes
    array: Any = array_type.from_address(flat.data_ptr())
    array.tensor = flat  # the memoryview keeps the array alive, the array the tensor
    return memoryview(array).cast("B")


def part_name(part: int) -> str:
    """An algorithm's part number in words: ``step 1 part 3``, ``fold``, ``unfold``."""
    if part in (PART_FOLD, PART_UNFOLD):
        return "fold" if part == PART_FOLD else "unfold"
    return f"step {part >> 32} part {part & 0xFFFFFFFF}"


def describe(
    op: int, redop: int, seq: int, dtype: int, nbytes: int, kind: int = COLL, tag: int = 0, part: int = 0
) -> str:
    """Human-readable frame identity, e.g. ``all_reduce(SUM)#7 float32 x 16 bytes``
    (``all_reduce(SUM)#7[1.3] ...`` for part 3 of step 1 of an algorithm)."""
    if kind == P2P:
        return f"p2p message (tag {tag}) {dtype_name(dtype)} x {nbytes} bytes"
    if kind != COLL:
        return f"{KIND_NAMES.get(kind, f'kind {kind}')} frame"
    where = f"[{part_name(part)}]" if part else ""
    if op == OP_ACK:
        return f"acknowledgement#{seq}{where} (of this rank's frames)"
    name = OP_NAMES.get(op, f"op#{op}")
    if redop:
        name += f"({REDOP_NAMES[redop] if redop < len(REDOP_NAMES) else redop})"
    return f"{name}#{seq}{where} {dtype_name(dtype)} x {nbytes} bytes"
