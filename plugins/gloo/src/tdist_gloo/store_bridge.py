"""``StoreBridge``: a tdist :class:`~tdist.Store` seen as a ``torch.distributed.Store``.

torch's C++ code (ProcessGroupGloo's rendezvous, ``torch.distributed.PrefixStore``)
calls a Python subclass of ``torch.distributed.Store`` through pybind11 trampolines;
this subclass forwards every call to the tdist store, so gloo rendezvouses through
whatever store tdist's init method made (env://, tcp://, file://, a user's store).

ProcessGroupGloo itself calls ``set``, ``wait(keys, timeout)`` and ``get`` (one key
per rank's address); the rest are forwarded for completeness and for torch code
that may use them (``add``, ``compare_set``, ``check``, ``delete_key``, ``num_keys``,
``multi_get``, ``multi_set``, ``append``). torch's trampoline (``PythonStore``) forwards
every one of them to Python except ``num_keys`` and ``delete_key`` (a C++ caller gets
"pure virtual function getNumKeys/deleteKey"; gloo calls neither; Python callers
reach them here).

The bridge must stay referenced from Python while torch uses it: pybind11 finds
the overriding methods on the live Python instance (the backend keeps it).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

import torch.distributed as _td

__all__ = ["StoreBridge"]


def _value(value: Any) -> Any:
    """torch hands values over as ``bytes`` or ``str``; tdist stores take both."""
    if isinstance(value, (bytes, str)):
        return value
    return bytes(value)


class StoreBridge(_td.Store):
    """Forwards torch's ``Store`` interface to the tdist store ``store``."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self._store = store
        try:
            super().set_timeout(store.timeout)
        except Exception:  # a store without a timeout keeps torch's default (300 s)
            pass

    @property
    def tdist_store(self) -> Any:
        """The tdist store every call goes to."""
        return self._store

    def __repr__(self) -> str:
        return f"<StoreBridge over {self._store!r}>"

    # ---------------------------------------------------------------- basics
    def set(self, key: str, value: Any) -> None:
        self._store.set(key, _value(value))

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._store.add(key, int(value)))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return bytes(self._store.compare_set(key, _value(expected_value), _value(desired_value)))

    def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
        self._store.wait(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))

    def num_keys(self) -> int:
        return int(self._store.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._store.set_timeout(timeout)

    # ------------------------------------------------------- extended calls
    def multi_get(self, keys: Sequence[str]) -> list:
        return [bytes(self._store.get(key)) for key in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        for key, value in zip(keys, values):
            self._store.set(key, _value(value))

    def append(self, key: str, value: Any) -> None:
        """Append ``value`` to ``key`` (creating it), atomically through ``compare_set``."""
        tail = _value(value)
        tail = tail.encode() if isinstance(tail, str) else tail
        current = b""
        while True:
            desired = current + tail
            got = bytes(self._store.compare_set(key, current, desired))
            if got == desired:
                return
            if got == current:  # the key vanished meanwhile (an unset key answers `expected`)
                got = b""
            current = got
