"""``tdist.rendezvous(url, rank, world_size)``: torch.distributed.rendezvous, over tdist's handlers.

Like torch's, it returns an iterator that yields ``(store, rank, world_size)`` once (a second
``next`` raises: the built-in methods cannot re-rendezvous), with torch's checks: an unknown
scheme raises RuntimeError("No rendezvous handler for ..."), rank/world_size given both as
arguments and in the URL raise AssertionError ("... has node-specific arguments ..."), and
``tcp://``/``file://`` need both (ValueError "rank parameter missing" / "size parameter
missing"). ``init_process_group`` additionally assigns ranks for ``tcp://``/``file://``
when none is given; this torch-compatible entry point does not.
"""

from __future__ import annotations

import numbers
import urllib.parse
from datetime import timedelta
from typing import Any, Iterator, Tuple

from .._plugins import plugins
from .._store.base import Store

__all__ = ["rendezvous"]

#: Schemes whose torch handlers require rank and world_size (env:// reads them from the environment).
_NEEDS_RANK = ("tcp", "file")


class NodeArgumentsError(ValueError, AssertionError):
    """rank/world_size passed both as arguments and in the URL (an AssertionError in torch)."""


def rendezvous(url: str, rank: int = -1, world_size: int = -1, **kwargs: Any) -> Iterator[Tuple[Store, int, int]]:
    """Rendezvous through ``url`` (``env://``, ``tcp://host:port``, ``file:///path`` or a plugin's
    scheme); yields ``(store, rank, world_size)`` once. ``timeout`` (a timedelta, default 30
    minutes) bounds the rendezvous; ``group_name`` keeps jobs sharing the URL apart (tdist's)."""
    if not isinstance(url, str):
        raise RuntimeError(f"`url` must be a string. {type(url)}: {url}")
    if not isinstance(rank, numbers.Integral) or not isinstance(world_size, numbers.Integral):
        raise RuntimeError(f"`rank` and `world_size` must be integers: {rank!r}, {world_size!r}")
    parsed = urllib.parse.urlsplit(url)
    handler = plugins().rendezvous.get(parsed.scheme) if parsed.scheme else None
    if handler is None:
        raise RuntimeError(f"No rendezvous handler for {parsed.scheme}://")
    query = urllib.parse.parse_qs(parsed.query)
    if (rank != -1 or world_size != -1) and ("rank" in query or "world_size" in query):
        raise NodeArgumentsError(f"The url: {url} has node-specific arguments(rank, world_size) already.")
    if parsed.scheme in _NEEDS_RANK:
        if rank == -1 and "rank" not in query:
            raise ValueError(
                f"{parsed.scheme}:// rendezvous: rank parameter missing in {url!r} (pass rank= or add ?rank=)"
            )
        if world_size == -1 and "world_size" not in query:
            raise ValueError(
                f"{parsed.scheme}:// rendezvous: world_size parameter missing in {url!r} "
                "(pass world_size= or add ?world_size=)"
            )
    timeout = kwargs.pop("timeout", None)
    if timeout is None:
        from .._init import default_pg_timeout

        timeout = default_pg_timeout
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    group_name = str(kwargs.pop("group_name", ""))
    return _once(handler, parsed, int(rank), int(world_size), timeout, group_name)


def _once(
    handler: Any, url: urllib.parse.SplitResult, rank: int, world_size: int, timeout: timedelta, group_name: str
) -> Iterator[Tuple[Store, int, int]]:
    yield handler(url, rank=rank, world_size=world_size, timeout=timeout.total_seconds(), group_name=group_name)
    raise RuntimeError(f"Unable to perform re-rendezvous using {url.scheme}:// method")
