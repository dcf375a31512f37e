"""``file:///path``: rendezvous through a file on a file system every rank sees
(fcntl locking required: local file systems and NFS have it).

The file should not exist when the job starts; it is removed when the last rank
closes it. Ranks are assigned in arrival order when not given. ``group_name``
lets several jobs share one path, at once or one after another, also after a job
crashed (see :mod:`.file_jobs`); the path and ``<path>.tdist-lock`` are removed when the
last process using them leaves. A path that names something other than a regular
file, or a link or another user's file in a world-writable directory, is refused at
once (see :mod:`.safe_files`).
"""

from __future__ import annotations

import os
import urllib.parse
from datetime import timedelta

from .._store import FileStore
from .._store.base import Store
from .common import check_rank, merge_int, query_int
from .file_jobs import join_file_job
from .safe_files import open_regular, same_file

__all__ = ["file_rendezvous"]


def _job_file_store(path: str, world_size: int, timeout: float) -> Store:
    """The FileStore of a job that has the path to itself (removed by its last rank's close)."""
    fd = open_regular(path)
    try:
        store = FileStore(path, world_size, timeout=timedelta(seconds=timeout))
        if not same_file(fd, path):
            store.close()
            raise ValueError(f"file:// rendezvous: {path} was replaced while it was being opened")
    finally:
        os.close(fd)
    return store


def file_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    where = urllib.parse.urlunsplit(url)
    if url.netloc not in ("", "localhost"):
        raise ValueError(f"file:// rendezvous: {where!r} names host {url.netloc!r}; use file:///absolute/path")
    path = urllib.parse.unquote(url.path)
    if not path:
        raise ValueError(f"file:// rendezvous: path missing in {where!r}")
    rank = merge_int("file", "rank", rank, query_int(url, "rank", "file"))
    world_size = merge_int("file", "world_size", world_size, query_int(url, "world_size", "file"))
    if world_size < 1:
        raise ValueError(f"file:// rendezvous: world_size is required (argument or ?world_size= in {where!r})")
    check_rank("file", rank, world_size)
    if group_name:
        store, rank = join_file_job(path, group_name, rank, world_size, timeout)
        return store, rank, world_size
    store = _job_file_store(path, world_size, timeout)
    if rank < 0:
        rank = store.add("auto_rank", 1) - 1
    return store, rank, world_size
