"""``World``: N worker processes started once that run many test bodies.

A controller (the pytest process) listens on 127.0.0.1, starts the workers
(``python -m tdist.testing._worker``, one process each, or the whole world
under one ``mpirun``), waits for each to connect back, prove it knows the
world's random token (and check that the controller does: see
:mod:`tdist.testing._protocol`) and say its rank, asks
them to ``init_process_group`` and then sends them bodies to run: a
module-level function, by ``module:qualname``, with keyword arguments. Every
rank runs the same call at once; the controller collects one reply per rank.

A body that hangs past its timeout gets the world killed (SIGKILL to every
process group it made), an error that names the ranks that did not answer and
shows their stacks, and the world marked dead; a pooled world restarts on its
next use. ``World.spawn`` makes a one-off world for failure scenarios that is
never reused and always killed. Every world still alive at interpreter exit is
killed by an ``atexit`` hook, and workers exit by themselves when the
controller's connection closes.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from .._local import find_mpirun, free_port
from ._common import (
    BACKEND_ENV,
    CONTROLLER_ENV,
    DIST_MODULE_ENV,
    LAUNCHER_ENV,
    SYS_PATH_ENV,
    TOKEN_ENV,
    WORLD_SIZE_ENV,
    dist_module_name,
    fn_ref,
)
from ._protocol import read_messages, send_msg, worker_hello
from ._workers import Workers
from .outcomes import (
    NOT_THIS_CALL,
    RankFailure,
    WorldError,
    WorldRunError,
    WorldStartError,
    WorldTimeoutError,
    failures_first,
    indent,
    reply_outcome,
)

__all__ = [
    "World",
    "RankFailure",
    "failures_first",
    "WorldError",
    "WorldRunError",
    "WorldTimeoutError",
    "WorldStartError",
    "LAUNCHERS",
    "free_port",
    "find_mpirun",
]

#: How a world's processes are started: one ``subprocess`` per rank ("env"), or
#: all ranks under a single ``mpirun`` ("mpi").
LAUNCHERS = ("env", "mpi")

_INIT_REF = "tdist.testing._worker:init_process_group"
_HEALTH_REF = "tdist.testing._worker:health_check"


_LIVE: "weakref.WeakSet[World]" = weakref.WeakSet()


@atexit.register
def _kill_all_worlds() -> None:
    for world in list(_LIVE):
        try:
            world.kill()
        except Exception:
            pass


class _Pending:
    """A call sent to every rank whose replies have not all been collected yet."""

    def __init__(
        self, world: "World", call_id: int, ref: str, timeout: float, fail_fast: Optional[float] = None
    ) -> None:
        self.world = world
        self.call_id = call_id
        self.ref = ref
        self.timeout = timeout
        self.fail_fast = fail_fast
        self.sent_at = time.monotonic()

    def outcomes(self) -> list[Any]:
        """Wait for every rank (up to the call's timeout); see :meth:`World.try_run`."""
        return self.world._collect(self)


class World:
    """``world_size`` worker processes running the module under test with ``backend``.

    ``launcher``: ``"env"`` (one subprocess per rank, env:// rendezvous) or
    ``"mpi"`` (one ``mpirun -n N``). ``init_method``: passed to
    ``init_process_group`` (``env://`` uses MASTER_ADDR/MASTER_PORT, which the
    world sets). ``pg_timeout``: the process group's timeout in seconds.
    ``ranks``: which ranks to start (default all; fewer for the missing-peer
    scenario). ``init``: whether :meth:`start` initialises the process group;
    a world without one (env launcher) keeps its survivors when bodies raise or
    ranks die (the bodies own what they build), and its next call starts new
    workers for the dead ranks only; a timeout still kills the whole world.
    ``restartable``: whether a dead world may start again on its next use
    (pooled worlds yes, :meth:`spawn` worlds no).
    """

    def __init__(
        self,
        backend: str,
        world_size: int,
        *,
        launcher: str = "env",
        init_method: Optional[str] = "env://",
        pg_timeout: float = 30.0,
        start_timeout: float = 120.0,
        dist_module: Optional[str] = None,
        env: Optional[dict[str, str]] = None,
        ranks: Optional[Sequence[int]] = None,
        init: bool = True,
        init_kwargs: Optional[dict[str, Any]] = None,
        restartable: bool = True,
        mpirun: Optional[str] = None,
        mpirun_args: Sequence[str] = (),
    ) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"tdist.testing: unknown launcher {launcher!r} (known: {', '.join(LAUNCHERS)})")
        if world_size < 1:
            raise ValueError(f"tdist.testing: world_size must be >= 1, got {world_size}")
        self.backend = backend
        self.world_size = world_size
        self.launcher = launcher
        self.init_method = init_method
        self.pg_timeout = pg_timeout
        self.start_timeout = start_timeout
        self.dist_module = dist_module or dist_module_name()
        self.extra_env = dict(env or {})
        self.ranks = list(range(world_size)) if ranks is None else sorted(ranks)
        if any(r < 0 or r >= world_size for r in self.ranks) or len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"tdist.testing: ranks {list(ranks or [])} must be distinct and in [0, {world_size})")
        if launcher == "mpi" and self.ranks != list(range(world_size)):
            raise ValueError("tdist.testing: the mpi launcher starts every rank (ranks= is for the env launcher)")
        self.init = init
        self.init_kwargs = dict(init_kwargs or {})
        self.restartable = restartable
        self.mpirun = mpirun
        self.mpirun_args = list(mpirun_args)
        self.starts = 0
        self.master_port = 0
        self._workers = Workers(f"{backend}-{world_size}", launcher)
        self._pids: dict[int, int] = {}
        self._conns: dict[int, socket.socket] = {}
        self._inbox: "queue.Queue[tuple[int, Any]]" = queue.Queue()
        self._listener: Optional[socket.socket] = None
        self._call_ids = 0
        self._pending: Optional[_Pending] = None
        self._alive = False
        self._start_error: Optional[BaseException] = None
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ description
    def __repr__(self) -> str:
        state = "alive" if self._alive else "dead"
        return f"<World {self.backend} x{self.world_size} launcher={self.launcher} module={self.dist_module} {state}>"

    @property
    def alive(self) -> bool:
        return self._alive

    @property
    def pids(self) -> dict[int, int]:
        """Worker process id of each rank (as each worker reported it)."""
        return dict(self._pids)

    @property
    def _keeps_survivors(self) -> bool:
        """Whether dead ranks are replaced one by one (no process group to lose)."""
        return not self.init and self.launcher == "env"

    def describe(self) -> str:
        return (
            f"backend {self.backend!r}, world size {self.world_size}, "
            f"module {self.dist_module}, launcher {self.launcher}"
        )

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    @contextlib.contextmanager
    def spawn(cls, backend: str, world_size: int, **kwargs: Any) -> Iterator["World"]:
        """A one-off world (never reused, never restarted), killed on exit, always."""
        kwargs.setdefault("restartable", False)
        world = cls(backend, world_size, **kwargs)
        try:
            world.start()
            yield world
        finally:
            world.kill()

    def __enter__(self) -> "World":
        if not self._alive:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> "World":
        """Start the workers, wait for them to connect, initialise (unless ``init=False``)."""
        with self._lock:
            if self._alive:
                return self
            if self._start_error is not None:
                raise self._start_error  # do not pay for the same failing start again
            self.kill()
            self.starts += 1
            _LIVE.add(self)
            try:
                self._launch()
                self._accept()
                self._alive = True
                if self.init:
                    outcomes = self.try_init()
                    failures = [o for o in outcomes if isinstance(o, RankFailure)]
                    if failures:
                        raise WorldStartError(
                            f"tdist.testing: init_process_group failed ({self.describe()}):\n"
                            + "\n".join(str(f) for f in failures)
                        )
            except BaseException as exc:
                self.kill()
                if isinstance(exc, WorldError):
                    self._start_error = exc
                raise
            return self

    def _env_for(self, rank: Optional[int], token: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.extra_env)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [here] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        env[SYS_PATH_ENV] = json.dumps([p for p in sys.path if p and os.path.isdir(p)])
        env[CONTROLLER_ENV] = "127.0.0.1:%d" % self._listener.getsockname()[1]  # type: ignore[union-attr]
        env[TOKEN_ENV] = token
        env[BACKEND_ENV] = self.backend
        env[LAUNCHER_ENV] = self.launcher
        env[DIST_MODULE_ENV] = self.dist_module
        env[WORLD_SIZE_ENV] = str(self.world_size)
        env["WORLD_SIZE"] = str(self.world_size)
        env["MASTER_ADDR"] = "127.0.0.1"
        env["MASTER_PORT"] = str(self.master_port)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONFAULTHANDLER"] = "1"
        # Small thread pools: several workers share few cores.
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("MKL_NUM_THREADS", "1")
        if rank is not None:
            env["RANK"] = env["LOCAL_RANK"] = str(rank)
            env["LOCAL_WORLD_SIZE"] = str(self.world_size)
        else:
            env.pop("RANK", None)
            env.pop("LOCAL_RANK", None)
        return env

    def _launch(self) -> None:
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(max(8, 2 * self.world_size))
        self._listener.settimeout(0.2)
        self.master_port = free_port()
        self._token = secrets.token_hex(32)
        if self.launcher == "env":
            for rank in self.ranks:
                self._workers.start_rank(rank, self._env_for(rank, self._token))
        else:
            mpirun = self.mpirun or find_mpirun()
            if not mpirun:
                raise WorldStartError("tdist.testing: launcher 'mpi' needs mpirun (none next to python or on PATH)")
            self._workers.start_mpirun(mpirun, self.world_size, self.mpirun_args, self._env_for(None, self._token))

    def _drop_ranks(self, ranks: Sequence[int]) -> None:
        """Forget the (dead) workers of ``ranks``, keeping the others; the next call
        starts new workers for them (:meth:`_replace_dropped`)."""
        for rank in ranks:
            conn = self._conns.pop(rank, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
            self._pids.pop(rank, None)
            self._workers.kill_rank(rank)

    def _replace_dropped(self) -> None:
        for rank in sorted(set(self.ranks) - set(self._conns)):
            self._workers.start_rank(rank, self._env_for(rank, self._token))
        try:
            self._accept()
        except BaseException:
            self.kill()
            raise

    def _accept(self) -> None:
        """Accept connections until every expected rank said hello. Each connection is
        authenticated in a thread of its own (:meth:`_handshake`), so that a silent or slow
        one (any local process can connect) holds up nobody else."""
        assert self._listener is not None
        deadline = time.monotonic() + self.start_timeout
        expected = set(self.ranks)
        arrived: "queue.Queue[tuple[socket.socket, Any, Any]]" = queue.Queue()
        accepting = [True]  # false once this call returns: a late handshake closes its connection
        lock = threading.Lock()
        shaking: list[threading.Thread] = []
        try:
            while True:
                while not arrived.empty():
                    self._welcome(*arrived.get_nowait(), expected)
                if set(self._conns) == expected:
                    return
                if time.monotonic() > deadline:
                    missing = sorted(expected - set(self._conns))
                    raise WorldStartError(
                        f"tdist.testing: ranks {missing} did not connect within {self.start_timeout:g} s "
                        f"({self.describe()})\n" + self._log_tails(missing)
                    )
                exited = self._workers.exited()
                if exited is not None:
                    missing = sorted(expected - set(self._conns))
                    raise WorldStartError(
                        f"tdist.testing: a worker process exited with code {exited.returncode} before "
                        f"ranks {missing} connected ({self.describe()})\n" + self._log_tails(missing)
                    )
                shaking = [t for t in shaking if t.is_alive()]
                self._listener.settimeout(0.01 if shaking else 0.2)  # soon back for a finished handshake
                try:
                    conn, _ = self._listener.accept()
                except socket.timeout:
                    continue
                shaking.append(
                    threading.Thread(
                        target=self._handshake,
                        args=(conn, self._token.encode(), arrived, accepting, lock),
                        name="tdist-world-handshake",
                        daemon=True,
                    )
                )
                shaking[-1].start()
        finally:
            self._listener.settimeout(0.2)
            with lock:
                accepting[0] = False
            while not arrived.empty():
                arrived.get_nowait()[0].close()

    @staticmethod
    def _handshake(
        conn: socket.socket,
        token: bytes,
        arrived: "queue.Queue[tuple[socket.socket, Any, Any]]",
        accepting: list,
        lock: threading.Lock,
    ) -> None:
        said = worker_hello(conn, token)
        if said is None:
            return
        kind, hello = said
        with lock:
            if accepting[0]:
                arrived.put((conn, kind, hello))
                return
        conn.close()

    def _welcome(self, conn: socket.socket, kind: Any, hello: Any, expected: set[int]) -> None:
        """Take an authenticated connection as its rank's, unless its hello is wrong or late."""
        rank = hello.get("rank") if isinstance(hello, dict) else None
        if kind != "hello" or rank not in expected or rank in self._conns:
            conn.close()
            return
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[rank] = conn
        self._pids[rank] = int(hello["pid"])
        # (this start's inbox: a reader outliving a kill/restart cannot post into the next start's)
        threading.Thread(
            target=read_messages, args=(rank, conn, self._inbox), name=f"tdist-world-rank{rank}", daemon=True
        ).start()

    def kill(self) -> None:
        """SIGKILL every process of this world (idempotent); mark it dead."""
        with self._lock:
            self._alive = False
            self._pending = None
            self._workers.kill(list(self._pids.values()))
            for conn in self._conns.values():
                with contextlib.suppress(OSError):
                    conn.close()
            if self._listener is not None:
                with contextlib.suppress(OSError):
                    self._listener.close()
            self._pids, self._conns = {}, {}
            self._listener = None
            self._inbox = queue.Queue()
            _LIVE.discard(self)

    def close(self, timeout: float = 5.0) -> None:
        """Ask the workers to exit (they destroy their process group), then kill what is left."""
        with self._lock:
            if self._alive and self._pending is None:
                for conn in self._conns.values():
                    with contextlib.suppress(OSError):
                        send_msg(conn, ("exit",))
                self._workers.wait(timeout)
            self.kill()

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` (default SIGKILL) to one rank's worker, e.g. to test peer failure."""
        pid = self._pids.get(rank)
        if pid is None:
            raise WorldError(f"tdist.testing: rank {rank} has no worker in {self!r}")
        if sig == signal.SIGKILL:
            self._workers.signal_rank(rank, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    # ------------------------------------------------------------------ running bodies
    def try_init(self, *, timeout: Optional[float] = None, **overrides: Any) -> list[Any]:
        """Run ``init_process_group`` on every started rank; per-rank results or :class:`RankFailure`."""
        kwargs: dict[str, Any] = {
            "backend": self.backend,
            "init_method": self.init_method,
            "timeout": self.pg_timeout,
            "world_size": self.world_size,
        }
        kwargs.update(self.init_kwargs)
        kwargs.update(overrides)
        limit = timeout if timeout is not None else float(kwargs["timeout"]) + 60.0
        return self._try_run_ref(_INIT_REF, timeout=limit, kwargs=kwargs, check_after=False)

    def submit(self, fn: Union[Callable[..., Any], str], *, timeout: float = 60.0, **kwargs: Any) -> _Pending:
        """Send ``fn(**kwargs)`` to every rank without waiting; ``.outcomes()`` collects."""
        return self._submit(fn, timeout, kwargs)

    def _submit(
        self, fn: Union[Callable[..., Any], str], timeout: float, kwargs: dict, fail_fast: Optional[float] = None
    ) -> _Pending:
        with self._lock:
            if not self._alive:
                if self.restartable and self.starts:
                    self.start()
                elif not self.starts:
                    self.start()
                else:
                    raise WorldError(f"tdist.testing: {self!r} is dead and not restartable")
            if self._pending is not None:
                raise WorldError("tdist.testing: a call is already running in this world")
            if len(self._conns) < len(self.ranks):
                self._replace_dropped()
            self._call_ids += 1
            ref = fn_ref(fn)
            pending = _Pending(self, self._call_ids, ref, timeout, fail_fast)
            for rank in self.ranks:
                try:
                    send_msg(self._conns[rank], ("call", pending.call_id, ref, kwargs))
                except OSError:
                    pass  # reported as "died" when collecting
            self._pending = pending
            return pending

    def try_run(
        self,
        fn: Union[Callable[..., Any], str],
        *,
        timeout: float = 60.0,
        fail_fast: Optional[float] = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank; return each rank's result or a :class:`RankFailure`.

        Use it for bodies expected to fail on some ranks. After a timeout or a
        dead rank the world is killed; after errors on only some ranks it is
        killed too (its state is unknown); after an error on every rank a health
        check decides. A world without a process group is killed only after a
        timeout (see the class). ``fail_fast`` (seconds): once a rank's body has raised, wait
        at most that long for the others, then kill the world; they are reported
        ``"stopped"`` (no stack dumps) instead of waiting out ``timeout``.
        """
        return self._try_run_ref(fn, timeout=timeout, kwargs=kwargs, check_after=True, fail_fast=fail_fast)

    def _try_run_ref(
        self, fn: Any, *, timeout: float, kwargs: dict, check_after: bool, fail_fast: Optional[float] = None
    ) -> list[Any]:
        pending = self._submit(fn, timeout, kwargs, fail_fast)
        outcomes = self._collect(pending)
        if check_after and self._alive and not self._keeps_survivors:  # without a process group: nothing shared
            failures = [o for o in outcomes if isinstance(o, RankFailure)]
            if failures and len(failures) < len(outcomes):
                self.kill()
            elif failures:
                health = self._try_run_ref(_HEALTH_REF, timeout=30.0, kwargs={}, check_after=False)
                if any(isinstance(h, RankFailure) for h in health):
                    self.kill()
        return outcomes

    def run(
        self,
        fn: Union[Callable[..., Any], str],
        *,
        timeout: float = 60.0,
        fail_fast: Optional[float] = None,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(**kwargs)`` on every rank at once; return the results by rank.

        Raises :class:`WorldRunError` (an AssertionError) with every failing
        rank's traceback, the ranks whose body raised first, or :class:`WorldTimeoutError`
        naming the ranks that did not answer within ``timeout`` seconds (the world is
        then killed). ``fail_fast``: as in :meth:`try_run`.
        """
        __tracebackhide__ = True  # pytest: show the ranks' tracebacks, not the harness
        ref = fn_ref(fn)
        outcomes = self.try_run(ref, timeout=timeout, fail_fast=fail_fast, **kwargs)
        failures = [o for o in outcomes if isinstance(o, RankFailure)]
        if failures:
            raise self.error_for(ref, outcomes)
        return outcomes

    def error_for(self, ref: str, outcomes: Sequence[Any]) -> WorldRunError:
        """The :class:`WorldRunError` describing ``outcomes`` of body ``ref``."""
        failures = failures_first(outcomes)
        timed_out = [f.rank for f in failures if f.kind == "timeout"]
        stopped = [f.rank for f in failures if f.kind == "stopped"]
        failed = sorted(f.rank for f in failures if f.kind != "stopped")
        head = f"tdist.testing: {ref} failed on ranks {failed} of {len(outcomes)} ({self.describe()})"
        if stopped:
            head += f"; ranks {stopped} were stopped once rank {failures[0].rank} had failed"
        if timed_out:
            head += f"; ranks {timed_out} did not answer in time, the world was killed"
        ok = [self.ranks[i] for i, o in enumerate(outcomes) if not isinstance(o, RankFailure)]
        if ok:
            head += f"; ranks {ok} returned normally"
        cls = WorldTimeoutError if timed_out else WorldRunError
        return cls(head + "\n" + "\n".join(str(f) for f in failures), outcomes)

    def _collect(self, pending: _Pending) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = pending.sent_at + pending.timeout
        expected = set(self.ranks)
        stopping = False  # True once a rank raised and fail_fast cut the deadline short
        while set(results) != expected:
            if not stopping and pending.fail_fast is not None:
                if any(isinstance(o, RankFailure) and o.kind == "error" for o in results.values()):
                    stopping = time.monotonic() + pending.fail_fast < deadline
                    deadline = min(deadline, time.monotonic() + pending.fail_fast)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, msg = self._inbox.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if rank in results:
                continue
            if msg[0] == "eof":
                time.sleep(0.05)  # (the exit code, if it is exiting)
                msg = (*msg, self._workers.returncode(rank))
            outcome = reply_outcome(rank, msg, pending.call_id, pending.sent_at)
            if outcome is not NOT_THIS_CALL:
                results[rank] = outcome
        missing = sorted(expected - set(results))
        died = [r for r, o in results.items() if isinstance(o, RankFailure) and o.kind == "died"]
        if missing and stopping:
            for r in missing:
                results[r] = RankFailure(
                    r,
                    "stopped",
                    "Stopped",
                    f"stopped {pending.fail_fast:g} s after another rank's body raised",
                    elapsed=time.monotonic() - pending.sent_at,
                )
        elif missing:
            self._dump_stacks(missing)
            for r in missing:
                results[r] = RankFailure(
                    r,
                    "timeout",
                    "Timeout",
                    f"no answer within {pending.timeout:g} s",
                    elapsed=pending.timeout,
                    log_tail=self._workers.log_tail(r),
                )
        for r in died:
            results[r].log_tail = self._workers.log_tail(r)
        self._pending = None
        if missing or (died and not self._keeps_survivors):
            self.kill()
        elif died:
            self._drop_ranks(died)  # no process group to lose: the survivors stay
        return [results[r] for r in self.ranks]

    def _dump_stacks(self, ranks: Sequence[int]) -> None:
        """Ask hung ranks to print every thread's stack (faulthandler on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1"):
            return
        for r in ranks:
            pid = self._pids.get(r)
            if pid:
                with contextlib.suppress(ProcessLookupError, OSError):
                    os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)

    def _log_tails(self, ranks: Sequence[int]) -> str:
        ranks = ranks if self.launcher == "env" else ranks[:1]
        parts = []
        for r in ranks:
            tail = self._workers.log_tail(r)
            if tail:
                parts.append(f"(tail of rank {r}'s output)\n" + indent(tail.rstrip(), "    | "))
        return "\n".join(parts)

    def output(self, rank: int) -> str:
        """Everything rank ``rank`` printed so far (for mpi: the whole mpirun output)."""
        return self._workers.output(rank)
