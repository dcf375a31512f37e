"""NCCL communicators: loading ``cupy.cuda.nccl``, the unique id and its store encoding,
and creating one communicator (one device) or a clique of them (several local devices).

The unique id is held, and travels through the tdist store, as exactly 128 bytes -- no
pickle. CuPy's own form of it changed: since CuPy 14 ``get_unique_id()`` returns those
128 ``bytes`` and ``NcclCommunicator`` takes them; before, both used a tuple of 128
``char`` values, signed where ``char`` is signed (x86) and unsigned where it is not
(ARM, POWER). :func:`new_communicator` offers the bytes first and falls back to the
signed, then the unsigned tuple when CuPy refuses a form (a ``TypeError`` or
``OverflowError`` while converting the argument, before NCCL is called).
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


def encode_unique_id(uid: bytes | Sequence[int]) -> bytes:
    """An NCCL unique id as 128 bytes, from CuPy's bytes or tuple of 128 ``char`` values."""
    if isinstance(uid, (bytes, bytearray)):
        uid = bytes(uid)
        if len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
        return uid
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {UNIQUE_ID_BYTES} values, got {len(uid)}")
    for value in uid:
        if not isinstance(value, int) or not -128 <= value <= 255:
            raise ValueError(f"an NCCL unique id holds char values (-128..255), got {value!r}")
    return bytes(value & 0xFF for value in uid)


def decode_unique_id(data: bytes, signed: bool = True) -> tuple[int, ...]:
    """The tuple of ``char`` values CuPy before 14 takes, from the id's 128 bytes."""
    data = bytes(data)
    if len(data) != UNIQUE_ID_BYTES:
        raise DistBackendError(f"nccl backend: the NCCL unique id has {len(data)} bytes, expected {UNIQUE_ID_BYTES}")
    if not signed:
        return tuple(data)
    return tuple(b - 256 if b > 127 else b for b in data)


def share_unique_id(nccl: Any, store: Any, key: str, rank: int, timeout: timedelta) -> bytes:
    """Rank 0 creates a unique id and sets ``key``; every other rank waits for it.
    Returns the id's 128 bytes."""
    if rank == 0:
        uid = encode_unique_id(nccl.get_unique_id())
        store.set(key, uid)
        return uid
    data = bytes(store.get(key, timeout=timeout))
    decode_unique_id(data)  # a length check with the backend's error
    return data


def new_communicator(
    nccl: Any, size: int, uid: bytes, rank: int, device_guard: Callable[[], ContextManager[Any]]
) -> Any:
    """``NcclCommunicator(size, uid, rank)`` created with ``device_guard()`` entered (its device),
    the id in the first form this CuPy takes (see the module docstring).

    Blocks until all ``size`` ranks have joined (unless called inside groupStart/groupEnd).
    """
    forms = (bytes(uid), decode_unique_id(uid, signed=True), decode_unique_id(uid, signed=False))
    with device_guard():
        for form in forms[:-1]:
            try:
                return nccl.NcclCommunicator(size, form, rank)
            except (TypeError, OverflowError):  # CuPy converts the id before calling NCCL
                continue
        return nccl.NcclCommunicator(size, forms[-1], rank)


def new_clique(
    nccl: Any,
    total: int,
    uid: bytes,
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
