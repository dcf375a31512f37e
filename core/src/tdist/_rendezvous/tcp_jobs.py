"""Several jobs on one ``tcp://host:port`` (``group_name``): the address is a directory,
each job has its own store.

The first process able to bind ``host:port`` serves a small TCPStore there, the
directory; the other processes connect to it. A job's first process (rank 0, or the first
to arrive when ranks are assigned) starts the job's own TCPStore on a free port and
publishes its address in the directory under the group's name; the job's other
processes read it and connect. Once the whole job has arrived the entry is removed.

So a job needs the shared address only while it gathers. The process that serves the
directory may end (its job done, or crashed) without breaking another job: a job that is
still gathering reconnects to whichever process serves the address next (serving it
itself if none does) and publishes again. An entry a crashed job left behind is
recognised (nothing answers at its address, or another job's store does) and replaced.
"""

from __future__ import annotations

import secrets
import socket
from datetime import timedelta
from typing import Callable, List, Optional, TypeVar

from .._errors import DistError, DistNetworkError, DistStoreError, DistStoreTimeoutError
from .._store import TCPStore
from .._store.base import Store
from .common import JobStore, Poll, peek

__all__ = ["join_tcp_job"]

T = TypeVar("T")
_JOB_ID = "tdist/job-id"
_ARRIVED = "tdist/arrived"


class _Directory:
    """This process's way to the directory at ``host:port``: a client, or the server
    itself when this process could bind the address first. Calls that find the
    directory gone (its process ended) reconnect, or serve the address, and retry."""

    def __init__(self, host: str, port: int, poll: Poll) -> None:
        self.host, self.port, self.poll = host, port, poll
        self.served: List[TCPStore] = []  # the directory servers this process started
        self._store: Optional[TCPStore] = None

    def _open(self) -> TCPStore:
        limit = timedelta(seconds=max(self.poll.remaining, 0.1))
        try:
            store = TCPStore(self.host, self.port, is_master=True, timeout=limit, wait_for_workers=False)
        except (OSError, DistError):  # someone serves it already (or it is another host's address)
            return TCPStore(self.host, self.port, is_master=False, timeout=limit, wait_for_workers=False)
        self.served.append(store)
        return store

    def call(self, fn: Callable[[Store], T]) -> T:
        for attempt in range(3):
            if self._store is None:
                self._store = self._open()
            try:
                return fn(self._store)
            except DistNetworkError:  # the directory's process went away: find (or be) the next one
                if self._store not in self.served:
                    self._store.close()
                self._store = None
                if attempt == 2 or self.poll.expired():
                    raise
        raise AssertionError("unreachable")

    def close_client(self) -> None:
        """Close the connection unless this process serves the directory (others may need it)."""
        if self._store is not None and self._store not in self.served:
            self._store.close()
        self._store = None


def _local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (a UDP connect sends nothing)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except OSError:
        return host
    for family, socktype, proto, _, addr in infos:
        try:
            with socket.socket(family, socktype, proto) as probe:
                probe.connect(addr)
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return host


def _open_job(entry: bytes, poll: Poll) -> Optional[TCPStore]:
    """A client of the job store ``entry`` names; None when it is gone or not that job's."""
    try:
        job_id, port, host = entry.decode().split(" ", 2)
        with socket.create_connection((host, int(port)), timeout=min(5.0, max(poll.remaining, 0.1))):
            pass  # refused at once when nothing listens there any more
        store = TCPStore(
            host,
            int(port),
            is_master=False,
            timeout=timedelta(seconds=max(poll.remaining, 0.1)),
            wait_for_workers=False,
        )
    except (OSError, ValueError, DistError):
        return None
    try:
        ours = peek(store, _JOB_ID) == job_id.encode()
    except DistError:
        ours = False
    if not ours:  # a port reused by another job's store
        store.close()
        return None
    store.set_timeout(poll.timeout)  # the job's blocking calls get the job's timeout
    return store


def _publish(
    directory: _Directory, key: str, current: bytes, group: str, rank: int, world_size: int, poll: Poll
) -> Optional[tuple[TCPStore, int]]:
    """Start the job's store and publish it (replacing ``current``); None if another process
    published first. Returns once every process of the job has arrived."""
    host = _local_address_towards(directory.host, directory.port)
    store = TCPStore(host, 0, is_master=True, timeout=timedelta(seconds=poll.timeout), wait_for_workers=False)
    job_id = secrets.token_hex(16)
    entry = f"{job_id} {store.port} {host}".encode()
    try:
        store.set(_JOB_ID, job_id)
        if rank < 0:
            rank = store.add("tdist/auto_rank", 1) - 1
        if directory.call(lambda d: d.compare_set(key, current, entry)) != entry:
            store.close()
            return None
        store.add(_ARRIVED, 1)
        while store.add(_ARRIVED, 0) < world_size:
            if poll.expired():
                raise DistStoreTimeoutError(
                    f"tcp:// rendezvous: group {group!r}: {store.add(_ARRIVED, 0)} of {world_size} processes "
                    "arrived within the timeout"
                )
            poll.sleep()
            # keep the entry while the job gathers, also in a directory that restarted empty
            now = directory.call(lambda d: d.compare_set(key, b"", entry))
            if now != entry:
                raise DistStoreError(
                    f"tcp:// rendezvous: group {group!r}: the rendezvous at {directory.host}:{directory.port} "
                    "restarted while the job gathered and another process now holds the group; start the job again"
                )
    except BaseException:
        _forget(directory, key, entry)
        store.close()
        raise
    _forget(directory, key, entry)
    return store, rank


def _forget(directory: _Directory, key: str, entry: bytes) -> None:
    try:
        directory.call(lambda d: d.compare_set(key, entry, b""))
    except DistError:
        pass  # the directory is gone, and the entry with it


def _join(job: TCPStore, rank: int, world_size: int) -> Optional[int]:
    """Take a rank in the job behind ``job``; None when it already has all its processes."""
    if rank < 0:
        rank = job.add("tdist/auto_rank", 1) - 1
        if rank >= world_size:
            return None
    elif job.add(_ARRIVED, 0) >= world_size:
        return None
    job.add(_ARRIVED, 1)
    return rank


def join_tcp_job(host: str, port: int, group: str, rank: int, world_size: int, timeout: float) -> tuple[Store, int]:
    """This process's store and rank in job ``group`` at ``host:port`` (see the module doc)."""
    poll = Poll(timeout)
    directory = _Directory(host, port, poll)
    key = f"tdist/jobs/{group}"
    try:
        while True:
            current = directory.call(lambda d: peek(d, key))
            joined: Optional[tuple[TCPStore, int]] = None
            if rank <= 0 and not current:
                joined = _publish(directory, key, current, group, rank, world_size, poll)
            elif current:
                job = _open_job(current, poll)
                if job is None:  # left by a job that ended or crashed
                    if rank <= 0:
                        joined = _publish(directory, key, current, group, rank, world_size, poll)
                else:
                    taken = _join(job, rank, world_size) if rank != 0 else None
                    if taken is None:
                        job.close()
                        if rank == 0:  # a rank 0 replaces whatever job was published before it
                            joined = _publish(directory, key, current, group, rank, world_size, poll)
                    else:
                        joined = job, taken
            if joined is not None:
                store, rank = joined
                return JobStore(f"job/{group}", store, on_close=[s.close for s in directory.served]), rank
            if poll.expired():
                raise DistStoreTimeoutError(
                    f"tcp:// rendezvous: group {group!r} at {host}:{port}: no job to join within {timeout:g} s"
                    + ("" if rank < 0 else " (waiting for its rank 0 to publish it)")
                )
            poll.sleep()
    except BaseException:
        for served in directory.served:
            served.close()
        raise
    finally:
        directory.close_client()
