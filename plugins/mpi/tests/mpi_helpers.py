"""Helpers for the tdist-mpi tests: start ``mpirun -n N python <program>`` with a hard
timeout, killing the whole mpirun process group (only that) when it runs over."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from tdist._local import find_mpirun, mpirun_env

PROGRAMS = Path(__file__).parent / "programs"


def backend_unavailable() -> Optional[str]:
    try:
        import tdist

        spec = tdist.get_backend_spec("mpi")
    except Exception as exc:  # core mid-edit, plugin not installed
        return f"tdist mpi backend not loadable: {exc}"
    return spec.available


@dataclass
class MpiResult:
    returncode: int
    output: str
    seconds: float
    timed_out: bool

    def lines(self, prefix: str) -> list[str]:
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def run_mpi(
    n: int, program: str, *args: str, timeout: float = 90.0, env: Optional[dict] = None, mpirun_args: Sequence[str] = ()
) -> MpiResult:
    """Run ``programs/<program>`` (or a path) under ``mpirun -n n``; kill it (its process
    group, which holds only what this call started) after ``timeout`` seconds."""
    mpirun = find_mpirun()
    assert mpirun, "mpirun not found"
    session_dir = tempfile.mkdtemp(prefix="tdist-mpi-test-")
    full_env = mpirun_env(dict(os.environ, PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1"), session_dir)
    full_env.update(env or {})
    cmd = [
        mpirun,
        "-n",
        str(n),
        "--oversubscribe",
        "--bind-to",
        "none",
        *mpirun_args,
        sys.executable,
        str(PROGRAMS / program) if "/" not in program else program,
        *args,
    ]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, start_new_session=True, text=True
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
    finally:
        shutil.rmtree(session_dir, ignore_errors=True)
    return MpiResult(proc.returncode, out, time.monotonic() - start, timed_out)
