"""``FileStore``: a store kept in a file that every process of the job opens.

The file is an append-only log: an 8-byte header, then records
``op (u8) | key length (u32) | value length (u32) | key (UTF-8) | value``
(big-endian), where ``op`` is SET, DELETE, QUEUE_PUSH or QUEUE_POP. Writers append
under an exclusive ``fcntl.lockf`` lock; readers take a shared lock and replay only
what was appended since their last read into a :class:`KeyTable`. POSIX record locks
work across processes and over NFS. No pickle: keys and values are raw bytes.

Reference counting is torch's: every open store adds one to the bookkeeping counter
``refcount``, every close subtracts one and adds one to ``cleanup``; the close that
brings ``refcount`` to 0 with ``cleanup >= world_size`` (``world_size >= 0``) removes
the file. Both counters are keys of the store, so ``num_keys`` counts them as torch does.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct
import threading
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple, TypeVar, Union

from .._errors import DistStoreError
from .._oserror import describe
from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, QueueEmptyError, Store, Value, as_bytes, wait_timeout_error
from .table import INTERNAL_PREFIX, KeyTable, add_to_value

__all__ = ["FileStore"]

T = TypeVar("T")

_HEADER = b"TDFSTOR\x02"
_RECORD = struct.Struct("!BII")
_SET, _DELETE, _QUEUE_PUSH, _QUEUE_POP = 1, 2, 3, 4
_REFCOUNT = INTERNAL_PREFIX + b"refcount"
_CLEANUP = INTERNAL_PREFIX + b"cleanup"
_MAX_POLL_DELAY = 0.01

Record = Tuple[int, bytes, bytes]

# POSIX locks belong to a process, not to a file descriptor, and closing *any*
# descriptor of a file drops all of the process's locks on it. Instances of this
# process that share a file therefore also share one thread lock, held around
# every fcntl lock and around closing.
_PATH_LOCKS: Dict[str, threading.Lock] = {}
_PATH_LOCKS_GUARD = threading.Lock()


def _path_lock(path: str) -> threading.Lock:
    with _PATH_LOCKS_GUARD:
        return _PATH_LOCKS.setdefault(path, threading.Lock())


class FileStore(Store):
    """A store shared through the file at ``path`` (created if missing, mode 0600).

    Works across processes on one host or over a shared (NFS) file system. Blocking
    calls poll the file (sleeping 0.5 ms, growing to 10 ms) until their keys appear or
    the timeout passes.

    Clean-up (torch's reference counting): the file is removed by the last ``close()`` of
    the stores open on it, once at least ``world_size`` stores have closed; with
    ``world_size`` < 0 it is never removed. Dropping the last reference to a store closes it.
    """

    def __init__(
        self, path: Union[str, "os.PathLike[str]"], world_size: int = -1, timeout: Timeout = DEFAULT_STORE_TIMEOUT
    ) -> None:
        super().__init__(timeout)
        self._fd: Optional[int] = None
        self._path = os.fspath(path)
        self._where = f"FileStore {self._path}"
        self._world_size = int(world_size)
        self._lock = _path_lock(os.path.realpath(self._path))
        self._table = KeyTable(self._where)
        self._offset = 0
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DistStoreError(f"{self._where}: cannot open the store file: {describe(exc)}") from exc
        try:
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):  # a device, a FIFO: no log, and never removed
                raise DistStoreError(
                    f"{self._where}: not a regular file; a FileStore needs a file it can append to and remove"
                )
            with self._locked(exclusive=True) as fd:
                self._append(fd, [self._count(_REFCOUNT, 1)])
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    @property
    def path(self) -> str:
        """The store file's path."""
        return self._path

    @property
    def world_size(self) -> int:
        """How many stores must have closed before the last close removes the file (< 0: never)."""
        return self._world_size

    def __repr__(self) -> str:
        return f"<FileStore {self._path!r} world_size={self._world_size}>"

    # ------------------------------------------------------------------ file log
    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        with self._lock:
            fd = self._fd
            if fd is None:
                raise DistStoreError(f"{self._where}: the store is closed")
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            except OSError as exc:
                raise DistStoreError(f"{self._where}: cannot lock the store file: {exc}") from exc
            try:
                self._sync(fd)
                yield fd
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def _sync(self, fd: int) -> None:
        """Apply the records appended since the last read (lock held)."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # the file was truncated or replaced: start over
            self._table.clear()
            self._offset = 0
        if size == self._offset:
            return
        chunks: List[bytes] = []
        pos = self._offset
        while pos < size:
            chunk = os.pread(fd, size - pos, pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        buf = memoryview(b"".join(chunks))
        pos = 0
        if self._offset == 0:
            if len(buf) < len(_HEADER):
                return  # a header still being written (or torn by a crash)
            if bytes(buf[: len(_HEADER)]) != _HEADER:
                raise DistStoreError(f"{self._where}: the file is not a tdist FileStore (bad header)")
            pos = len(_HEADER)
        while pos + _RECORD.size <= len(buf):
            op, klen, vlen = _RECORD.unpack_from(buf, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(buf):
                break  # a torn record from a writer that crashed mid-write
            key = bytes(buf[pos + _RECORD.size : pos + _RECORD.size + klen])
            value = bytes(buf[pos + _RECORD.size + klen : end])
            self._apply(op, key, value, self._offset + pos)
            pos = end
        self._offset += pos

    def _apply(self, op: int, key: bytes, value: bytes, at: int) -> None:
        table = self._table
        if op == _SET:
            table.values[key] = value
        elif op == _DELETE:
            table.values.pop(key, None)
        elif op == _QUEUE_PUSH:
            table.queue_push(key, value)
        elif op == _QUEUE_POP:
            table.queue_pop(key)
        else:
            raise DistStoreError(f"{self._where}: corrupt store file (record type {op} at byte {at})")

    def _append(self, fd: int, records: Sequence[Record]) -> None:
        """Append ``records`` in one write and apply them (exclusive lock held, file synced)."""
        parts = [_HEADER] if self._offset == 0 else []
        for op, key, value in records:
            parts += [_RECORD.pack(op, len(key), len(value)), key, value]
        try:
            if os.fstat(fd).st_size != self._offset:
                os.ftruncate(fd, self._offset)  # drop a torn tail left by a crashed writer
            view = memoryview(b"".join(parts))
            pos = self._offset
            while view:
                written = os.pwrite(fd, view, pos)
                view = view[written:]
                pos += written
        except OSError as exc:  # e.g. ENOSPC: the file system is full
            try:
                os.ftruncate(fd, self._offset)  # leave no torn record behind
            except OSError:
                pass
            raise DistStoreError(f"{self._where}: cannot write to the store file: {describe(exc)}") from exc
        self._sync(fd)

    def _count(self, key: bytes, amount: int) -> Record:
        """The SET record that adds ``amount`` to counter ``key`` (lock held, file synced)."""
        return _SET, key, add_to_value(self._where, key, self._table.values.get(key), int(amount))

    def _poll(
        self, ready: Callable[[], Optional[T]], keys: Sequence[str], timeout: Timeout, exclusive: bool = False
    ) -> T:
        """Poll the file until ``ready()`` (called with the lock held, synced) is not None."""
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        delay = 0.0005
        while True:
            with self._locked(exclusive):
                result = ready()
                if result is not None:
                    return result
                missing = [k for k in keys if not self._table.has(k.encode())]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise wait_timeout_error(self._where, limit, missing or list(keys))
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL_DELAY)

    # ------------------------------------------------------------------ Store API
    def set(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._append(fd, [(_SET, key.encode(), data)])

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        k = key.encode()
        return self._poll(lambda: self._table.values.get(k), [key], timeout)

    def add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True) as fd:
            record = self._count(key.encode(), amount)
            self._append(fd, [record])
        return int(record[2])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        k = key.encode()
        expected_b, desired_b = as_bytes(expected), as_bytes(desired)
        with self._locked(exclusive=True) as fd:
            stored, result = self._table.compare_set(k, expected_b, desired_b)
            if stored:
                self._append(fd, [(_SET, k, result)])
        return result

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        encoded = [k.encode() for k in keys]
        self._poll(lambda: True if not self._table.missing(encoded) else None, list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with self._locked(exclusive=False):
            return not self._table.missing([k.encode() for k in keys])

    def delete_key(self, key: str) -> bool:
        k = key.encode()
        with self._locked(exclusive=True) as fd:
            if k not in self._table.values:
                return False
            self._append(fd, [(_DELETE, k, b"")])
            return True

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            return self._table.num_keys()

    # ------------------------------------------------------------- extended API
    def has_extended_api(self) -> bool:
        return True

    def append(self, key: str, value: Value) -> None:
        k, data = key.encode(), as_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._append(fd, [(_SET, k, self._table.values.get(k, b"") + data)])

    def multi_get(self, keys: Sequence[str]) -> List[bytes]:
        encoded = [k.encode() for k in keys]
        values = self._table.values

        def ready() -> Optional[List[bytes]]:
            return None if any(k not in values for k in encoded) else [values[k] for k in encoded]

        return self._poll(ready, list(keys), None)

    def multi_set(self, keys: Sequence[str], values: Sequence[Value]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"{self._where}: multi_set: {len(keys)} keys but {len(values)} values")
        records = [(_SET, k.encode(), as_bytes(v)) for k, v in zip(keys, values)]
        with self._locked(exclusive=True) as fd:
            self._append(fd, records)

    def list_keys(self) -> List[str]:
        with self._locked(exclusive=False):
            return self._table.list_keys()

    def queue_push(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._append(fd, [(_QUEUE_PUSH, key.encode(), data)])

    def queue_pop(self, key: str, block: bool = True, timeout: Timeout = None) -> bytes:
        k = key.encode()

        def pop() -> Optional[bytes]:  # exclusive lock held
            queue = self._table.queues.get(k)
            if not queue:
                return None
            value = queue[0]
            assert self._fd is not None
            self._append(self._fd, [(_QUEUE_POP, k, b"")])
            return value

        if not block:
            with self._locked(exclusive=True):
                value = pop()
            if value is None:
                raise QueueEmptyError(f"{self._where}: queue_pop: queue {key!r} is empty")
            return value
        return self._poll(pop, [key], timeout, exclusive=True)

    def queue_len(self, key: str) -> int:
        with self._locked(exclusive=False):
            return self._table.queue_len(key.encode())

    def clone(self) -> "FileStore":
        """Another store on the same file (it counts as one more user)."""
        return FileStore(self._path, self._world_size, self.timeout)

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Close the file; the last close of the stores open on it may remove it (see the class)."""
        self._close(blocking=True)

    def _close(self, blocking: bool) -> None:
        if not self._lock.acquire(blocking):
            return  # __del__ while this thread holds the path's lock: leave the descriptor open
        try:
            fd = self._fd
            if fd is None:
                return
            try:
                self._leave(fd)
            finally:
                self._fd = None
                os.close(fd)
        finally:
            self._lock.release()

    def _leave(self, fd: int) -> None:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            self._sync(fd)
            self._append(fd, [self._count(_CLEANUP, 1), self._count(_REFCOUNT, -1)])
            users = int(self._table.values.get(_REFCOUNT, b"0"))
            closed = int(self._table.values.get(_CLEANUP, b"0"))
            if users > 0 or self._world_size < 0 or closed < self._world_size:
                return
            try:  # remove only if the path still names our file
                st, mine = os.stat(self._path), os.fstat(fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self._path)
            except FileNotFoundError:
                pass
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)

    def __del__(self) -> None:
        try:
            self._close(blocking=False)
        except Exception:  # interpreter shutdown or a vanished file: nothing to report to
            pass
