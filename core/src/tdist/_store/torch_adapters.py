"""Stores both ways: a ``torch.distributed.Store`` used as a tdist :class:`Store`
(:class:`TorchStore`), and a tdist store handed to torch (:func:`as_torch_store`).

Neither adapter copies data or opens a connection: every call, the extended API included
(``append``, ``multi_get``, ``multi_set``, queues, ``list_keys``, ``barrier``, ``clone``), is
forwarded to the wrapped store. Wrapping an adapter again gives back the store it wraps, so a
store that travels tdist -> torch -> tdist is the original object.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, TypeVar

from .._errors import DistError, DistStoreError, DistStoreTimeoutError
from .._work import Timeout
from .base import QueueEmptyError, Store, Value, as_bytes

if TYPE_CHECKING:
    import torch.distributed

__all__ = ["TorchStore", "as_torch_store", "from_torch_store"]

T = TypeVar("T")


def _is_timeout(exc: BaseException) -> bool:
    return "timeout" in str(exc).lower() or isinstance(exc, TimeoutError)


class TorchStore(Store):
    """A tdist :class:`Store` backed by a ``torch.distributed.Store`` (for example the
    TCPStore torchrun's agent serves, or the store torch passes a backend).

    Errors come back as tdist's: a timeout as :class:`DistStoreTimeoutError` naming the
    keys, an empty queue as :class:`QueueEmptyError`, anything else the torch store raises
    as :class:`DistStoreError`; NotImplementedError (a torch store without queues) passes as is.
    """

    def __init__(self, store: "torch.distributed.Store", timeout: Timeout = None) -> None:
        own = getattr(store, "timeout", None)
        default = timeout if timeout is not None else own
        super().__init__(default if default is not None else timedelta(seconds=300))
        self.torch_store: Any = store  # torch's stubs miss half of Store's methods and type values as str
        if timeout is not None:
            store.set_timeout(self.timeout)

    def __repr__(self) -> str:
        return f"<TorchStore over {type(self.torch_store).__name__}>"

    def _call(self, what: str, keys: Sequence[str], call: Callable[[], T], limit: Optional[float] = None) -> T:
        """Run ``call`` and translate torch's errors (RuntimeError subclasses) into tdist's."""
        import torch.distributed as torch_dist

        try:
            return call()
        except NotImplementedError:
            raise
        except torch_dist.QueueEmptyError as exc:
            raise QueueEmptyError(f"TorchStore: {what}: queue {keys[0]!r} is empty ({exc})") from None
        except RuntimeError as exc:
            raise self._fail(what, keys, exc, limit) from None

    def _fail(self, what: str, keys: Sequence[str], exc: BaseException, limit: Optional[float] = None) -> DistError:
        if _is_timeout(exc):
            after = f" after {limit:g} s" if limit is not None else ""
            return DistStoreTimeoutError(f"TorchStore: {what} timeout{after} waiting for keys {list(keys)} ({exc})")
        return DistStoreError(f"TorchStore: {what} of keys {list(keys)} failed: {type(exc).__name__}: {exc}")

    def set_timeout(self, timeout: Timeout) -> None:
        super().set_timeout(timeout)
        self.torch_store.set_timeout(self.timeout)

    def set(self, key: str, value: Value) -> None:
        self._call("set", [key], lambda: self.torch_store.set(key, as_bytes(value)))

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        if timeout is not None:
            self.wait([key], timeout)
        return bytes(self._call("get", [key], lambda: self.torch_store.get(key), self._limit(None)))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key], lambda: self.torch_store.add(key, int(amount))))

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return bytes(
            self._call(
                "compare_set", [key], lambda: self.torch_store.compare_set(key, as_bytes(expected), as_bytes(desired))
            )
        )

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        limit = self._limit(timeout)
        self._call("wait", keys, lambda: self.torch_store.wait(list(keys), timedelta(seconds=limit)), limit)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._call("check", keys, lambda: self.torch_store.check(list(keys))))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", [key], lambda: self.torch_store.delete_key(key)))

    def num_keys(self) -> int:
        return int(self._call("num_keys", [], lambda: self.torch_store.num_keys()))

    # ------------------------------------------------------------- extended API
    def has_extended_api(self) -> bool:
        return bool(self.torch_store.has_extended_api())

    def append(self, key: str, value: Value) -> None:
        self._call("append", [key], lambda: self.torch_store.append(key, as_bytes(value)))

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        values = self._call("multi_get", keys, lambda: self.torch_store.multi_get(list(keys)), self._limit(None))
        return [bytes(v) for v in values]

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"TorchStore.multi_set: {len(keys)} keys but {len(values)} values")
        data = [as_bytes(v) for v in values]
        self._call("multi_set", keys, lambda: self.torch_store.multi_set(list(keys), data))

    def list_keys(self) -> List[str]:
        return list(self._call("list_keys", [], lambda: self.torch_store.list_keys()))

    def barrier(self, key: str, world_size: int, timeout: Timeout = None) -> None:
        limit = self._limit(timeout)
        self._call("barrier", [key], lambda: self.torch_store.barrier(key, world_size, timedelta(seconds=limit)), limit)

    def clone(self) -> "TorchStore":
        return TorchStore(self._call("clone", [], lambda: self.torch_store.clone()), self.timeout)

    def queue_push(self, key: str, value: Value) -> None:
        self._call("queue_push", [key], lambda: self.torch_store.queue_push(key, as_bytes(value)))

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        if block and timeout is not None:
            self.wait([key], timeout)  # torch's queue_pop waits the store's timeout: honour a shorter one first
        return bytes(self._call("queue_pop", [key], lambda: self.torch_store.queue_pop(key, block), self._limit(None)))

    def queue_len(self, key: str) -> int:
        return int(self._call("queue_len", [key], lambda: self.torch_store.queue_len(key)))


def _torch_store_class() -> Any:
    """The ``torch.distributed.Store`` subclass over a tdist store (built on first use, so
    importing tdist does not import torch.distributed)."""
    global _TdistBackedStore
    if _TdistBackedStore is not None:
        return _TdistBackedStore
    import torch.distributed as torch_dist

    class TdistBackedStore(torch_dist.Store):
        """A ``torch.distributed.Store`` whose every call goes to a tdist store; tdist's
        timeout errors reach torch as ``torch.distributed.DistStoreError`` ("... timeout ..."),
        an empty queue as ``torch.distributed.QueueEmptyError``."""

        def __init__(self, store: Store) -> None:
            super().__init__()
            self.tdist_store = store

        def _call(self, method: str, *args: Any) -> Any:
            try:
                return getattr(self.tdist_store, method)(*args)
            except QueueEmptyError as exc:
                raise torch_dist.QueueEmptyError(str(exc)) from exc
            except DistStoreError as exc:
                text = str(exc)
                if isinstance(exc, DistStoreTimeoutError) and "timeout" not in text.lower():
                    text = f"timeout: {text}"  # torch's callers match on the word
                raise torch_dist.DistStoreError(text) from exc

        def set(self, key: str, value: Any) -> None:
            self._call("set", key, value)

        def get(self, key: str) -> bytes:
            return self._call("get", key)

        def add(self, key: str, amount: int) -> int:
            return self._call("add", key, amount)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self._call("compare_set", key, expected, desired)

        def wait(self, keys: Sequence[str], timeout: Optional[timedelta] = None) -> None:
            self._call("wait", list(keys), timeout)

        def check(self, keys: Sequence[str]) -> bool:
            return self._call("check", list(keys))

        def delete_key(self, key: str) -> bool:
            return self._call("delete_key", key)

        def num_keys(self) -> int:
            return self._call("num_keys")

        def set_timeout(self, timeout: timedelta) -> None:
            self.tdist_store.set_timeout(timeout)

        def has_extended_api(self) -> bool:
            return self.tdist_store.has_extended_api()

        def append(self, key: str, value: Any) -> None:
            self._call("append", key, value)

        def multi_get(self, keys: Sequence[str]) -> List[bytes]:
            return self._call("multi_get", list(keys))

        def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
            self._call("multi_set", list(keys), list(values))

        def list_keys(self) -> List[str]:
            return self._call("list_keys")

        def barrier(self, key: str, world_size: int, timeout: Optional[timedelta] = None) -> None:
            self._call("barrier", key, world_size, timeout)

        def clone(self) -> "torch.distributed.Store":
            return as_torch_store(self._call("clone"))  # kept alive: torch's C++ side may be its only holder

        def queue_push(self, key: str, value: Any) -> None:
            self._call("queue_push", key, value)

        def queue_pop(self, key: str, block: bool = True) -> bytes:
            return self._call("queue_pop", key, block)

        def queue_len(self, key: str) -> int:
            return self._call("queue_len", key)

        # torch's C++ callers (a PrefixStore over this store) look these up by their C++ names.
        getNumKeys = num_keys  # noqa: N815
        deleteKey = delete_key  # noqa: N815

    _TdistBackedStore = TdistBackedStore
    return TdistBackedStore


_TdistBackedStore: Any = None

#: Every adapter made, kept alive for the process: torch's C++ side (a PrefixStore, a
#: process group) holds the adapter without a Python reference, and pybind forwards its
#: calls to the Python methods only while the Python object lives.
_ADAPTERS: list[Any] = []


def as_torch_store(store: Store) -> "torch.distributed.Store":
    """``store`` as a ``torch.distributed.Store`` (what ``torch.distributed.init_process_group(store=...)``,
    torch's ``PrefixStore`` and torch's backends take); one adapter per store, which lives
    as long as the process. A :class:`TorchStore` gives back the torch store it wraps."""
    if isinstance(store, TorchStore):
        return store.torch_store
    if not isinstance(store, Store):
        raise TypeError(f"as_torch_store: expected a tdist Store, got {type(store).__name__}")
    adapter = getattr(store, "_torch_adapter", None)
    if adapter is None:
        adapter = _torch_store_class()(store)
        store._torch_adapter = adapter  # type: ignore[attr-defined]
        _ADAPTERS.append(adapter)
    return adapter


def from_torch_store(store: Any, timeout: Timeout = None) -> Store:
    """A ``torch.distributed.Store`` as a tdist :class:`Store`; a store :func:`as_torch_store`
    made gives back the tdist store it wraps."""
    inner = getattr(store, "tdist_store", None)
    if isinstance(inner, Store):
        return inner
    return TorchStore(store, timeout)
