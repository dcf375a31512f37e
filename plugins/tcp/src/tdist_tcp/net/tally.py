"""A yes/no agreement through the group's store, as a group's setup needs it: every
member writes its word (``"1"`` or ``"0"``) under a key of its own; one of them, the
*counter*, waits for every word and publishes the verdict -- yes only if every word is
yes -- which the others wait for. The verdict is the same on every member.

When some words never come, the counter publishes who is missing instead (which wakes
the others at once) and every member raises the same timeout error naming them; a
member that hears nothing names the members whose words are absent, or the counter.
Used for the shared segment (:func:`tdist_tcp.shared.shm.open_shm`: did every member map it?)
and the hierarchy (does every host have its segment?).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Sequence

from tdist.plugin import DistError, DistStoreTimeoutError

__all__ = ["count", "hear", "absent"]

#: Makes the error a member raises from the members missing (their labels).
Missing = Callable[[list[int]], Exception]


def count(
    store: Any,
    keys: Sequence[str],
    labels: Sequence[int],
    verdict_key: str,
    deadline: float,
    mine: bool,
    error: Missing,
) -> bool:
    """The counter: wait until ``deadline`` (monotonic) for every word (``keys``, of the
    members ``labels``), publish and return whether all of them and ``mine`` are yes;
    raise ``error(missing)`` when some never come (published first)."""
    try:
        store.wait(list(keys), timeout=max(0.01, deadline - time.monotonic()))
    except DistStoreTimeoutError:
        missing = absent(store, keys, labels)
        store.set(verdict_key, json.dumps(missing))  # wakes the members waiting for the verdict
        raise error(missing) from None
    verdict = mine and all(word == b"1" for word in store.multi_get(list(keys)))
    store.set(verdict_key, "1" if verdict else "0")
    return verdict


def hear(
    store: Any,
    keys: Sequence[str],
    labels: Sequence[int],
    verdict_key: str,
    deadline: float,
    counter: int,
    error: Missing,
) -> bool:
    """Every other member: the counter's verdict, waited for until ``deadline``; raise
    ``error(missing)`` when the counter said some words never came, or when no verdict
    comes (naming the members whose words are absent, else the ``counter``)."""
    try:
        said = store.get(verdict_key, timeout=max(0.01, deadline - time.monotonic()))
    except DistStoreTimeoutError:
        raise error(absent(store, keys, labels) or [counter]) from None
    if said in (b"0", b"1"):
        return said == b"1"
    try:
        missing = [int(r) for r in json.loads(said)]
    except (ValueError, TypeError):
        missing = [counter]
    raise error(missing)


def absent(store: Any, keys: Sequence[str], labels: Sequence[int]) -> list[int]:
    """The labels of ``keys`` not in the store (a store that cannot be read counts as
    not having them)."""
    return [label for label, key in zip(labels, keys) if not _present(store, key)]


def _present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except (DistError, OSError):
        return False
