"""``tcp://host:port``: rank 0 hosts a TCPStore at ``host:port``, the others connect.

``rank`` and ``world_size`` may also be given as URL query parameters
(``tcp://10.1.1.20:23456?rank=1&world_size=4``). When no rank is given, ranks are
assigned automatically in arrival order: the first process able to bind the
address hosts the store. With ``group_name``, several jobs share one address, at once
or one after another: the address only points each job to its own store, so no job
depends on another's processes once it has gathered (see :mod:`.tcp_jobs`).

A multicast address (``tcp://239.1.2.3:23456``, ``tcp://[ff15::1234]:23456``) makes the
processes find each other on that group instead (see :mod:`.multicast`).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from datetime import timedelta

from .._errors import DistError
from .._store import TCPStore
from .._store.base import Store
from .common import check_rank, merge_int, query_int
from .multicast import multicast_rendezvous
from .tcp_jobs import join_tcp_job

__all__ = ["tcp_rendezvous", "connect_tcp_store"]


def connect_tcp_store(host: str, port: int, rank: int, world_size: int, timeout: float) -> Store:
    """The TCPStore for ``rank``: hosted by rank 0, a client elsewhere."""
    return TCPStore(
        host, port, world_size, is_master=(rank == 0), timeout=timedelta(seconds=timeout), wait_for_workers=False
    )


def _is_multicast(host: str) -> bool:
    try:  # an IPv6 group may carry a scope: [ff02::1%25eth0]
        return ipaddress.ip_address(urllib.parse.unquote(host).partition("%")[0]).is_multicast
    except ValueError:
        return False


def tcp_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    where = urllib.parse.urlunsplit(url)
    if not url.hostname:
        raise ValueError(f"tcp:// rendezvous: host missing in {where!r} (expected tcp://host:port)")
    try:
        port = url.port
    except ValueError:
        raise ValueError(f"tcp:// rendezvous: invalid port in {where!r}") from None
    if port is None:
        raise ValueError(f"tcp:// rendezvous: port number missing in {where!r}")
    rank = merge_int("tcp", "rank", rank, query_int(url, "rank", "tcp"))
    world_size = merge_int("tcp", "world_size", world_size, query_int(url, "world_size", "tcp"))
    if _is_multicast(url.hostname):
        return multicast_rendezvous(
            url, url.hostname, port, rank=rank, world_size=world_size, timeout=timeout, group_name=group_name
        )
    if world_size < 1:
        raise ValueError(f"tcp:// rendezvous: world_size is required (argument or ?world_size= in {where!r})")
    check_rank("tcp", rank, world_size)
    if group_name:
        store, rank = join_tcp_job(url.hostname, port, group_name, rank, world_size, timeout)
        return store, rank, world_size
    if rank >= 0:
        return connect_tcp_store(url.hostname, port, rank, world_size, timeout), rank, world_size
    try:
        store = TCPStore(
            url.hostname, port, world_size, is_master=True, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
    except (OSError, DistError):
        store = TCPStore(
            url.hostname, port, world_size, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
    return store, store.add("auto_rank", 1) - 1, world_size
