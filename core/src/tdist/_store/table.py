"""``KeyTable``: the data of a store and torch's rule for each operation on it.

The in-process :class:`HashStore`, the :class:`FileStore`'s replica of its file and the
TCP server all keep a ``KeyTable``; each adds its own locking and waiting. Keys are bytes;
keys starting with NUL are the store's own bookkeeping: ``num_keys`` counts them (as torch
counts its internal keys), ``list_keys`` leaves them out. Queues live beside the values:
``has`` (what ``check`` and ``wait`` ask) is true for a set key or a non-empty queue.
"""

from __future__ import annotations

from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple, Union

from .._errors import DistStoreError

__all__ = ["KeyTable", "add_to_value", "compare_set_result", "INTERNAL_PREFIX"]

INTERNAL_PREFIX = b"\x00"


def add_to_value(owner: str, key: Union[str, bytes], current: Optional[bytes], amount: int) -> bytes:
    """The new value of counter ``key`` after adding ``amount`` (decimal ASCII, like torch)."""
    if current is None:
        return b"%d" % amount
    try:
        return b"%d" % (int(current) + amount)
    except ValueError:
        name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
        raise DistStoreError(f"{owner}: add: the value of key {name!r} is not an integer: {current[:64]!r}") from None


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


class KeyTable:
    """Values and queues, with torch's semantics; not thread-safe (the owner locks)."""

    __slots__ = ("values", "queues", "owner")

    def __init__(self, owner: str) -> None:
        self.values: Dict[bytes, bytes] = {}
        self.queues: Dict[bytes, Deque[bytes]] = {}
        self.owner = owner  # names the store in error messages

    def has(self, key: bytes) -> bool:
        return key in self.values or bool(self.queues.get(key))

    def missing(self, keys: Sequence[bytes]) -> List[bytes]:
        return [k for k in keys if not self.has(k)]

    def add(self, key: bytes, amount: int) -> bytes:
        value = add_to_value(self.owner, key, self.values.get(key), amount)
        self.values[key] = value
        return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> Tuple[bool, bytes]:
        store, result = compare_set_result(self.values.get(key), expected, desired)
        if store:
            self.values[key] = result
        return store, result

    def append(self, key: bytes, value: bytes) -> None:
        self.values[key] = self.values.get(key, b"") + value

    def delete(self, key: bytes) -> bool:
        return self.values.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.values)

    def list_keys(self) -> List[str]:
        return [k.decode("utf-8", "replace") for k in self.values if not k.startswith(INTERNAL_PREFIX)]

    def queue_push(self, key: bytes, value: bytes) -> None:
        self.queues.setdefault(key, deque()).append(value)

    def queue_pop(self, key: bytes) -> Optional[bytes]:
        """The oldest value of queue ``key``, or None when it is empty."""
        queue = self.queues.get(key)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self.queues[key]
        return value

    def queue_len(self, key: bytes) -> int:
        queue = self.queues.get(key)
        return len(queue) if queue else 0

    def clear(self) -> None:
        self.values.clear()
        self.queues.clear()
