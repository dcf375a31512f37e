"""``env://``: read the rendezvous from environment variables.

``MASTER_ADDR`` (rank 0's address; rank 0 without it listens on every interface),
``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK``; arguments to ``init_process_group``
take precedence. Without RANK/WORLD_SIZE, the ones set by other launchers are
used: Open MPI's ``mpirun`` (OMPI_COMM_WORLD_RANK/SIZE), PMI-based launchers
(PMI_RANK/PMI_SIZE: MPICH, Intel MPI) and Slurm's ``srun`` (SLURM_PROCID/SLURM_NTASKS).
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Optional

from .._store.base import Store
from .common import job_store
from .tcp import connect_tcp_store

__all__ = ["env_rendezvous", "LAUNCHER_VARIABLES"]

#: (rank variable, world size variable) pairs, in order of preference.
LAUNCHER_VARIABLES = (
    ("RANK", "WORLD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("SLURM_PROCID", "SLURM_NTASKS"),
)


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"env:// rendezvous: environment variable {name}={value!r} is not an integer") from None


def _from_launchers(index: int) -> Optional[int]:
    for pair in LAUNCHER_VARIABLES:
        value = _env_int(pair[index])
        if value is not None:
            return value
    return None


def env_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    if rank < 0:
        rank = _from_launchers(0) if _from_launchers(0) is not None else -1
    if world_size < 0:
        world_size = _from_launchers(1) if _from_launchers(1) is not None else -1
    if rank < 0:
        raise ValueError("env:// rendezvous: environment variable RANK is not set (nor passed as rank=)")
    if world_size < 1:
        raise ValueError("env:// rendezvous: environment variable WORLD_SIZE is not set (nor passed as world_size=)")
    port = _env_int("MASTER_PORT")
    if port is None:
        raise ValueError("env:// rendezvous: environment variable MASTER_PORT is not set")
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        if rank != 0:
            raise ValueError("env:// rendezvous: environment variable MASTER_ADDR is not set")
        addr = "0.0.0.0"
    return job_store(connect_tcp_store(addr, port, rank, world_size, timeout), group_name), rank, world_size
