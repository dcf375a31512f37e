"""Several jobs on one ``file://`` path (``group_name``), also after a job crashed.

The path holds one :class:`FileStore` that every job using it shares. Each run of a job
(a *generation* of its group name) keeps its keys apart, under
``tdist/jobs/<group>/<generation>/``. Beside it, ``<path>.tdist-lock`` (an empty file)
tells who is alive through fcntl locks, which the kernel drops when a process ends,
however it ends:

* byte 0: every process using the path holds a shared lock on it. The last one to leave
  is the one that can take it exclusively: it removes both files (the store only if the
  path still names the store file it used).
* byte 1 + slot: each process holds an exclusive lock on its own slot (a number from the
  store's counter) while it belongs to a generation.

A process joins its group's current generation, unless that generation already has all
its ranks (a job running or done) or a member whose slot is no longer locked (a process
that died): then it starts the next generation. So re-running a job, after it ended or
crashed, starts afresh, and concurrent jobs with different group names never meet.
"""

from __future__ import annotations

import fcntl
import os
import stat
import threading
from datetime import timedelta
from typing import Dict, Optional, Set

from .._errors import DistStoreTimeoutError
from .._store import FileStore
from .._store.base import Store
from .common import JobStore, Poll, peek
from .safe_files import check_path, open_regular, same_file

__all__ = ["join_file_job"]


class _Presence:
    """This process's descriptor of ``<path>.lock`` and what it holds there. One per path
    and process: closing any descriptor of a file drops all of the process's locks on it."""

    def __init__(self, lock_path: str, fd: int) -> None:
        self.lock_path = lock_path
        self.fd = fd
        self.users = 0
        self.slots: Set[int] = set()

    def try_lock(self, kind: int, byte: int) -> bool:
        try:
            fcntl.lockf(self.fd, kind | fcntl.LOCK_NB, 1, byte)
        except OSError:  # EACCES / EAGAIN: another process holds a conflicting lock
            return False
        return True

    def alive(self, slot: int) -> bool:
        """Whether the process that took ``slot`` still runs (still holds its lock)."""
        if slot in self.slots:
            return True
        if not self.try_lock(fcntl.LOCK_SH, 1 + slot):
            return True
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, 1 + slot)
        return False


_PRESENT: Dict[str, _Presence] = {}
_PRESENT_GUARD = threading.Lock()


def _enter(path: str, poll: Poll) -> _Presence:
    """Register this process as a user of ``path`` (shared lock on byte 0 of its lock file)."""
    lock_path = path + ".tdist-lock"
    with _PRESENT_GUARD:
        presence = _PRESENT.get(lock_path)
        if presence is None:
            presence = _Presence(lock_path, _locked_lock_file(lock_path, poll))
            _PRESENT[lock_path] = presence
        presence.users += 1
        return presence


def _locked_lock_file(lock_path: str, poll: Poll) -> int:
    while True:
        fd = open_regular(lock_path)
        if os.fstat(fd).st_size:
            os.close(fd)
            raise ValueError(
                f"file:// rendezvous: {lock_path} is not empty, so it is not tdist's lock file; "
                "refusing to use (and later remove) it"
            )
        probe = _Presence(lock_path, fd)
        while not probe.try_lock(fcntl.LOCK_SH, 0):  # the last user is removing the files
            if poll.expired():
                os.close(fd)
                raise DistStoreTimeoutError(f"file:// rendezvous: {lock_path} stayed locked")
            poll.sleep()
        if same_file(fd, lock_path):
            return fd
        os.close(fd)  # removed by the user that left last, before we locked it: open the new one


def _identity(path: str) -> Optional[tuple[int, int]]:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None


def _leave(presence: _Presence, slot: Optional[int], path: str, store_file: Optional[tuple[int, int]]) -> None:
    """Release ``slot``; if no process uses ``path`` any more, remove the lock file, and
    the store file if ``path`` still names ``store_file`` (the one this process used)."""
    with _PRESENT_GUARD:
        if slot is not None:
            presence.slots.discard(slot)
            fcntl.lockf(presence.fd, fcntl.LOCK_UN, 1, 1 + slot)
        presence.users -= 1
        if presence.users:
            return
        del _PRESENT[presence.lock_path]
        try:
            if presence.try_lock(fcntl.LOCK_EX, 0) and same_file(presence.fd, presence.lock_path):
                if store_file is not None and _identity(path) == store_file:
                    os.unlink(path)
                os.unlink(presence.lock_path)
        except FileNotFoundError:
            pass
        finally:
            os.close(presence.fd)


def _take_slot(presence: _Presence, store: Store) -> int:
    while True:
        slot = store.add("tdist/slots", 1)
        if presence.try_lock(fcntl.LOCK_EX, 1 + slot):
            presence.slots.add(slot)
            return slot


def _join_generation(
    store: Store, presence: _Presence, slot: int, group: str, rank: int, world_size: int, poll: Poll
) -> tuple[int, int]:
    """Claim ``rank`` (-1: the first free one) in the group's current generation, starting
    the next one when the current is full or lost a member; returns (generation, rank)."""
    base, me = f"tdist/jobs/{group}", str(slot).encode()
    while True:
        current = peek(store, f"{base}/generation")
        generation = int(current or b"0")
        members = {}
        for i in range(world_size):
            holder = peek(store, f"{base}/{generation}/member/{i}")
            if holder:
                members[i] = int(holder)
        dead = [i for i, s in members.items() if not presence.alive(s)]
        if dead or len(members) == world_size:  # a job that ran, runs, or lost a process: start the next
            store.compare_set(f"{base}/generation", current, str(generation + 1))
            continue
        wanted = [rank] if rank >= 0 else [i for i in range(world_size) if i not in members]
        for i in wanted:
            if store.compare_set(f"{base}/{generation}/member/{i}", b"", me) == me:
                return generation, i
        if rank >= 0 and rank in members:
            raise ValueError(
                f"file:// rendezvous: rank {rank} of group {group!r} is already taken by a running "
                "process of the job now gathering"
            )
        if poll.expired():
            raise DistStoreTimeoutError(f"file:// rendezvous: group {group!r}: no free rank within the timeout")
        poll.sleep()  # another process took the rank first: look again


def join_file_job(path: str, group: str, rank: int, world_size: int, timeout: float) -> tuple[Store, int]:
    """This process's store and rank in job ``group`` at ``path`` (see the module doc)."""
    check_path(path)  # before creating anything beside it
    poll = Poll(timeout)
    presence = _enter(path, poll)
    slot: Optional[int] = None
    store: Optional[FileStore] = None
    store_file: Optional[tuple[int, int]] = None  # known to be a store file: one this process used
    try:
        fd = open_regular(path)
        try:
            store = FileStore(path, -1, timeout=timedelta(seconds=timeout))
            if not same_file(fd, path):
                raise ValueError(f"file:// rendezvous: {path} was replaced while it was being opened")
            slot = _take_slot(presence, store)
            store_file = _identity(path) if same_file(fd, path) else None
        finally:
            os.close(fd)
        generation, rank = _join_generation(store, presence, slot, group, rank, world_size, poll)
    except BaseException:
        if store is not None:
            store.close()
        _leave(presence, slot, path, store_file)
        raise
    prefix = f"tdist/jobs/{group}/{generation}"
    return JobStore(prefix, store, on_close=[lambda: _leave(presence, slot, path, store_file)]), rank
