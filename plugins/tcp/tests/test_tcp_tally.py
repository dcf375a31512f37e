"""tdist_tcp.net.tally: the store's yes/no agreement of a group's setup (members in threads on
one HashStore): every member gets the same verdict, and a missing word is the same timeout
error, naming the member, on every member -- fast, not at each member's own timeout."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import pytest
from tdist.plugin import DistBackendTimeoutError, HashStore

from tdist_tcp.net import tally

KEYS = [f"word/{r}" for r in range(1, 4)]
LABELS = [1, 2, 3]


def _members(words: dict[int, Optional[bool]], timeout: float) -> dict[int, Any]:
    """Member 0 counts, members 1-3 say their word (None: says nothing) and hear; each
    member's verdict, or the exception it raised."""
    store, out = HashStore(), {}
    deadline = time.monotonic() + timeout

    def error(missing: list[int]) -> Exception:
        return DistBackendTimeoutError(f"ranks {missing} did not answer")

    def member(r: int) -> None:
        try:
            if r == 0:
                out[r] = tally.count(store, KEYS, LABELS, "verdict", deadline, True, error)
                return
            if words[r] is None:
                out[r] = "silent"
                return
            store.set(f"word/{r}", "1" if words[r] else "0")
            out[r] = tally.hear(store, KEYS, LABELS, "verdict", deadline, 0, error)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out[r] = exc

    threads = [threading.Thread(target=member, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


@pytest.mark.parametrize("no", [None, 2])
def test_every_member_gets_the_same_verdict(no: Optional[int]) -> None:
    out = _members({r: r != no for r in (1, 2, 3)}, timeout=5.0)
    assert out == {r: no is None for r in range(4)}


def test_a_silent_member_is_named_by_everyone_at_the_counters_timeout() -> None:
    started = time.monotonic()
    out = _members({1: True, 2: None, 3: True}, timeout=1.0)
    assert time.monotonic() - started < 4.0
    assert out[2] == "silent"
    for r in (0, 1, 3):
        assert isinstance(out[r], DistBackendTimeoutError), out[r]
        assert "ranks [2] did not answer" in str(out[r])


def test_absent_names_the_keys_not_in_the_store() -> None:
    store = HashStore()
    store.set("word/2", "1")
    assert tally.absent(store, KEYS, LABELS) == [1, 3]
