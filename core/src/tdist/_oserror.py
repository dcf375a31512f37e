"""Saying which resource ran out when an ``OSError`` is a shortage: file descriptors
(``EMFILE``, ``ENFILE``) or disk space (``ENOSPC``, ``EDQUOT``, ``EFBIG``).

A process out of file descriptors cannot accept or open a socket, so its peers only see
a connection that never completes; :func:`note` keeps what this process ran out of, so
that a timeout it reports later can say so (:func:`noted`).
"""

from __future__ import annotations

import errno
import resource
import threading
import time
from typing import Optional

__all__ = ["describe", "out_of_descriptors", "out_of_space", "note", "noted"]

_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_noted: Optional[tuple[str, float]] = None  # what, and when (time.monotonic)
_lock = threading.Lock()


def out_of_descriptors(exc: BaseException) -> bool:
    """Whether ``exc`` says this process (EMFILE) or the system (ENFILE) has no file descriptor left."""
    return isinstance(exc, OSError) and exc.errno in _DESCRIPTORS


def out_of_space(exc: BaseException) -> bool:
    """Whether ``exc`` says a file cannot grow (ENOSPC, EDQUOT, EFBIG)."""
    return isinstance(exc, OSError) and exc.errno in _SPACE


def _descriptor_limit() -> str:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return "?"
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def describe(exc: OSError) -> str:
    """``EMFILE (Too many open files): ...what ran out and what to do``; the error's own
    text for an errno that is no shortage."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, "")
    text = exc.strerror or str(exc)
    head = f"{name} ({text})" if name else text
    if code == errno.EMFILE:
        return (
            f"{head}: this process has no file descriptor left (its limit, ulimit -n / RLIMIT_NOFILE, is "
            f"{_descriptor_limit()}): raise it"
        )
    if code == errno.ENFILE:
        return f"{head}: the system's table of open files is full (fs.file-max): close other programs or raise it"
    if code == errno.ENOSPC:
        return f"{head}: the file system is full"
    if code == errno.EDQUOT:
        return f"{head}: the disk quota is used up"
    if code == errno.EFBIG:
        return f"{head}: the file would exceed the file size limit (ulimit -f) or the file system's largest file"
    return head


def note(where: str, exc: OSError) -> None:
    """Remember that ``where`` (in this process) ran out of file descriptors."""
    global _noted
    with _lock:
        _noted = (f"{where}: {describe(exc)}", time.monotonic())


def noted() -> str:
    """What this process ran out of, and when (``"; meanwhile ..."``, to append to an
    error), or ``""``."""
    with _lock:
        if _noted is None:
            return ""
        what, when = _noted
    return f"; meanwhile, in this process, {what} (last {time.monotonic() - when:.0f} s ago)"
