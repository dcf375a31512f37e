"""``PrefixStore``: a namespace inside another store."""

from __future__ import annotations

from datetime import timedelta
from typing import List, Sequence

from .._work import Timeout
from .base import Store, Value, as_bytes, call_get, call_wait

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Wraps ``store`` and prepends ``prefix + "/"`` to every key (and queue name).

    Several groups can share one store without their keys colliding. Every operation,
    extended ones included, is forwarded to the underlying store, which decides how it is
    done (``has_extended_api`` is the underlying store's). The timeout is the underlying
    store's. ``num_keys`` counts *all* keys of the underlying store (as in torch);
    ``list_keys`` lists those under this prefix, without it. ``close`` closes the
    underlying store only when ``owns`` is True (a store usually has other users).
    """

    def __init__(self, prefix: str, store: Store, owns: bool = False) -> None:
        if store is None:
            raise ValueError("PrefixStore: the underlying store is None")
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
    def _underlying_non_prefix_store(self) -> Store:
        """The first store below that is not a PrefixStore (torch's name)."""
        store = self._store
        while isinstance(store, PrefixStore):
            store = store.underlying_store
        return store

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

    def _keys(self, keys: Sequence[str]) -> List[str]:
        return [f"{self._prefix}/{k}" for k in keys]

    def __repr__(self) -> str:
        return f"<PrefixStore {self._prefix!r} over {self._store!r}>"

    def set(self, key: str, value: Value) -> None:
        self._store.set(self._key(key), as_bytes(value))

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        return call_get(self._store, self._key(key), timeout)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._store.compare_set(self._key(key), as_bytes(expected), as_bytes(desired))

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        call_wait(self._store, self._keys(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return self._store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        """The number of keys in the underlying store (all prefixes, not only this one)."""
        return self._store.num_keys()

    # ------------------------------------------------------------- extended API
    def has_extended_api(self) -> bool:
        return self._store.has_extended_api()

    def append(self, key: str, value: Value) -> None:
        self._store.append(self._key(key), as_bytes(value))

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        return self._store.multi_get(self._keys(keys))

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        self._store.multi_set(self._keys(keys), [as_bytes(v) for v in values])

    def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        if timeout is None:
            self._store.barrier(self._key(key), world_size)
        else:
            self._store.barrier(self._key(key), world_size, timeout)

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone(), owns=self._owns)

    def list_keys(self) -> List[str]:
        head = self._prefix + "/"
        return [k[len(head) :] for k in self._store.list_keys() if k.startswith(head)]

    def queue_push(self, key: str, value: Value) -> None:
        self._store.queue_push(self._key(key), as_bytes(value))

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        if timeout is None:
            return self._store.queue_pop(self._key(key), block)
        return self._store.queue_pop(self._key(key), block, timeout)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._key(key))
