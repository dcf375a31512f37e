"""The worker processes of one attempt, as torchelastic's agent drives them.

:class:`WorkerProcesses` is a ``torch.distributed.elastic`` process context
(``PContext``: what ``LocalElasticAgent`` starts, polls with ``wait(0)`` and stops with
``close(signal)``) that differs from torch's ``SubprocessContext`` where tdistrun did
better: each output line reaches the console live with a rank prefix (through pipes,
not by tailing files), tee'd and redirected streams are written by the same readers,
every worker runs in its own session with ``PR_SET_PDEATHSIG``, stopping waits for
everything in the workers' process groups (grandchildren too) for ``grace_period``
seconds before SIGKILL, and a failure is reported naming the worker's global rank --
the rank that failed on its own first, by the error records the workers write
(:mod:`tdist._errorfile`), not merely the first one seen exiting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, Callable, Optional

from torch.distributed.elastic.multiprocessing.api import LogsSpecs, PContext, RunProcsResult
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from .._environment import REPLACEMENT_ENV
from .._errorfile import ENV as ERROR_FILE_ENV
from .._errorfile import Failure, read_record, root_cause
from .workers import OutputRoute, describe_status, group_members, pdeathsig_preexec, popen_target, start_pump

__all__ = ["WorkerProcesses"]

_POLL_INTERVAL = 0.02


class _Worker:
    """One started worker: its process and the threads that copy its output."""

    def __init__(self, local_rank: int, rank: int, proc: "subprocess.Popen[bytes]") -> None:
        self.local_rank = local_rank
        self.rank = rank
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the worker leads its own process group
        self.threads: list[threading.Thread] = []

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class WorkerProcesses(PContext):
    """The workers of one attempt on this node (see the module docstring).

    ``entrypoint`` and ``args[local_rank]`` form each worker's command line, ``envs``
    is added to the launcher's environment. ``log_line_prefixes[local_rank]`` prefixes
    the worker's console lines (None: no prefix, and streams that are only shown are
    inherited rather than piped). ``logs_specs`` decides, as in torchrun, which streams
    go to files (``--redirects``), to files and the console (``--tee``), or nowhere
    (``--local-ranks-filter``). ``log`` receives the launcher's own messages.
    """

    def __init__(
        self,
        name: str,
        entrypoint: str,
        args: dict[int, tuple],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: Optional[dict[int, str]],
        *,
        grace_period: float,
        log: Callable[[str], None],
        duplicate_stdout_filters: Optional[list[str]] = None,
        duplicate_stderr_filters: Optional[list[str]] = None,
        numa_options: Any = None,
        tolerate_failures: int = 0,
        replace_failed: bool = False,
    ) -> None:
        # PContext.__init__ would also set up torch's file tailers for --tee; our pumps copy
        # tee'd streams, so set what PContext's start()/wait()/close() use ourselves.
        self.name = name
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.nprocs = len(args)
        dest = logs_specs.reify(envs)  # also sets each worker's TORCHELASTIC_ERROR_FILE
        self.stdouts, self.stderrs, self.error_files = dest.stdouts, dest.stderrs, dest.error_files
        self._tee = (dest.tee_stdouts, dest.tee_stderrs)
        self.filtered_stdout = (
            open(dest.filtered_stdout, "w", errors="replace", buffering=1) if duplicate_stdout_filters else None
        )  # noqa: SIM115 -- PContext.close closes them
        self.filtered_stderr = (
            open(dest.filtered_stderr, "w", errors="replace", buffering=1) if duplicate_stderr_filters else None
        )  # noqa: SIM115
        self._tail_logs = []
        self._prefixes = log_line_prefixes
        self._needles = (
            [f.encode() for f in duplicate_stdout_filters or ()],
            [f.encode() for f in duplicate_stderr_filters or ()],
        )
        self._numa_options = numa_options
        self.grace_period = grace_period
        self.log = log
        self._consoles = (sys.stdout, sys.stderr)
        self._workers: dict[int, _Worker] = {}
        self._replaced: list[_Worker] = []  # workers whose local rank a replacement took over
        #: How many worker failures the job survives (tdistrun --tolerate-failures), and so far.
        self.tolerate_failures = tolerate_failures
        self.tolerated = 0
        #: Start a replacement for each tolerated failure (tdistrun --replace-failed).
        self.replace_failed = replace_failed
        self._files: list[IO[bytes]] = []
        self._failures: dict[int, ProcessFailure] = {}
        self._exited_at: dict[int, float] = {}  # when a worker was seen to have exited (time.time())
        self._running: set[int] = set(range(self.nprocs))
        #: The first worker that failed on its own (not stopped by the launcher), if any.
        self.first_failure: Optional[ProcessFailure] = None
        #: How many running workers the last close() signalled.
        self.signalled = 0

    # ------------------------------------------------------------------ starting
    def _route(self, local_rank: int, stream: int) -> OutputRoute:
        """Where stream 0 (stdout) or 1 (stderr) of ``local_rank`` goes: torchrun's choice
        (LogsSpecs.reify: "" console, a path: a file, tee'd: both), tdistrun's prefixes."""
        dest = (self.stdouts, self.stderrs)[stream][local_rank]
        tee = local_rank in self._tee[stream]
        log_file = None
        if dest and dest != os.devnull:
            log_file = open(dest, "wb")  # noqa: SIM115 -- closed in _close
            self._files.append(log_file)
        shown = dest == "" or tee
        prefix = b"" if self._prefixes is None else self._prefixes[local_rank].encode()
        filtered = (self.filtered_stdout, self.filtered_stderr)[stream] if tee else None
        return OutputRoute(
            console=self._consoles[stream] if shown else None,
            prefix=prefix,
            log_file=log_file,
            filtered=filtered,
            needles=self._needles[stream],
        )

    def _command(self, local_rank: int) -> tuple[str, ...]:
        cmd = (str(self.entrypoint), *(str(a) for a in self.args[local_rank]))
        if self._numa_options is not None:
            from torch.numa.binding import _maybe_wrap_command_args_with_numa_binding

            cmd = _maybe_wrap_command_args_with_numa_binding(cmd, gpu_index=local_rank, numa_options=self._numa_options)
        return cmd

    def _start(self) -> None:
        for stream in self._consoles:
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for local_rank in range(self.nprocs):
            self._spawn(local_rank, self.envs[local_rank])

    def _spawn(self, local_rank: int, env: dict[str, str]) -> _Worker:
        """Start the worker of ``local_rank`` with ``env`` added to the launcher's environment."""
        routes = (self._route(local_rank, 0), self._route(local_rank, 1))
        proc = subprocess.Popen(
            self._command(local_rank),
            env={**os.environ, **env},
            stdout=popen_target(routes[0]),
            stderr=popen_target(routes[1]),
            start_new_session=True,
            preexec_fn=pdeathsig_preexec(),
        )
        worker = _Worker(local_rank, int(env.get("RANK", local_rank)), proc)
        old = self._workers.get(local_rank)
        if old is not None:
            self._replaced.append(old)
        self._workers[local_rank] = worker
        for pipe, route, what in ((proc.stdout, routes[0], "out"), (proc.stderr, routes[1], "err")):
            if pipe is not None:
                worker.threads.append(start_pump(pipe, route, f"tdistrun-rank{worker.rank}-{what}"))
        return worker

    def _tolerate(self, worker: _Worker, code: int) -> bool:
        """Whether ``worker``'s failure (exit status ``code``) is one the program opted to
        survive (``tolerate_failures``); then start its replacement if asked to."""
        if self.tolerated >= self.tolerate_failures:
            return False
        self.tolerated += 1
        what = f"rank {worker.rank} (local rank {worker.local_rank}, pid {worker.proc.pid}) failed with "
        what += f"{describe_status(code)}; the job goes on (failure {self.tolerated} of {self.tolerate_failures} "
        what += "tolerated"
        if not self.replace_failed:
            self.log(what + ")")
            return True
        env = {**self.envs[worker.local_rank], REPLACEMENT_ENV: str(worker.rank)}
        replacement = self._spawn(worker.local_rank, env)
        self._running.add(worker.local_rank)
        self.log(what + f"); started a replacement (pid {replacement.proc.pid}, {REPLACEMENT_ENV}={worker.rank})")
        return True

    # ------------------------------------------------------------------ polling
    def pids(self) -> dict[int, int]:
        return {local_rank: worker.proc.pid for local_rank, worker in self._workers.items()}

    def _poll(self) -> Optional[RunProcsResult]:
        failed: list[_Worker] = []
        now = time.time()
        for local_rank in sorted(self._running):
            worker = self._workers[local_rank]
            code = worker.proc.poll()
            if code is None:
                continue
            self._running.discard(local_rank)
            self._exited_at[local_rank] = now
            if code != 0 and self._tolerate(worker, code):
                continue
            if code != 0:
                self._failures[local_rank] = ProcessFailure(
                    local_rank=local_rank,
                    pid=worker.proc.pid,
                    exitcode=code,
                    error_file=self.error_files.get(local_rank, ""),
                )
                failed.append(worker)
        if self._running and not self._failures:
            return None
        if failed and self.first_failure is None:
            first = root_cause([self._failure(w) for w in failed])  # workers seen exiting in one poll
            assert first is not None
            self.first_failure = self._failures[first.local_rank]
            because = ""
            if first.consequence:
                because = f" because rank {first.peer} did" if first.peer is not None else " because a peer did"
            self.log(
                f"rank {first.rank} (local rank {first.local_rank}, pid {first.pid}) failed with "
                f"{describe_status(first.exitcode or 0)}{because}; stopping {len(self._running)} other worker(s)"
            )
        self.close()
        result = RunProcsResult(failures=dict(self._failures), stdouts=self.stdouts, stderrs=self.stderrs)
        if not result.is_failed():
            result.return_values = dict.fromkeys(range(self.nprocs))
        return result

    def rank_of(self, local_rank: int) -> int:
        """The global rank of the worker with ``local_rank``."""
        return self._workers[local_rank].rank

    # ------------------------------------------------------------------ failures
    def _failure(self, worker: _Worker) -> Failure:
        """``worker``'s failure as its error record (if it wrote one) and exit status tell it."""
        local_rank = worker.local_rank
        path = self.envs[local_rank].get(ERROR_FILE_ENV)
        record = read_record(path) if path else None
        detail = callstack = None
        process = self._failures.get(local_rank)
        if process is not None and process.error_file and os.path.isfile(process.error_file):
            message = process.message  # torch's @record wrote it: {"message": ..., "extraInfo": {"py_callstack": ...}}
            detail = str(message.get("message") or "") if isinstance(message, dict) else str(message or "")
            if isinstance(message, dict) and isinstance(message.get("extraInfo"), dict):
                callstack = message["extraInfo"].get("py_callstack")
        exited = self._exited_at.get(local_rank, time.time())
        return Failure(
            rank=worker.rank,
            local_rank=local_rank,
            pid=worker.proc.pid,
            exitcode=worker.proc.returncode,
            at=float(record["time"]) if record is not None else exited,
            record=record,
            stopped=process is None,
            detail=detail or None,
            callstack=str(callstack).rstrip("\n").splitlines() if callstack else None,
        )

    def failures(self) -> list[Failure]:
        """The workers of this attempt that failed on their own, earliest first: those seen
        exiting with a non-zero status before the others were stopped, and those that
        recorded an uncaught exception (also when they exited only once stopped)."""
        found = []
        for local_rank, worker in sorted(self._workers.items()):
            if local_rank in self._failures:
                found.append(self._failure(worker))
                continue
            path = self.envs[local_rank].get(ERROR_FILE_ENV)
            if path and worker.proc.returncode not in (None, 0) and os.path.exists(path):
                failure = self._failure(worker)
                if failure.record is not None:
                    found.append(failure)
        return sorted(found, key=lambda f: (f.at, f.rank))

    # ------------------------------------------------------------------ stopping
    def _leftovers(self) -> list[int]:
        """Live processes in the workers' groups (workers or what they started)."""
        return [pid for w in [*self._workers.values(), *self._replaced] for pid in group_members(w.pgid)]

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        """Send ``death_sig`` to every worker's process group, give them ``grace_period``
        seconds (``timeout`` is torch's and not used), then SIGKILL whatever is left of
        the groups; wait for the output to drain."""
        workers = list(self._workers.values())
        alive = [w for w in workers if w.proc.poll() is None]
        if alive or self._leftovers():
            self.signalled = len(alive)
            for worker in workers:
                worker.signal_group(death_sig)
            deadline = time.monotonic() + self.grace_period
            while time.monotonic() < deadline:
                if all(w.proc.poll() is not None for w in workers) and not self._leftovers():
                    break
                time.sleep(_POLL_INTERVAL)
            stragglers = [w.rank for w in workers if w.proc.poll() is None]
            if stragglers:
                self.log(
                    f"rank(s) {stragglers} still running after {self.grace_period:g} s grace period; sending SIGKILL"
                )
            for worker in workers:
                worker.signal_group(signal.SIGKILL)
            for worker in workers:
                try:
                    worker.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.log(f"rank {worker.rank} (pid {worker.proc.pid}) did not exit after SIGKILL")
        for worker in workers:
            for thread in worker.threads:
                thread.join(timeout=2.0)
        for file in self._files:
            file.close()

    def kill_all(self) -> None:
        """SIGKILL every worker's process group at once (a second signal to the launcher)."""
        for worker in self._workers.values():
            worker.signal_group(signal.SIGKILL)
