"""The key-value ``Store`` interface every rendezvous and backend shares: torch.distributed.Store's API.

A store implements the eight basic operations (``set``, ``get``, ``add``, ``compare_set``,
``wait``, ``check``, ``delete_key``, ``num_keys``); the base class builds ``append``,
``multi_get``, ``multi_set``, ``barrier`` and ``clone`` on them, as torch does. tdist's own
stores implement every operation natively.
"""

from __future__ import annotations

import math
import threading
from datetime import timedelta
from typing import List, Optional, Sequence, Union

from .._errors import DistStoreError, DistStoreTimeoutError
from .._work import Timeout, seconds

__all__ = [
    "Store",
    "QueueEmptyError",
    "DEFAULT_STORE_TIMEOUT",
    "MAX_TIMEOUT_S",
    "as_bytes",
    "timeout_seconds",
    "wait_timeout_error",
]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)
#: The longest timeout a blocking call can honour (what ``threading`` can wait: about 292 years).
MAX_TIMEOUT_S = float(threading.TIMEOUT_MAX)

Value = Union[bytes, bytearray, memoryview, str]


class QueueEmptyError(DistStoreError):
    """``queue_pop(key, block=False)`` found the queue empty (``torch.distributed.QueueEmptyError``)."""


def as_bytes(value: Value) -> bytes:
    """Encode a store value: ``str`` as UTF-8, byte-like objects as they are."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def timeout_seconds(timeout: Timeout, default: float, where: str) -> float:
    """``timeout`` (timedelta or seconds; None: ``default``) in seconds, checked: a NaN or a value
    too large to wait for raises ValueError; a negative one means "already expired" (0)."""
    value = seconds(timeout, default)
    assert value is not None
    if math.isnan(value):
        raise ValueError(f"{where}: the timeout is NaN")
    if value > MAX_TIMEOUT_S:
        raise ValueError(
            f"{where}: a timeout of {value:g} s is too large to wait for (at most {MAX_TIMEOUT_S:g} s, about 292 years)"
        )
    return max(value, 0.0)


def _ms(limit: float) -> int:
    return int(round(limit * 1000))


def wait_timeout_error(where: str, limit: float, keys: Sequence[str]) -> DistStoreTimeoutError:
    """The error of a wait that timed out, worded as torch's stores word it
    (``wait timeout after 100ms, keys: /a, /b``), naming the store."""
    return DistStoreTimeoutError(
        f"{where}: wait timeout after {_ms(limit)}ms, keys: " + ", ".join("/" + k for k in keys)
    )


class Store:
    """A key-value store shared by all processes of a job (``torch.distributed.Store``).

    Keys are ``str``; values are ``bytes`` (``str`` values are stored UTF-8 encoded).
    Blocking calls (``get``, ``wait``, ``multi_get``, ``queue_pop``, ``barrier``) give up after
    the store's timeout, or the ``timeout`` passed to them, and raise
    :class:`tdist.DistStoreTimeoutError` (a ``TimeoutError``; its message says "timeout" and
    names the keys).

    A subclass implements the eight basic operations; the extended ones (``append``,
    ``multi_get``, ``multi_set``, ``barrier``, ``clone``) have defaults built on them, and
    ``has_extended_api()`` is False until a subclass implements them natively. ``list_keys`` and
    the queue operations cannot be built on the basic ones: they raise NotImplementedError
    unless implemented (as torch's do).
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = timeout_seconds(timeout, DEFAULT_STORE_TIMEOUT.total_seconds(), type(self).__name__)

    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        """Change the default timeout of blocking calls."""
        self._timeout = timeout_seconds(timeout, self._timeout, type(self).__name__)

    def _limit(self, timeout: Timeout) -> float:
        return timeout_seconds(timeout, self._timeout, type(self).__name__)

    def _not_implemented(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{type(self).__name__}.{what}: Not implemented.")

    # ----------------------------------------------------------- basic operations
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any earlier value."""
        raise self._not_implemented("set")

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        """Return the value of ``key``, waiting until it is set."""
        raise self._not_implemented("get")

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (0 when unset); return the new value."""
        raise self._not_implemented("add")

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (or if it is unset and
        ``expected`` is empty); return the value the key holds afterwards (``expected`` when the
        key is unset and ``expected`` is not empty, as torch does)."""
        raise self._not_implemented("compare_set")

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Block until every key in ``keys`` is set (or, for a queue, not empty)."""
        raise self._not_implemented("wait")

    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` is set (or, for a queue, not empty), without waiting."""
        raise self._not_implemented("check")

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""
        raise self._not_implemented("delete_key")

    def num_keys(self) -> int:
        """Return the number of keys set, counting the store's own bookkeeping keys as torch does
        (a TCPStore whose workers counted in has one, a FileStore one or two)."""
        raise self._not_implemented("num_keys")

    # ------------------------------------------------------- extended operations
    def has_extended_api(self) -> bool:
        """Whether ``append``, ``multi_get`` and ``multi_set`` are native (atomic, one round trip)
        rather than the base class's defaults."""
        return False

    def append(self, key: str, value: Value) -> None:
        """Append ``value`` to the value of ``key`` (creating it). Default: a ``compare_set`` loop."""
        tail = as_bytes(value)
        current = b""
        while True:
            desired = current + tail
            got = bytes(self.compare_set(key, current, desired))
            if got == desired:
                return
            # an unset key answers a non-empty `expected` with `expected` itself: the key vanished
            current = b"" if got == current else got

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        """The values of ``keys``, waiting (up to the timeout) until all are set. Default: one ``get`` each."""
        return [self.get(key) for key in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        """Set every key of ``keys`` to the value at the same position. Default: one ``set`` each."""
        if len(keys) != len(values):
            raise ValueError(f"{type(self).__name__}.multi_set: {len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            self.set(key, as_bytes(value))

    def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        """Block until ``world_size`` callers have called ``barrier`` with ``key`` (a key serves
        one barrier). Default: an ``add`` and a ``wait`` on ``key/num_members`` and ``key/last_member``."""
        limit = self._limit(timeout)
        arrived = self.add(f"{key}/num_members", 1)
        if arrived >= world_size:
            self.set(f"{key}/last_member", b"1")
        try:
            self.wait([f"{key}/last_member"], timedelta(seconds=limit))
        except TimeoutError:
            raise DistStoreTimeoutError(
                f"{type(self).__name__}: barrier timeout after {_ms(limit)}ms, key: {key} "
                f"({self.add(f'{key}/num_members', 0)} of {world_size} arrived)"
            ) from None

    def clone(self) -> "Store":
        """A handle onto the same data for another thread. Default: ``self`` (the store is thread-safe)."""
        return self

    def list_keys(self) -> List[str]:
        """Every key set (the store's own bookkeeping keys excluded)."""
        raise self._not_implemented("list_keys")

    def queue_push(self, key: str, value: Value) -> None:
        """Append ``value`` to the queue ``key``; ``check``/``wait`` on ``key`` see a non-empty queue."""
        raise NotImplementedError(f"{type(self).__name__}.queue_push: queue support is not implemented.")

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        """Remove and return the oldest value of the queue ``key``, waiting (up to the timeout)
        while it is empty; ``block=False`` raises :class:`QueueEmptyError` at once instead."""
        raise NotImplementedError(f"{type(self).__name__}.queue_pop: queue support is not implemented.")

    def queue_len(self, key: str) -> int:
        """The number of values in the queue ``key`` (0 if it does not exist)."""
        raise NotImplementedError(f"{type(self).__name__}.queue_len: queue support is not implemented.")

    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def call_wait(store: Store, keys: Sequence[str], timeout: Optional[Timeout]) -> None:
    """``store.wait(keys[, timeout])``: a store written for torch may accept only ``wait(keys)``."""
    if timeout is None:
        store.wait(list(keys))
    else:
        store.wait(list(keys), timeout)


def call_get(store: Store, key: str, timeout: Optional[Timeout]) -> bytes:
    """``store.get(key[, timeout])``: a store written for torch may accept only ``get(key)``."""
    return store.get(key) if timeout is None else store.get(key, timeout)
