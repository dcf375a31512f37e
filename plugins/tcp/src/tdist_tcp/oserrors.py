"""Naming a shortage of file descriptors (``EMFILE``, ``ENFILE``) in the tcp backend's
errors: a rank that cannot open or accept a socket, or map shared memory, for want of
descriptors says so, instead of its peers timing out in silence."""

from __future__ import annotations

import errno
import resource
from typing import Optional

__all__ = ["out_of_descriptors"]


def out_of_descriptors(exc: BaseException) -> Optional[str]:
    """What ran out, and what to do, when ``exc`` is EMFILE or ENFILE; None otherwise."""
    if not isinstance(exc, OSError):
        return None
    if exc.errno == errno.EMFILE:
        try:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
        except (OSError, ValueError):
            limit = "?"
        return (
            f"EMFILE (Too many open files): this process has no file descriptor left (its limit, ulimit -n / "
            f"RLIMIT_NOFILE, is {limit}; each rank needs about one per peer and stream): raise it"
        )
    if exc.errno == errno.ENFILE:
        return (
            "ENFILE (Too many open files in system): the system's table of open files is full "
            "(fs.file-max): close other programs or raise it"
        )
    return None
