"""NCCL communicators: loading ``cupy.cuda.nccl``, the unique id and its store encoding,
and creating one communicator (one device) or a clique of them (several local devices).

The unique id travels through the tdist store as exactly 128 bytes (each of the id's
128 ``char`` values modulo 256) -- no pickle. ``get_unique_id()`` returns signed values
where ``char`` is signed (x86) and unsigned ones where it is not (ARM, POWER), so
decoding yields signed values and :func:`new_communicator` retries with unsigned ones
if CuPy refuses them.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, ContextManager, Sequence

from tdist import DistBackendError

from . import INSTALL_HINT

__all__ = [
    "UNIQUE_ID_BYTES",
    "decode_unique_id",
    "encode_unique_id",
    "load_nccl",
    "nccl_version",
    "new_clique",
    "new_communicator",
    "share_unique_id",
    "version_string",
]

UNIQUE_ID_BYTES = 128


def load_nccl() -> Any:
    """Import ``cupy.cuda.nccl``; a clear :class:`DistBackendError` when CuPy or NCCL is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise DistBackendError(f"nccl backend: cannot import cupy.cuda.nccl ({exc}): {INSTALL_HINT}") from exc
    except Exception as exc:  # CuPy built for another CUDA, driver problems, ...
        raise DistBackendError(f"nccl backend: importing CuPy failed: {type(exc).__name__}: {exc}") from exc
    if not getattr(nccl, "available", True) or not hasattr(nccl, "NcclCommunicator"):
        raise DistBackendError(
            "nccl backend: CuPy is installed but cannot load the NCCL library; install it with "
            "`pip install nvidia-nccl-cu12` (or -cu13) or `python -m cupyx.tools.install_library --library nccl`"
        )
    return nccl


def nccl_version(nccl: Any) -> int:
    """NCCL's runtime version code (2.18.3 -> 21803); 0 when NCCL cannot say (before 2.3.4)."""
    try:
        return int(nccl.get_version())
    except Exception:
        return 0


def version_string(code: int) -> str:
    """``21803`` -> ``"2.18.3"`` (codes before 2.9 use ``X*1000 + Y*100 + Z``)."""
    if code <= 0:
        return "unknown"
    if code < 10000:
        return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"
    return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"


def encode_unique_id(uid: Sequence[int]) -> bytes:
    """The 128 ``char`` values of an NCCL unique id as 128 bytes."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} values, got {len(uid)}")
    for value in uid:
        if not isinstance(value, int) or not -128 <= value <= 255:
            raise ValueError(f"an NCCL unique id holds char values (-128..255), got {value!r}")
    return bytes(value & 0xFF for value in uid)


def decode_unique_id(data: bytes, signed: bool = True) -> tuple[int, ...]:
    """The id tuple ``NcclCommunicator`` takes, from :func:`encode_unique_id`'s bytes."""
    data = bytes(data)
    if len(data) != UNIQUE_ID_BYTES:
        raise DistBackendError(
            f"nccl backend: the NCCL unique id in the store has {len(data)} bytes, expected {UNIQUE_ID_BYTES}"
        )
    if not signed:
        return tuple(data)
    return tuple(b - 256 if b > 127 else b for b in data)


def share_unique_id(nccl: Any, store: Any, key: str, rank: int, timeout: timedelta) -> tuple[int, ...]:
    """Rank 0 creates a unique id and sets ``key``; every other rank waits for it."""
    if rank == 0:
        uid = tuple(nccl.get_unique_id())
        store.set(key, encode_unique_id(uid))
        return uid
    return decode_unique_id(store.get(key, timeout=timeout))


def _unsigned(uid: Sequence[int]) -> tuple[int, ...]:
    return tuple(v & 0xFF for v in uid)


def new_communicator(
    nccl: Any, size: int, uid: Sequence[int], rank: int, device_guard: Callable[[], ContextManager[Any]]
) -> Any:
    """``NcclCommunicator(size, uid, rank)`` created with ``device_guard()`` entered (its device).

    Blocks until all ``size`` ranks have joined (unless called inside groupStart/groupEnd).
    """
    with device_guard():
        try:
            return nccl.NcclCommunicator(size, tuple(uid), rank)
        except OverflowError:  # this platform's char is unsigned
            return nccl.NcclCommunicator(size, _unsigned(uid), rank)


def new_clique(
    nccl: Any,
    total: int,
    uid: Sequence[int],
    first_rank: int,
    guards: Sequence[Callable[[], ContextManager[Any]]],
) -> list[Any]:
    """One communicator per local device: NCCL ranks ``first_rank .. first_rank + len(guards) - 1``
    of a clique of ``total``, initialised together between groupStart and groupEnd."""
    comms: list[Any] = []
    nccl.groupStart()
    try:
        for d, guard in enumerate(guards):
            comms.append(new_communicator(nccl, total, uid, first_rank + d, guard))
    finally:
        nccl.groupEnd()
    return comms


def destroy_all(comms: Sequence[Any]) -> None:
    """Destroy communicators, ignoring ones already gone."""
    for comm in comms:
        with contextlib.suppress(Exception):
            comm.destroy()
