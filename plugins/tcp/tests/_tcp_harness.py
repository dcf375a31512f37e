"""Test scaffolding for tdist-tcp: tiny stores, and worlds of ranks as threads or processes.

- :class:`DictStore`: an in-memory store shared by threads of one process.
- :class:`DirStore`: a store in a directory (one file per key), shared by processes.
- :func:`run_threads`: run ``body(backend, rank)`` on every rank of a world of threads.
- :class:`ProcWorld`: long-lived spawned worker processes (torch imported once) that
  each build a fresh backend per job, run a job function from ``_tcp_jobs`` and
  send back its result; dead workers are replaced on the next job.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

from tdist._errors import DistStoreTimeoutError
from tdist._store.base import Store, as_bytes


class DictStore(Store):
    def __init__(self, timeout: float = 30.0) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()

    def set(self, key, value):
        with self._cv:
            self._data[key] = as_bytes(value)
            self._cv.notify_all()

    def get(self, key, timeout=None):
        self.wait([key], timeout)
        with self._cv:
            return self._data[key]

    def add(self, key, amount):
        with self._cv:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def compare_set(self, key, expected, desired):
        with self._cv:
            current = self._data.get(key)
            if (current is None and not as_bytes(expected)) or current == as_bytes(expected):
                self._data[key] = as_bytes(desired)
                self._cv.notify_all()
            return self._data.get(key, b"")

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + self._limit(timeout)
        with self._cv:
            while not all(k in self._data for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self._data]
                    raise DistStoreTimeoutError(f"DictStore: timed out waiting for {missing}")
                self._cv.wait(left)

    def check(self, keys):
        with self._cv:
            return all(k in self._data for k in keys)

    def delete_key(self, key):
        with self._cv:
            return self._data.pop(key, None) is not None

    def num_keys(self):
        with self._cv:
            return len(self._data)


class DirStore(Store):
    """Keys are files named by their hex encoding; values are written atomically."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        super().__init__(timeout)
        self.path = path
        os.makedirs(path, exist_ok=True)

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.encode().hex())

    def set(self, key, value):
        tmp = f"{self._file(key)}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(as_bytes(value))
        os.replace(tmp, self._file(key))

    def get(self, key, timeout=None):
        self.wait([key], timeout)
        with open(self._file(key), "rb") as f:
            return f.read()

    def add(self, key, amount):
        import fcntl

        with open(os.path.join(self.path, "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                value = int(self.get(key, 0) if self.check([key]) else b"0") + amount
                self.set(key, str(value))
                return value
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def compare_set(self, key, expected, desired):
        raise NotImplementedError

    def wait(self, keys, timeout=None):
        deadline = time.monotonic() + self._limit(timeout)
        while not self.check(keys):
            if time.monotonic() > deadline:
                missing = [k for k in keys if not os.path.exists(self._file(k))]
                raise DistStoreTimeoutError(f"DirStore: timed out waiting for {missing}")
            time.sleep(0.002)

    def check(self, keys):
        return all(os.path.exists(self._file(k)) for k in keys)

    def delete_key(self, key):
        try:
            os.remove(self._file(key))
            return True
        except FileNotFoundError:
            return False

    def num_keys(self):
        return len([n for n in os.listdir(self.path) if not n.endswith(".tmp") and n != "lock"])


def make_backend(
    store: Store, rank: int, world: int, timeout: float = 10.0, options: Optional[dict] = None, secret: bytes = b""
):
    from tdist_tcp.backend import create_backend

    return create_backend(
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout),
        options=options or {},
        global_ranks=list(range(world)),
        secret=secret,
    )


class RankError(AssertionError):
    pass


def run_threads(
    world: int,
    body: Callable[[Any, int], Any],
    timeout: float = 30.0,
    backend_timeout: float = 10.0,
    options: Optional[dict] = None,
    store: Optional[Store] = None,
    ranks: Optional[Sequence[int]] = None,
    raise_errors: bool = True,
    secret: Union[bytes, Sequence[bytes]] = b"",
) -> list:
    """Run ``body(backend, rank)`` for every rank as threads of this process.

    Returns the per-rank results; with ``raise_errors=False`` a rank's exception is
    returned in its slot instead of being raised. ``secret``: the factory's, or one per rank.
    """
    store = store or DictStore()
    results: list = [None] * world
    errors: list = [None] * world

    def target(rank: int) -> None:
        backend = None
        try:
            key = secret if isinstance(secret, bytes) else secret[rank]
            backend = make_backend(store, rank, world, backend_timeout, options, key)
            results[rank] = body(backend, rank)
        except BaseException as exc:
            errors[rank] = exc
            exc.rank_traceback = traceback.format_exc()  # type: ignore[attr-defined]
        finally:
            if backend is not None:
                backend.shutdown()

    threads = [
        threading.Thread(target=target, args=(r,), name=f"test-rank-{r}", daemon=True)
        for r in (ranks if ranks is not None else range(world))
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [t.name for t in threads if t.is_alive()]
    if hung:
        raise RankError(f"ranks still running after {timeout} s: {hung}")
    if raise_errors:
        for rank, exc in enumerate(errors):
            if exc is not None:
                raise RankError(f"rank {rank} failed:\n{exc.rank_traceback}") from exc
        return results
    return [errors[r] if errors[r] is not None else results[r] for r in range(world)]


# ------------------------------------------------------------------ processes
def _worker_main(rank: int, world: int, conn: Any) -> None:
    import importlib

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            msg = None
        if msg is None:  # skip the interpreter's slow teardown (torch); backends are already shut down
            conn.close()
            os._exit(0)
        module, name, args, store_dir, options, backend_timeout, secret = msg
        backend = None
        try:
            fn = getattr(importlib.import_module(module), name)
            store = DirStore(store_dir)
            backend = make_backend(store, rank, world, backend_timeout, options, secret)
            backend.test_store = store
            reply = ("ok", fn(backend, rank, *args))
        except BaseException as exc:
            reply = ("err", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        finally:
            if backend is not None:
                backend.shutdown()
        conn.send(reply)


class ProcWorld:
    """``n`` spawned worker processes that run job functions of ``_tcp_jobs``."""

    def __init__(self, n: int, root: str) -> None:
        self.n = n
        self.root = root
        self.ctx = mp.get_context("spawn")
        self.procs: list = [None] * n
        self.conns: list = [None] * n
        self.jobs = 0
        for rank in range(n):
            self._spawn(rank)

    def _spawn(self, rank: int) -> None:
        parent, child = self.ctx.Pipe()
        proc = self.ctx.Process(
            target=_worker_main, args=(rank, self.n, child), daemon=True, name=f"tcp-test-rank{rank}"
        )
        proc.start()
        child.close()
        self.procs[rank], self.conns[rank] = proc, parent

    def ensure_alive(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self.conns[rank].close()
                self._spawn(rank)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def run(
        self,
        name: str,
        *args: Any,
        timeout: float = 30.0,
        options: Optional[dict] = None,
        backend_timeout: float = 10.0,
        dead_ok: Sequence[int] = (),
        during: Optional[Callable] = None,
        secret: bytes = b"",
    ) -> list:
        """Run ``_tcp_jobs.<name>(backend, rank, *args)`` on every rank; return the results.

        Ranks in ``dead_ok`` may die (their slot is then ``"dead"``). ``during(world, store_dir)``
        runs in this process while the job runs. ``secret``: the factory's (authenticates the mesh).
        """
        self.ensure_alive()
        self.jobs += 1
        store_dir = os.path.join(self.root, f"job{self.jobs}")
        os.makedirs(store_dir)
        for conn in self.conns:
            conn.send(("_tcp_jobs", name, args, store_dir, options or {}, backend_timeout, secret))
        if during is not None:
            during(self, store_dir)
        results: list = [None] * self.n
        deadline = time.monotonic() + timeout
        for rank, conn in enumerate(self.conns):
            while True:
                if conn.poll(0.05):
                    try:
                        results[rank] = conn.recv()
                    except EOFError:
                        results[rank] = ("dead",)
                    break
                if not self.procs[rank].is_alive():
                    results[rank] = ("dead",)
                    break
                if time.monotonic() > deadline:
                    self.kill_all()
                    raise RankError(f"job {name}: rank {rank} did not answer within {timeout} s (world killed)")
        out = []
        for rank, reply in enumerate(results):
            if reply[0] == "ok":
                out.append(reply[1])
            elif reply[0] == "dead" and rank in dead_ok:
                out.append("dead")
            elif reply[0] == "dead":
                raise RankError(f"job {name}: rank {rank} died")
            else:
                raise RankError(f"job {name}: rank {rank} failed: {reply[1]}\n{reply[2]}")
        return out

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.is_alive():
                proc.kill()
        for proc in self.procs:
            if proc is not None:
                proc.join(5)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            try:
                if proc.is_alive():
                    conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        self.kill_all()
