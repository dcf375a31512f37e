"""Starting the benchmark's workers: one job per world size, under ``mpirun`` when
mpi4py and an ``mpirun`` are available (so raw MPI is measured by the same
processes), else as plain subprocesses."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from .._local import find_mpirun, free_port, mpirun_env

__all__ = ["find_mpirun", "free_port", "run_world", "mpi_available", "wait_workers"]


def mpi_available() -> tuple[bool, str]:
    """Whether raw MPI can be measured, and why not."""
    if importlib.util.find_spec("mpi4py") is None:
        return False, "mpi4py is not installed"
    if find_mpirun() is None:
        return False, "no mpirun found"
    return True, ""


def _mpirun_command(mpirun: str, world: int) -> list[str]:
    cmd = [mpirun, "-n", str(world), "--oversubscribe", "--bind-to", "none"]
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    if "Open MPI" not in out and "OpenRTE" not in out:  # MPICH & co. know none of these flags
        cmd = [mpirun, "-n", str(world)]
    return cmd


def run_world(
    world: int,
    cfg: dict[str, Any],
    use_mpi: bool,
    timeout: float,
    verbose: Any = False,
    worker_module: str = "tdist.bench.workers",
) -> list[dict]:
    """Run the workers (``python -m worker_module CONFIG``) of one world size; their
    results (rank 0's file). ``verbose``: how rank 0 shows its progress (``"lines"`` or
    True, ``"bar"``, None or False: not at all; see :class:`tdist.bench.workers.Progress`)."""
    tmp = tempfile.mkdtemp(prefix="tdist-bench-")
    cfg = dict(cfg)
    cfg["result"] = os.path.join(tmp, "result.json")
    cfg["ports"] = {"gloo": free_port(), "tdist": free_port()}
    cfg["progress"] = verbose
    path = os.path.join(tmp, "config.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TDIST_BENCH_")}
    env.setdefault("PYTHONUNBUFFERED", "1")
    worker = [sys.executable, "-m", worker_module, path]
    procs: list[subprocess.Popen] = []
    if use_mpi:
        mpirun = find_mpirun()
        assert mpirun is not None
        procs.append(
            subprocess.Popen(_mpirun_command(mpirun, world) + worker, env=mpirun_env(env, tmp), start_new_session=True)
        )
    else:
        for rank in range(world):
            penv = dict(env, TDIST_BENCH_RANK=str(rank), TDIST_BENCH_WORLD=str(world))
            procs.append(subprocess.Popen(worker, env=penv, start_new_session=True))
    failed = wait_workers(procs, timeout, f"the world of {world}")
    if failed is not None:
        raise RuntimeError(f"tdist.bench: {failed}")
    with open(cfg["result"]) as f:
        results = json.load(f)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def wait_workers(procs: Sequence[subprocess.Popen], timeout: float, what: str) -> Optional[str]:
    """Wait for every worker to exit; None when all exited 0, else what went wrong (a
    worker's failure or ``what`` running past ``timeout``). Every worker still running
    is then killed, with its process group."""
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            bad = [p for p in procs if p.poll() not in (None, 0)]
            if bad:
                failed = f"a worker exited with status {bad[0].returncode}"
                break
            if time.monotonic() > deadline:
                failed = f"{what} did not finish within {timeout:g} s"
                break
            time.sleep(0.05)
        else:
            bad = [p for p in procs if p.returncode != 0]
            if bad:
                failed = f"a worker exited with status {bad[0].returncode}"
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except OSError:
                    pass
                p.wait(10)
    return failed
