"""Helpers shared by the built-in rendezvous handlers."""

from __future__ import annotations

import urllib.parse
from typing import Optional

from .._store import PrefixStore
from .._store.base import Store

__all__ = ["query_int", "merge_int", "job_store", "check_rank"]


def check_rank(scheme: str, rank: int, world_size: int) -> None:
    """Reject a rank outside ``0 .. world_size-1`` before connecting to anything."""
    if rank >= 0 and world_size > 0 and rank >= world_size:
        raise ValueError(
            f"{scheme}:// rendezvous: rank {rank} is out of range for world_size {world_size} (0..{world_size - 1})"
        )


def query_int(url: urllib.parse.SplitResult, name: str, scheme: str) -> Optional[int]:
    """The integer query parameter ``name`` of ``url`` (None when absent)."""
    values = urllib.parse.parse_qs(url.query).get(name)
    if not values:
        return None
    try:
        return int(values[-1])
    except ValueError:
        raise ValueError(f"{scheme}:// rendezvous: {name}={values[-1]!r} in the URL is not an integer") from None


def merge_int(scheme: str, name: str, argument: int, *others: Optional[int]) -> int:
    """Combine an argument (-1: not given) with other sources; they must agree."""
    given = [v for v in (argument if argument >= 0 else None, *others) if v is not None]
    if len(set(given)) > 1:
        raise ValueError(f"{scheme}:// rendezvous: conflicting values for {name}: {sorted(set(given))}")
    return given[0] if given else -1


def job_store(store: Store, group_name: str) -> Store:
    """Keys of one job, so that several jobs (``group_name``) can share a rendezvous.
    Closing the returned store closes ``store``."""
    return PrefixStore(f"job/{group_name}", store, owns=True) if group_name else store
