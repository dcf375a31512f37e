"""The key-value ``Store`` interface every rendezvous and backend shares."""

from __future__ import annotations

import abc
from datetime import timedelta
from typing import Sequence, Union

from .._work import Timeout, seconds

__all__ = ["Store", "DEFAULT_STORE_TIMEOUT", "as_bytes"]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)

Value = Union[bytes, bytearray, memoryview, str]


def as_bytes(value: Value) -> bytes:
    """Encode a store value: ``str`` as UTF-8, byte-like objects as they are."""
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class Store(abc.ABC):
    """A key-value store shared by all processes of a job.

    Keys are ``str``; values are ``bytes`` (``str`` values are stored UTF-8 encoded).
    Blocking calls (``get``, ``wait``) give up after the store's timeout, or the
    ``timeout`` passed to them, and raise :class:`tdist.DistStoreTimeoutError`
    (a ``TimeoutError``) naming the missing keys.
    """

    def __init__(self, timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = seconds(timeout, DEFAULT_STORE_TIMEOUT.total_seconds())

    @property
    def timeout(self) -> timedelta:
        """The default timeout of blocking calls."""
        return timedelta(seconds=self._timeout)

    def set_timeout(self, timeout: Timeout) -> None:
        """Change the default timeout of blocking calls."""
        self._timeout = seconds(timeout, self._timeout)

    def _limit(self, timeout: Timeout) -> float:
        return seconds(timeout, self._timeout)  # type: ignore[return-value]

    @abc.abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Store ``value`` under ``key``, replacing any earlier value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: Timeout = None) -> bytes:
        """Return the value of ``key``, waiting until it is set."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer counter ``key`` (0 when unset); return the new value."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (or if it is unset and
        ``expected`` is empty); return the value the key holds afterwards."""

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        """Block until every key in ``keys`` is set."""

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Return whether every key in ``keys`` is set, without waiting."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Delete ``key``; return whether it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """Return the number of keys set."""

    def close(self) -> None:
        """Release connections and files; the store is unusable afterwards."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

