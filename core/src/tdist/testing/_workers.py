"""The processes of one start of a :class:`tdist.testing.World`, and their logs.

One worker process per rank (env launcher) or one ``mpirun`` for all ranks (mpi
launcher), each in its own session so that killing its process group reaches
whatever it started; each writes to a log file in a private directory, removed
when the processes are killed (kept with ``TDIST_TESTING_KEEP_LOGS=1``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

from .._local import mpirun_env

WORKER_COMMAND = [sys.executable, "-m", "tdist.testing._worker"]
_LOG_TAIL = 4000


class Workers:
    """Starts, watches and kills the worker processes of one world start."""

    def __init__(self, label: str, launcher: str) -> None:
        self.label = label
        self.launcher = launcher
        self.logdir: Optional[str] = None  # made when the first process starts
        self.procs: list[subprocess.Popen] = []
        self.of_rank: dict[int, subprocess.Popen] = {}

    def start_rank(self, rank: int, env: Mapping[str, str]) -> None:
        """Start rank ``rank``'s worker (env launcher); its output goes to the end of its log."""
        self.of_rank[rank] = self._popen(WORKER_COMMAND, dict(env), f"rank{rank}.log")

    def start_mpirun(self, mpirun: str, world_size: int, extra_args: Sequence[str], env: Mapping[str, str]) -> None:
        """Start every rank's worker under one ``mpirun -n world_size``."""
        cmd = [mpirun, "-n", str(world_size), "--oversubscribe", "--bind-to", "none", *extra_args, *WORKER_COMMAND]
        self._popen(cmd, mpirun_env(dict(env), self._ensure_logdir()), "mpirun.log")

    def _ensure_logdir(self) -> str:
        if self.logdir is None:
            self.logdir = tempfile.mkdtemp(prefix=f"tdist-world-{self.label}-")
        return self.logdir

    def _popen(self, cmd: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        log = open(os.path.join(self._ensure_logdir(), log_name), "ab")
        try:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killpg reaches its children too
            )
        finally:
            log.close()
        self.procs.append(proc)
        return proc

    def exited(self) -> Optional[subprocess.Popen]:
        """A started process that has already exited, if any."""
        return next((proc for proc in self.procs if proc.poll() is not None), None)

    def kill_rank(self, rank: int) -> None:
        """SIGKILL rank ``rank``'s process group, reap it and forget it (env launcher)."""
        proc = self.of_rank.pop(rank, None)
        if proc is not None:
            _kill_group(proc)
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
            self.procs.remove(proc)

    def signal_rank(self, rank: int, sig: int) -> None:
        """Send ``sig`` to rank ``rank``'s whole process group (env launcher), if it has one."""
        proc = self.of_rank.get(rank)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.killpg(proc.pid, sig)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for every process to exit."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))

    def kill(self, pids: Sequence[int] = ()) -> None:
        """SIGKILL every process group started here and every pid in ``pids`` (the workers
        as they reported themselves: under mpirun they are not its group), reap them, and
        remove the logs."""
        for proc in self.procs:
            _kill_group(proc)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=10)
        if self.logdir and not os.environ.get("TDIST_TESTING_KEEP_LOGS"):
            shutil.rmtree(self.logdir, ignore_errors=True)
        self.procs, self.of_rank, self.logdir = [], {}, None

    def returncode(self, rank: int) -> Optional[int]:
        """Rank ``rank``'s exit code (waiting up to a second for it), None if still running or unknown."""
        proc = self.of_rank.get(rank)
        if proc is None:
            return None
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)
        return proc.returncode

    def log_path(self, rank: int) -> Optional[str]:
        if not self.logdir:
            return None
        return os.path.join(self.logdir, f"rank{rank}.log" if self.launcher == "env" else "mpirun.log")

    def output(self, rank: int, tail: Optional[int] = None) -> str:
        """What rank ``rank`` printed so far (the whole mpirun output for mpi); its last
        ``tail`` bytes only if given."""
        path = self.log_path(rank)
        if not path or not os.path.exists(path):
            return ""
        with open(path, "rb") as f:
            if tail is not None:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - tail))
            return f.read().decode("utf-8", "replace")

    def log_tail(self, rank: int) -> str:
        return self.output(rank, _LOG_TAIL)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        os.killpg(proc.pid, signal.SIGKILL)
