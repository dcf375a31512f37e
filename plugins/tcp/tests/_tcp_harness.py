"""Test scaffolding for tdist-tcp: tiny stores, and worlds of ranks as threads or processes.

- :func:`dir_store`: tdist's FileStore in a job's directory, shared by its processes
  (threads of one process share a :class:`tdist.HashStore`); :func:`record`: a rank's
  record of a group's setup in such a store.
- :func:`run_threads`: run ``body(backend, rank)`` on every rank of a world of threads.
- :class:`ProcWorld`: long-lived worker processes (a :class:`tdist.testing.World`) that
  each build a fresh backend per job, run a job function from ``_tcp_jobs`` and
  send back its result; dead workers are replaced on the next job.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

from tdist.plugin import FileStore, HashStore, Store
from tdist.testing import RankFailure, World


def record(store: Store, rank: int, timeout: float = 30.0) -> Any:
    """Rank ``rank``'s record of the group's setup in ``store`` (:class:`tdist_tcp.net.roster.Record`:
    where it listens; rank 0's also the group nonce), waiting for it up to ``timeout`` s."""
    from tdist_tcp.net.roster import RECORD_KEY, Record

    return Record.decode(store.get(RECORD_KEY.format(rank), timeout=timeout), rank)


def dir_store(path: str) -> Store:
    """A :class:`tdist.FileStore` in directory ``path`` (created if needed): the store the
    processes of one job share."""
    os.makedirs(path, exist_ok=True)
    return FileStore(os.path.join(path, "store"))


def make_backend(
    store: Store, rank: int, world: int, timeout: float = 10.0, options: Optional[dict] = None, secret: bytes = b""
):
    from tdist_tcp.factory import create_backend

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
    options: Union[None, dict, Sequence[Optional[dict]]] = None,
    store: Optional[Store] = None,
    ranks: Optional[Sequence[int]] = None,
    raise_errors: bool = True,
    secret: Union[bytes, Sequence[bytes]] = b"",
) -> list:
    """Run ``body(backend, rank)`` for every rank as threads of this process.

    Returns the per-rank results; with ``raise_errors=False`` a rank's exception is
    returned in its slot instead of being raised. ``options`` and ``secret``: the
    factory's, or one per rank.
    """
    store = store or HashStore()
    results: list = [None] * world
    errors: list = [None] * world

    def target(rank: int) -> None:
        backend = None
        try:
            key = secret if isinstance(secret, bytes) else secret[rank]
            mine = options if options is None or isinstance(options, dict) else options[rank]
            backend = make_backend(store, rank, world, backend_timeout, mine, key)
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
def run_tcp_job(name: str, args: tuple, store_dir: str, options: dict, backend_timeout: float, secret: bytes) -> Any:
    """On a :class:`ProcWorld` worker: ``_tcp_jobs.<name>(backend, rank, *args)`` with a fresh
    backend over the job's directory store; the backend is shut down afterwards."""
    import _tcp_jobs

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dir_store(store_dir)
    backend = make_backend(store, rank, world, backend_timeout, options, secret)
    backend.test_store = store
    try:
        return getattr(_tcp_jobs, name)(backend, rank, *args)
    finally:
        backend.shutdown()


class ProcWorld:
    """``n`` long-lived worker processes (a :class:`tdist.testing.World` without a process
    group: torch is imported once) that run job functions of ``_tcp_jobs``, each job with
    a fresh backend and its own store directory under ``root``. Workers that die are
    replaced on the next job; the survivors stay (their state can be inspected)."""

    def __init__(self, n: int, root: str) -> None:
        self.n = n
        self.root = root
        self.jobs = 0
        self.world = World("tcp", n, init=False).start()

    def pids(self) -> list[Optional[int]]:
        """Each rank's worker pid (None for a dead rank not replaced yet)."""
        pids = self.world.pids
        return [pids.get(rank) for rank in range(self.n)]

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
        self.jobs += 1
        store_dir = os.path.join(self.root, f"job{self.jobs}")
        os.makedirs(store_dir)
        job = dict(name=name, args=args, store_dir=store_dir, options=options or {})
        pending = self.world.submit(run_tcp_job, timeout=timeout, backend_timeout=backend_timeout, secret=secret, **job)
        try:
            if during is not None:
                during(self, store_dir)
        finally:
            outcomes = pending.outcomes()
        allowed = [
            rank in dead_ok and isinstance(o, RankFailure) and o.kind == "died" for rank, o in enumerate(outcomes)
        ]
        if any(isinstance(o, RankFailure) and not ok for o, ok in zip(outcomes, allowed)):
            raise self.world.error_for(f"_tcp_jobs:{name}", outcomes)
        return ["dead" if ok else o for o, ok in zip(outcomes, allowed)]

    def close(self) -> None:
        self.world.close()
