"""``FileStore``: a store kept in a file that every process of the job opens.

The file is an append-only log: an 8-byte header, then records
``op (u8) | key length (u32) | value length (u32) | key (UTF-8) | value``
(big-endian), where ``op`` is SET, DELETE or LEAVE (a user closed the store).
Writers append under an exclusive ``fcntl.lockf`` lock; readers take a shared
lock and parse only what was appended since their last read. POSIX record locks
work across processes and over NFS. No pickle: keys and values are raw bytes.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Sequence, Union

from .._errors import DistStoreError, DistStoreTimeoutError
from .._work import Timeout
from .base import DEFAULT_STORE_TIMEOUT, Store, Value, as_bytes
from .hash_store import add_to_value, compare_set_result

__all__ = ["FileStore"]

_HEADER = b"TDFSTOR\x01"
_RECORD = struct.Struct("!BII")
_SET, _DELETE, _LEAVE = 1, 2, 3
_MAX_POLL_DELAY = 0.01

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

    Works across processes on one host or over a shared (NFS) file system.
    ``get``/``wait`` poll the file (sleeping 0.5 ms, growing to 10 ms) until the
    keys appear or the timeout passes.

    Clean-up: when ``world_size`` > 0, each instance's ``close()`` records that a
    user left, and the close that brings the count to ``world_size`` deletes the
    file, so the next job can reuse the path. Every FileStore instance counts as one
    user, so open exactly ``world_size`` of them (one per process). With
    ``world_size`` <= 0 the file is never deleted.
    """

    def __init__(self, path: Union[str, "os.PathLike[str]"], world_size: int = -1,
                 timeout: Timeout = DEFAULT_STORE_TIMEOUT) -> None:
        super().__init__(timeout)
        self._path = os.fspath(path)
        self._world_size = int(world_size)
        self._lock = _path_lock(os.path.realpath(self._path))
        self._data: Dict[str, bytes] = {}
        self._leaves = 0
        self._offset = 0
        try:
            self._fd: Optional[int] = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise DistStoreError(f"FileStore {self._path}: cannot open the store file: {exc}") from exc

    @property
    def path(self) -> str:
        """The store file's path."""
        return self._path

    @property
    def world_size(self) -> int:
        """The number of users whose ``close()`` deletes the file (<= 0: never)."""
        return self._world_size

    def __repr__(self) -> str:
        return f"<FileStore {self._path!r} world_size={self._world_size}>"

    # ------------------------------------------------------------------ file log
    @contextmanager
    def _locked(self, exclusive: bool) -> Iterator[int]:
        with self._lock:
            fd = self._fd
            if fd is None:
                raise DistStoreError(f"FileStore {self._path}: the store is closed")
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            except OSError as exc:
                raise DistStoreError(f"FileStore {self._path}: cannot lock the store file: {exc}") from exc
            try:
                self._sync(fd)
                yield fd
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def _sync(self, fd: int) -> None:
        """Apply the records appended since the last read (lock held)."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # the file was truncated or replaced: start over
            self._data.clear()
            self._leaves = 0
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
                raise DistStoreError(f"FileStore {self._path}: the file is not a tdist FileStore (bad header)")
            pos = len(_HEADER)
        while pos + _RECORD.size <= len(buf):
            op, klen, vlen = _RECORD.unpack_from(buf, pos)
            end = pos + _RECORD.size + klen + vlen
            if end > len(buf):
                break  # a torn record from a writer that crashed mid-write
            key = bytes(buf[pos + _RECORD.size : pos + _RECORD.size + klen]).decode("utf-8", "replace")
            if op == _SET:
                self._data[key] = bytes(buf[pos + _RECORD.size + klen : end])
            elif op == _DELETE:
                self._data.pop(key, None)
            elif op == _LEAVE:
                self._leaves += 1
            else:
                where = self._offset + pos
                raise DistStoreError(f"FileStore {self._path}: corrupt store file (record type {op} at byte {where})")
            pos = end
        self._offset += pos

    def _append(self, fd: int, op: int, key: str = "", value: bytes = b"") -> None:
        """Append one record and apply it (exclusive lock held, file synced)."""
        kbytes = key.encode()
        record = _RECORD.pack(op, len(kbytes), len(value)) + kbytes + value
        if os.fstat(fd).st_size != self._offset:
            os.ftruncate(fd, self._offset)  # drop a torn tail left by a crashed writer
        if self._offset == 0:
            record = _HEADER + record
        view = memoryview(record)
        pos = self._offset
        while view:
            written = os.pwrite(fd, view, pos)
            view = view[written:]
            pos += written
        self._sync(fd)

    def _wait_for(self, keys: Sequence[str], timeout: Timeout) -> List[bytes]:
        limit = self._limit(timeout)
        deadline = time.monotonic() + limit
        delay = 0.0005
        while True:
            with self._locked(exclusive=False):
                missing = [k for k in keys if k not in self._data]
                if not missing:
                    return [self._data[k] for k in keys]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistStoreTimeoutError(
                    f"FileStore {self._path}: timed out after {limit:g} s waiting for keys {missing}")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_POLL_DELAY)

    # ------------------------------------------------------------------ Store API
    def set(self, key: str, value: Value) -> None:
        data = as_bytes(value)
        with self._locked(exclusive=True) as fd:
            self._append(fd, _SET, key, data)

    def get(self, key: str, timeout: Timeout = None) -> bytes:
        return self._wait_for([key], timeout)[0]

    def add(self, key: str, amount: int) -> int:
        with self._locked(exclusive=True) as fd:
            value = add_to_value(f"FileStore {self._path}", key, self._data.get(key), amount)
            self._append(fd, _SET, key, value)
        return int(value)

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        expected_b, desired_b = as_bytes(expected), as_bytes(desired)
        with self._locked(exclusive=True) as fd:
            store, result = compare_set_result(self._data.get(key), expected_b, desired_b)
            if store:
                self._append(fd, _SET, key, result)
        return result

    def wait(self, keys: Sequence[str], timeout: Timeout = None) -> None:
        self._wait_for(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        with self._locked(exclusive=False):
            return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._locked(exclusive=True) as fd:
            if key not in self._data:
                return False
            self._append(fd, _DELETE, key)
            return True

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            return len(self._data)

    def close(self) -> None:
        """Close the file; with ``world_size`` > 0, the last user's close deletes it."""
        self._close(blocking=True)

    def _close(self, blocking: bool) -> None:
        if not self._lock.acquire(blocking):
            return  # __del__ while this thread holds the path's lock: leave the descriptor open
        try:
            fd = self._fd
            if fd is None:
                return
            try:
                if self._world_size > 0:
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
            self._append(fd, _LEAVE)
            if self._leaves < self._world_size:
                return
            try:  # delete only if the path still names our file
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
