"""Helpers for the tdist-mpi tests: whether the backend loads, and ``mpirun -n N python
<program>`` with a hard timeout (tdist.testing.processes.mpirun_job)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from tdist.testing.processes import JobResult, mpirun_job

PROGRAMS = Path(__file__).parent / "programs"


def backend_unavailable() -> Optional[str]:
    try:
        import tdist

        spec = tdist.get_backend_spec("mpi")
    except Exception as exc:  # core mid-edit, plugin not installed
        return f"tdist mpi backend not loadable: {exc}"
    return spec.available


def run_mpi(
    n: int, program: str, *args: str, timeout: float = 90.0, env: Optional[dict] = None, mpirun_args: Sequence[str] = ()
) -> JobResult:
    """``mpirun -n n python programs/<program> <args>`` (or a path for ``program``), output
    merged; past ``timeout`` it is killed with all it started (JobTimeoutError)."""
    path = str(PROGRAMS / program) if "/" not in program else program
    return mpirun_job(n, [sys.executable, path, *args], timeout, env, mpirun_args)
