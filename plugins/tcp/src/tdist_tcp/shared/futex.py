"""``futex(2)`` through libc's ``syscall`` (Linux x86-64): sleep while a uint32 in shared
memory holds a value, and wake its sleepers. Both release the GIL."""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["futex_wait", "futex_wake"]

_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall: Any = None


def _libc_syscall() -> Any:
    global _syscall
    if _syscall is None:
        fn = ctypes.CDLL(None, use_errno=True).syscall
        fn.restype = ctypes.c_long
        fn.argtypes = [
            ctypes.c_long,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_uint32,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        ]
        _syscall = fn
    return _syscall


def futex_wait(addr: int, value: int, seconds: float) -> None:
    """Sleep while the uint32 at ``addr`` holds ``value`` (at most ``seconds``; the GIL is released)."""
    seconds = max(seconds, 0.0)
    ts = _Timespec(int(seconds), int((seconds % 1.0) * 1e9))
    _libc_syscall()(_SYS_FUTEX, addr, _FUTEX_WAIT, value, ctypes.addressof(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every thread sleeping on the uint32 at ``addr``."""
    _libc_syscall()(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
