"""The store server's file-descriptor budget: the open-file limit, the listen backlog, the handshake cap.

A server holding thousands of client connections needs a descriptor per connection:
:func:`raise_descriptor_limit` lifts this process's soft ``RLIMIT_NOFILE`` to its hard limit
(what an unprivileged process may do) when a server starts, and says once, as a warning,
when it cannot.
"""

from __future__ import annotations

import logging
import resource
import threading
from typing import Tuple

__all__ = ["LISTEN_BACKLOG", "raise_descriptor_limit", "descriptor_limit", "default_max_pending"]

log = logging.getLogger(__name__)

#: the listen backlog asked for: the kernel caps it (Linux: net.core.somaxconn, 4096 by default
#: since 5.4), so that a burst of thousands of connects queues instead of being refused
LISTEN_BACKLOG = 65535
_NR_OPEN = "/proc/sys/fs/nr_open"
_lock = threading.Lock()
_told = False


def descriptor_limit() -> int:
    """This process's soft open-file limit (``1 << 20`` standing for unlimited)."""
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (OSError, ValueError):
        return 1024
    return 1 << 20 if soft == resource.RLIM_INFINITY else int(soft)


def _ceiling(hard: int) -> int:
    """The highest soft limit worth asking for: the hard limit, or when that is unlimited the
    kernel's per-process maximum (Linux refuses RLIM_INFINITY above ``fs.nr_open``)."""
    if hard != resource.RLIM_INFINITY:
        return hard
    try:
        with open(_NR_OPEN) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def raise_descriptor_limit() -> Tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return ``(soft, hard)`` afterwards.

    Never lowers it; idempotent and thread-safe. When the limit cannot be raised (the
    platform refuses), logs one warning naming the limit, how many connections it leaves,
    and what to do, and goes on with the old limit.
    """
    global _told
    with _lock:
        try:
            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (OSError, ValueError):
            return descriptor_limit(), descriptor_limit()
        if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
            return soft, hard
        target = _ceiling(hard)
        if target <= soft:
            return soft, hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target, hard
        except (OSError, ValueError) as exc:
            if not _told:
                _told = True
                log.warning(
                    "tdist store server: cannot raise the open-file limit (RLIMIT_NOFILE) from %d to %d: %s; "
                    "the server holds at most about %d client connections at once: raise it (ulimit -n) in the "
                    "process that hosts the store",
                    soft,
                    target,
                    exc,
                    max(0, soft - 64),
                )
            return soft, hard


def default_max_pending() -> int:
    """Connections allowed to be mid-handshake at once: a quarter of the descriptor limit, 16..4096.

    The cap bounds what unauthenticated connections can hold; thousands of ranks connecting
    at once each need a place while their handshake is in flight (a shed one retries).
    """
    return max(16, min(4096, descriptor_limit() // 4))
