"""Run whole programs as test processes, and never leave one behind.

For tests of launchers and complete programs (a script under ``tdistrun``,
``torchrun`` or ``mpirun``), where :class:`tdist.testing.World`'s bodies do not
fit. Every process starts in its own session; when the job runs past its
timeout, or the call returns or raises for any reason, every session it started
is killed (SIGKILL to the process group) and reaped.

- :func:`run_job`: one process per (command, environment); all must exit within
  ``timeout`` seconds in all, else :class:`JobTimeoutError` with their output.
- :func:`python_job`: ``python <args>`` in ``world_size`` processes with the rank
  variables a launcher sets (env:// rendezvous on a free port).
- :func:`mpirun_job`: one ``mpirun -n N`` (Open MPI, allowed to run as root and
  oversubscribe, its session directory private and removed afterwards).
- :func:`base_env`: this environment without the rank variables of a surrounding job.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from .._local import find_mpirun, free_port, mpirun_env

__all__ = [
    "JobResult",
    "JobTimeoutError",
    "base_env",
    "kill_session",
    "mpirun_job",
    "pid_alive",
    "python_job",
    "run_job",
]

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "SLURM_", "PMIX_", "TORCHELASTIC_")


class JobTimeoutError(TimeoutError):
    """A job's processes did not all exit in time (they have been killed); the
    message holds each one's return code and output."""


@dataclass
class JobResult:
    """One process's return code and output (``stderr`` is empty when merged into ``stdout``)."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    def lines(self, prefix: str) -> list[str]:
        """The output lines that start with ``prefix``."""
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def base_env(**extra: str) -> dict[str, str]:
    """The current environment without the rank variables of a surrounding job
    (torchrun's, Open MPI's, Slurm's), unbuffered, one OpenMP thread, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARIABLES and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def kill_session(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (a process started with ``start_new_session``)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


#: The variable that marks every process of one :func:`run_job` job, descendants included.
JOB_MARKER = "TDIST_TESTING_JOB"


def kill_marked(job: str) -> int:
    """SIGKILL every live process whose environment has ``JOB_MARKER=job`` (a launcher's
    workers run in sessions of their own, out of reach of :func:`kill_session`); how many."""
    wanted = f"{JOB_MARKER}={job}".encode()
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if wanted in f.read().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
                    killed += 1
        except OSError:
            pass  # gone, or not ours to read
    return killed


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


def run_job(
    commands: Sequence[Sequence[str]],
    envs: Sequence[Mapping[str, str]],
    timeout: float,
    cwd: Optional[str] = None,
    *,
    merge_stderr: bool = False,
) -> list[JobResult]:
    """Start one process per (command, env) and wait for all of them, ``timeout``
    seconds in all; return their results in order. Past the timeout every process of the
    job is killed -- what they started too, launchers' workers in sessions of their own
    included (:data:`JOB_MARKER`) -- and :class:`JobTimeoutError` raised with their
    output. ``merge_stderr``: one stream per process, in the order it was written."""
    if len(commands) != len(envs):
        raise ValueError(f"run_job: {len(commands)} commands but {len(envs)} environments")
    job = f"{os.getpid()}-{time.monotonic_ns()}"
    procs: list[subprocess.Popen] = []
    try:
        for cmd, env in zip(commands, envs):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env={**env, JOB_MARKER: job},
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                    start_new_session=True,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        results: list[JobResult] = []
        late: list[int] = []
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.append(i)
                kill_session(proc.pid)
                kill_marked(job)  # its descendants hold the output pipes open
                try:
                    out, err = proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    out, err = "", "(output not collected: the pipes stayed open)"
            results.append(JobResult(proc.returncode, out or "", err or ""))
        if late:
            details = "\n".join(
                f"--- process {i} (rc {r.returncode})\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
                for i, r in enumerate(results)
            )
            raise JobTimeoutError(
                f"job did not finish within {timeout:g} s (still running: processes {late})\n{details}"
            )
        return results
    finally:
        for proc in procs:
            kill_session(proc.pid)
        kill_marked(job)
        for proc in procs:
            if proc.poll() is None:
                proc.wait(timeout=10)


def python_job(
    script_args: Sequence[str], world_size: int, timeout: float, cwd: Optional[str] = None, **env_extra: str
) -> list[JobResult]:
    """``python <script_args>`` in ``world_size`` processes, with RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and MASTER_PORT set as a launcher would (plus ``env_extra``)."""
    port = str(free_port())
    envs = [
        base_env(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **env_extra,
        )
        for rank in range(world_size)
    ]
    return run_job([[sys.executable, *script_args]] * world_size, envs, timeout, cwd)


def mpirun_job(
    n: int,
    args: Sequence[str],
    timeout: float,
    env: Optional[Mapping[str, str]] = None,
    mpirun_args: Sequence[str] = (),
    cwd: Optional[str] = None,
) -> JobResult:
    """``mpirun -n n --oversubscribe --bind-to none <mpirun_args> <args>`` (``args``:
    the program and its arguments) with ``env`` added, output merged; killed with
    everything it started past ``timeout`` (:class:`JobTimeoutError`)."""
    mpirun = find_mpirun()
    if not mpirun:
        raise FileNotFoundError("mpirun not found (none next to python or on PATH)")
    session_dir = tempfile.mkdtemp(prefix="tdist-mpirun-")
    try:
        full_env = mpirun_env(dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1"), session_dir)
        full_env.update(env or {})
        cmd = [mpirun, "-n", str(n), "--oversubscribe", "--bind-to", "none", *mpirun_args, *args]
        return run_job([cmd], [full_env], timeout, cwd, merge_stderr=True)[0]
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)
