"""Test helpers: run a small multi-process job and never leave a process behind.

Each process starts in its own session; on timeout or when the test fails, the
whole session of every process is killed (SIGKILL to its process group).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from tdist.testing import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")


def base_env(**extra: str) -> dict[str, str]:
    """The current environment without any rank variables of a surrounding job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        and not k.startswith(("OMPI_", "PMI_", "SLURM_", "PMIX_"))
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def kill_session(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_job(
    commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], timeout: float, cwd: Optional[str] = None
) -> list[Result]:
    """Start one process per (command, env), wait for all of them (``timeout``
    seconds in all); kill every one and raise ``TimeoutError`` with their output
    if they have not all exited by then."""
    procs = []
    try:
        for cmd, env in zip(commands, envs):
            procs.append(
                subprocess.Popen(
                    list(cmd),
                    env=dict(env),
                    cwd=cwd or ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    text=True,
                )
            )
        deadline = time.monotonic() + timeout
        outputs = []
        timed_out = False
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                kill_session(proc.pid)
                out, err = proc.communicate()
            outputs.append(Result(proc.returncode, out, err))
        if timed_out:
            for proc in procs:
                kill_session(proc.pid)
            details = "\n".join(
                f"--- process {i} (rc {r.returncode})\n{r.stdout}\n{r.stderr[-3000:]}" for i, r in enumerate(outputs)
            )
            raise TimeoutError(f"job did not finish within {timeout:g} s\n{details}")
        return outputs
    finally:
        for proc in procs:
            kill_session(proc.pid)
            if proc.poll() is None:
                proc.wait(timeout=10)


def python_job(script_args: Sequence[str], world_size: int, timeout: float, **env_extra: str) -> list[Result]:
    """``python <script_args>`` in ``world_size`` processes, with RANK/WORLD_SIZE/
    MASTER_ADDR/MASTER_PORT set as a launcher would."""
    port = str(free_port())
    envs = [
        base_env(
            RANK=str(r),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **env_extra,
        )
        for r in range(world_size)
    ]
    return run_job([[sys.executable, *script_args]] * world_size, envs, timeout)


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
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
