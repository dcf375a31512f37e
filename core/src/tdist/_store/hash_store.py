"""``HashStore``: an in-process, thread-safe key-value store."""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional, Sequence, TypeVar

from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, QueueEmptyError, Store, Value, as_bytes, wait_timeout_error
from .table import KeyTable

__all__ = ["HashStore"]

T = TypeVar("T")


class HashStore(Store):
    """A store held in this process's memory: threads share it, processes do not.

    Every method is thread-safe and atomic; blocking calls wait on a condition variable
    until their keys are set or the timeout passes (:class:`DistStoreTimeoutError`).
    ``clone()`` returns the store itself.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._table = KeyTable("HashStore")
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"<HashStore keys={self._table.num_keys()}>"

    def _await(self, ready: Callable[[], Optional[T]], keys: Sequence[str], timeout: Timeout) -> T:
        """Wait (condition held) until ``ready()`` returns something other than None; return it."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        while True:
            result = ready()
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k in keys if not self._table.has(k.encode())]
                raise wait_timeout_error("HashStore", limit, missing or list(keys))
            self._cond.wait(remaining)

    def _changed(self) -> None:
        self._cond.notify_all()

    def set(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._cond:
            self._table.values[key.encode()] = data
            self._changed()

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        k = key.encode()
        with self._cond:
            return self._await(lambda: self._table.values.get(k), [key], timeout)

    def add(self, key: str, amount: int) -> int:
        with self._cond:
            value = self._table.add(key.encode(), amount)
            self._changed()
        return int(value)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        with self._cond:
            stored, result = self._table.compare_set(key.encode(), as_bytes(expected), as_bytes(desired))
            if stored:
                self._changed()
            return result

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        encoded = [k.encode() for k in keys]
        with self._cond:
            self._await(lambda: True if not self._table.missing(encoded) else None, list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with self._cond:
            return not self._table.missing([k.encode() for k in keys])

    def delete_key(self, key: str) -> bool:
        with self._cond:
            return self._table.delete(key.encode())

    def num_keys(self) -> int:
        with self._cond:
            return self._table.num_keys()

    # ------------------------------------------------------------- extended API
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._cond:
            self._table.append(key.encode(), data)
            self._changed()

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        encoded = [k.encode() for k in keys]
        values = self._table.values

        def ready() -> Optional[List[bytes]]:
            return None if any(k not in values for k in encoded) else [values[k] for k in encoded]

        with self._cond:
            return self._await(ready, list(keys), None)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"HashStore.multi_set: {len(keys)} keys but {len(values)} values")
        data = [as_bytes(v) for v in values]
        with self._cond:
            for key, value in zip(keys, data):
                self._table.values[key.encode()] = value
            self._changed()

    def list_keys(self) -> List[str]:
        with self._cond:
            return self._table.list_keys()

    def queue_push(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._cond:
            self._table.queue_push(key.encode(), data)
            self._changed()

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        k = key.encode()
        with self._cond:
            if not block:
                value = self._table.queue_pop(k)
                if value is None:
                    raise QueueEmptyError(f"HashStore: queue_pop: queue {key!r} is empty")
                return value
            return self._await(lambda: self._table.queue_pop(k), [key], timeout)

    def queue_len(self, key: str) -> int:
        with self._cond:
            return self._table.queue_len(key.encode())
