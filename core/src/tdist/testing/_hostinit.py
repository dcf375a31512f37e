"""The first process of each host of a :class:`~tdist.testing.cluster.Cluster`, and the
helpers that find a network namespace's processes. Standard library only: it runs as
``python -S _hostinit.py`` inside the host, without importing tdist.

The process keeps the host's mount, UTS and IPC namespaces alive (commands join them
through its pid), prints ``ready``, then reads its stdin, a pipe from the cluster's
owner. At end of file (the cluster closes, or its owner died, however) it kills every
process in its network namespace, so nothing of the host outlives the cluster.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Iterable, Optional

__all__ = ["netns_inode", "processes_in_netns", "kill_netns"]


def netns_inode(pid: int) -> Optional[int]:
    """The network namespace of process ``pid`` (its inode), None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def processes_in_netns(inodes: Iterable[int], exclude: Iterable[int] = ()) -> list[int]:
    """The pids of the processes in the network namespaces ``inodes``, but ``exclude``."""
    wanted, skip = set(inodes), set(exclude) | {os.getpid()}
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in skip and netns_inode(int(entry)) in wanted:
            out.append(int(entry))
    return out


def kill_netns(inodes: Iterable[int], exclude: Iterable[int] = (), patience: float = 5.0) -> list[int]:
    """SIGKILL every process in the network namespaces ``inodes`` (but ``exclude``) until
    none is left or ``patience`` seconds have passed; return those still there."""
    inodes, exclude = list(inodes), list(exclude)
    deadline = time.monotonic() + patience
    while True:
        victims = processes_in_netns(inodes, exclude)
        if not victims or time.monotonic() > deadline:
            return victims
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def main() -> int:
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)  # only end of file ends the host
    me = os.getpid()
    net = netns_inode(me)
    print("ready", flush=True)
    try:
        while os.read(0, 4096):
            pass
    except OSError:
        pass
    if net is not None:
        kill_netns([net], exclude=[me])
    return 0


if __name__ == "__main__":
    sys.exit(main())
