"""shrink_group's agreement (``tdist._shrink._agree``) on an in-process store, with the
survivors as threads: the order in which their claims arrive is set by the test."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

import tdist
from tdist._shrink import _agree

KEY = "tdist/pg0.shrink1/agree"
TIMEOUT = timedelta(seconds=10)


def _in_thread(fn, *args):
    """Run ``fn(*args)`` in a thread; a getter for its outcome (the value or the exception)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["value"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def outcome():
        thread.join(TIMEOUT.total_seconds() + 5)
        assert not thread.is_alive(), "the agreement hung"
        return box["value"]

    return outcome


def _wait_for_key(store, key: str) -> None:
    deadline = time.monotonic() + 5
    while not store.check([key]):
        assert time.monotonic() < deadline, f"{key} never set"
        time.sleep(0.01)


def test_survivors_that_agree_go_on():
    store = tdist.HashStore()
    results = [_in_thread(_agree, store, KEY, r, [0, 1], [2], TIMEOUT) for r in (0, 1)]
    assert [get() for get in results] == [None, None]


def test_a_refusal_seen_by_one_survivor_is_every_survivors():
    """Ranks 1 and 2 exclude rank 0, which is alive and shrinking too but whose claim
    arrives after rank 2 looked and before rank 1 did: rank 1 refuses, and so must rank 2
    (it would otherwise build a group rank 1 never joins, and wait out its timeout)."""
    store = tdist.HashStore()
    late = _in_thread(_agree, store, KEY, 2, [1, 2], [0], TIMEOUT)
    store.set(f"{KEY}/1", b"[0]")  # rank 1's claim: rank 2 sees both claims agree ...
    _wait_for_key(store, f"{KEY}/verdict/2")  # ... and no claim of rank 0's: no objection
    zero = _in_thread(_agree, store, KEY, 0, [0, 1], [2], TIMEOUT)  # rank 0 arrives now
    _wait_for_key(store, f"{KEY}/0")
    one = _agree_error(store, 1, [1, 2], [0])
    assert "alive and called shrink_group too" in str(one)
    relayed = late()
    assert isinstance(relayed, tdist.DistError) and "disagree" in str(relayed), relayed
    assert "group rank 1 refused the shrink" in str(relayed)
    refused = zero()
    assert isinstance(refused, tdist.DistError) and "disagree" in str(refused), refused


def test_a_survivor_that_never_comes_is_named():
    store = tdist.HashStore()
    with pytest.raises(tdist.DistError, match=r"rank\(s\) \[1\], which it keeps, never called shrink_group"):
        _agree(store, KEY, 0, [0, 1], [2], timedelta(seconds=0.3))


def _agree_error(store, me: int, survivors: list[int], excluded: list[int]) -> BaseException:
    with pytest.raises(tdist.DistError) as info:
        _agree(store, KEY, me, survivors, excluded, TIMEOUT)
    return info.value
