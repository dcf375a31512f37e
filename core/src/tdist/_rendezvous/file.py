"""``file:///path``: rendezvous through a file on a file system every rank sees
(fcntl locking required: local file systems and NFS have it).

The file should not exist when the job starts; it is removed when the last rank
closes it. Ranks are assigned in arrival order when not given. ``group_name``
lets several jobs share one path (their keys are kept apart; the file is then
left in place, to be removed by the user).
"""

from __future__ import annotations

import urllib.parse
from datetime import timedelta

from .._store import FileStore
from .._store.base import Store
from .common import check_rank, job_store, merge_int, query_int

__all__ = ["file_rendezvous"]


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
    store = job_store(
        FileStore(path, world_size if not group_name else -1, timeout=timedelta(seconds=timeout)), group_name
    )
    if rank < 0:
        rank = store.add("auto_rank", 1) - 1
    return store, rank, world_size
