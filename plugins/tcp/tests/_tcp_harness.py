"""Test scaffolding for tdist-tcp: tiny stores, and worlds of ranks as threads or processes.

- :func:`dir_store`: tdist's FileStore in a job's directory, shared by its processes
  (threads of one process share a :class:`tdist.HashStore`).
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

from tdist.plugin import FileStore, HashStore, Store


def dir_store(path: str) -> Store:
    """A :class:`tdist.FileStore` in directory ``path`` (created if needed): the store the
    processes of one job share."""
    os.makedirs(path, exist_ok=True)
    return FileStore(os.path.join(path, "store"))


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
    store = store or HashStore()
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
            store = dir_store(store_dir)
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
