"""Helpers shared by the built-in rendezvous handlers."""

from __future__ import annotations

import time
import urllib.parse
from typing import Callable, Optional, Sequence

from .._store import PrefixStore
from .._store.base import Store

__all__ = ["query_int", "merge_int", "job_store", "check_rank", "JobStore", "peek", "Poll"]

_UNSET = b"\x00tdist-unset"


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


class JobStore(PrefixStore):
    """One job's keys (under ``prefix``) in ``store``, which it owns. Closing it closes
    ``store``, then runs each of ``on_close`` once (what the rendezvous holds for the job:
    a server other jobs use, locks), even if an earlier one fails."""

    def __init__(self, prefix: str, store: Store, on_close: Sequence[Callable[[], None]] = ()) -> None:
        super().__init__(prefix, store, owns=True)
        self._on_close = list(on_close)

    def close(self) -> None:
        callbacks, self._on_close = self._on_close, []
        try:
            super().close()
        finally:
            errors = []
            for callback in callbacks:
                try:
                    callback()
                except Exception as exc:  # run the others, report the first
                    errors.append(exc)
            if errors:
                raise errors[0]


def peek(store: Store, key: str) -> bytes:
    """The value of ``key`` without waiting (one atomic store call); ``b""`` when unset."""
    value = store.compare_set(key, _UNSET, _UNSET)
    return b"" if value == _UNSET else value


class Poll:
    """Sleeps between the attempts of a polling loop (growing from ``first`` to ``longest``
    seconds) and knows the loop's deadline."""

    def __init__(self, timeout: float, first: float = 0.01, longest: float = 0.25) -> None:
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout
        self._delay, self._longest = first, longest

    @property
    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.remaining <= 0

    def sleep(self) -> None:
        time.sleep(max(0.0, min(self._delay, self.remaining)))
        self._delay = min(self._delay * 2, self._longest)
