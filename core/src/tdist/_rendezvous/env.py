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
from .common import check_rank, job_store
from .tcp import connect_tcp_store

__all__ = ["env_rendezvous", "LAUNCHER_VARIABLES"]

#: (rank variable, world size variable) pairs, in order of preference. Both values
#: come from the same launcher; Slurm's are used only inside a job step (``srun``),
#: where SLURM_STEP_ID is set, not in the batch script itself.
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


def _launcher_pairs() -> list[tuple[str, str]]:
    pairs = list(LAUNCHER_VARIABLES)
    if "SLURM_STEP_ID" not in os.environ:
        pairs.remove(("SLURM_PROCID", "SLURM_NTASKS"))
    return pairs


def _rank_and_size(rank: int, world_size: int) -> tuple[int, int]:
    """Rank and world size from the arguments, else from one launcher's variables."""
    for rank_var, size_var in _launcher_pairs():
        env_rank, env_size = _env_int(rank_var), _env_int(size_var)
        if rank < 0 and env_rank is not None:
            if world_size < 0 and env_size is None:
                raise ValueError(f"env:// rendezvous: {rank_var} is set but {size_var} is not")
            return env_rank, world_size if world_size >= 0 else env_size  # type: ignore[return-value]
        if rank >= 0 and world_size < 0 and env_size is not None:
            return rank, env_size
    return rank, world_size


def env_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    rank, world_size = _rank_and_size(rank, world_size)
    if rank < 0:
        raise ValueError("env:// rendezvous: environment variable RANK is not set (nor passed as rank=)")
    if world_size < 1:
        raise ValueError("env:// rendezvous: environment variable WORLD_SIZE is not set (nor passed as world_size=)")
    check_rank("env", rank, world_size)
    port = _env_int("MASTER_PORT")
    if port is None:
        raise ValueError("env:// rendezvous: environment variable MASTER_PORT is not set")
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        if rank != 0:
            raise ValueError("env:// rendezvous: environment variable MASTER_ADDR is not set")
        addr = "0.0.0.0"
    return job_store(connect_tcp_store(addr, port, rank, world_size, timeout), group_name), rank, world_size
