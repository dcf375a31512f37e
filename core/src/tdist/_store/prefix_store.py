"""``PrefixStore``: a namespace inside another store."""

from __future__ import annotations

from datetime import timedelta
from typing import Sequence

from .._work import Timeout
from .base import Store, Value

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Wraps ``store`` and prepends ``prefix + "/"`` to every key.

    Several groups can share one store without their keys colliding. The timeout
    is the underlying store's (reading or setting it here reads or sets that one).
    ``num_keys`` is delegated: it counts *all* keys of the underlying store, not only
    those under this prefix (as in torch). ``close`` closes the underlying store
    only when ``owns`` is True (a store usually has other users).
    """

    def __init__(self, prefix: str, store: Store, owns: bool = False) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore: expected a Store, got {type(store).__name__}")
        self._prefix = prefix
        self._store = store
        self._owns = owns

    def close(self) -> None:
        if self._owns:
            self._store.close()

    @property
    def prefix(self) -> str:
        """The prefix, without the trailing ``/``."""
        return self._prefix

    @property
    def underlying_store(self) -> Store:
        """The store this one writes through to."""
        return self._store

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: Timeout) -> None:
        self._store.set_timeout(timeout)

    @property
    def _timeout(self) -> float:  # type: ignore[override]
        return self._store.timeout.total_seconds()

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def __repr__(self) -> str:
        return f"<PrefixStore {self._prefix!r} over {self._store!r}>"

    def set(self, key: str, value: Value) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        return self._store.get(self._key(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._store.compare_set(self._key(key), expected, desired)

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self._store.wait([self._key(k) for k in keys], timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check([self._key(k) for k in keys])

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """The number of keys in the underlying store (all prefixes, not only this one)."""
        return self._store.num_keys()
