"""``HashStore``: an in-process, thread-safe key-value store."""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Sequence, Tuple

from .._errors import DistStoreError, DistStoreTimeoutError
from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, Store, Value, as_bytes

__all__ = ["HashStore", "compare_set_result", "add_to_value"]


def add_to_value(owner: str, key: str, current: Optional[bytes], amount: int) -> bytes:
    """The new value of counter ``key`` after adding ``amount`` (decimal ASCII, like torch)."""
    if current is None:
        base = 0
    else:
        try:
            base = int(current)
        except ValueError:
            raise DistStoreError(
                f"{owner}: add: the value of key {key!r} is not an integer: {current[:64]!r}") from None
    return str(base + int(amount)).encode()


def compare_set_result(current: Optional[bytes], expected: bytes, desired: bytes) -> Tuple[bool, bytes]:
    """torch's compare-and-set rule: ``(whether to store desired, value to return)``.

    The key is set to ``desired`` when it holds ``expected``, or when it is unset and
    ``expected`` is empty. When it is unset and ``expected`` is not empty nothing is set
    and ``expected`` is returned (as torch does); otherwise the current value is returned.
    """
    if (current is None and not expected) or (current is not None and current == expected):
        return True, desired
    if current is None:
        return False, expected
    return False, current


class HashStore(Store):
    """A store held in this process's memory: threads share it, processes do not.

    Every method is thread-safe; ``get`` and ``wait`` block on a condition variable
    until the keys are set or the timeout passes (:class:`DistStoreTimeoutError`).
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._data: Dict[str, bytes] = {}
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"<HashStore keys={len(self._data)}>"

    def set(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()

    def _wait_locked(self, keys: Sequence[str], timeout: Timeout) -> None:
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        while True:
            missing = [k for k in keys if k not in self._data]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistStoreTimeoutError(f"HashStore: timed out after {limit:g} s waiting for keys {missing}")
            self._cond.wait(remaining)

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        with self._cond:
            self._wait_locked([key], timeout)
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = add_to_value("HashStore", key, self._data.get(key), amount)
            self._data[key] = value
            self._cond.notify_all()
        return int(value)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        with self._cond:
            store, result = compare_set_result(self._data.get(key), as_bytes(expected), as_bytes(desired))
            if store:
                self._data[key] = result
                self._cond.notify_all()
            return result

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        with self._cond:
            self._wait_locked(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)
