"""``env://``: read the rendezvous from environment variables.

``MASTER_ADDR`` (rank 0's address; rank 0 without it listens on every interface),
``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK``; arguments to ``init_process_group``
take precedence. Without RANK/WORLD_SIZE, the ones set by other launchers are
used: Open MPI's ``mpirun`` (OMPI_COMM_WORLD_RANK/SIZE), PMI-based launchers
(PMI_RANK/PMI_SIZE: MPICH, Intel MPI) and Slurm's ``srun`` (SLURM_PROCID/SLURM_NTASKS).

The store, in order of preference:

1. ``TDIST_STORE_ADDR``/``TDIST_STORE_PORT``: a tdist TCPStore someone else hosts
   (tdistrun does with ``TDIST_STORE_TOKEN`` set); every rank joins it as a client.
2. ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun, tdistrun): the agent's torch
   TCPStore at ``MASTER_ADDR:MASTER_PORT``; every rank joins it as a client. It cannot
   authenticate, so with ``TDIST_STORE_TOKEN`` set this is refused.
3. Otherwise rank 0 hosts a TCPStore at ``MASTER_PORT`` and the others connect.

``TDIST_STORE_PREFIX`` puts the keys under a prefix (tdistrun: fresh per attempt);
in the agent's store without it, the prefix is ``tdist/attempt_<TORCHELASTIC_RESTART_COUNT>``,
so that a restarted group does not read the keys its failed predecessor left there.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Optional

from datetime import timedelta

from .._errors import DistNetworkError, DistStoreError
from .._store import PrefixStore, TCPStore, TorchStore
from .._store.base import Store
from .._store.tcp_store import TOKEN_ENV
from .common import check_rank, job_store
from .tcp import connect_tcp_store

__all__ = ["env_rendezvous", "LAUNCHER_VARIABLES", "STORE_ADDR", "STORE_PORT", "STORE_PREFIX"]

#: A tdist TCPStore hosted for the job (tdistrun's, with a token): preferred to MASTER_ADDR/PORT.
STORE_ADDR, STORE_PORT = "TDIST_STORE_ADDR", "TDIST_STORE_PORT"
#: The prefix of the job's keys in the store.
STORE_PREFIX = "TDIST_STORE_PREFIX"

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


def _master(hosting: bool) -> tuple[str, int]:
    """MASTER_ADDR and MASTER_PORT; a process that will host the store may go without
    MASTER_ADDR (it then listens on every interface)."""
    port = _env_int("MASTER_PORT")
    if port is None:
        raise ValueError("env:// rendezvous: environment variable MASTER_PORT is not set")
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        if not hosting:
            raise ValueError("env:// rendezvous: environment variable MASTER_ADDR is not set")
        addr = "0.0.0.0"
    return addr, port


def _uses_agent_store() -> bool:
    """torchrun's test (torch.distributed.rendezvous._torchelastic_use_agent_store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def _join_agent_store(world_size: int, timeout: float) -> Store:
    """A client of the agent's torch TCPStore at MASTER_ADDR:MASTER_PORT, as a tdist store."""
    if os.environ.get(TOKEN_ENV):
        raise DistStoreError(
            f"env:// rendezvous: {TOKEN_ENV} is set, but this launcher's store (torchrun's agent store at "
            "MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) is a torch TCPStore, which cannot "
            "authenticate. Launch with tdistrun (with a token it also hosts an authenticated tdist store), "
            f"or unset {TOKEN_ENV}."
        )
    addr, port = _master(hosting=False)
    import torch.distributed

    try:
        store = torch.distributed.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise DistNetworkError(
            f"env:// rendezvous: cannot join the launcher's agent store at {addr}:{port} "
            f"(TORCHELASTIC_USE_AGENT_STORE=True): {exc}"
        ) from exc
    return TorchStore(store, timedelta(seconds=timeout))


def _store(rank: int, world_size: int, timeout: float) -> Store:
    """The job's store (see the module docstring for the order of preference)."""
    prefix = os.environ.get(STORE_PREFIX)
    if os.environ.get(STORE_ADDR):
        port = _env_int(STORE_PORT)
        if port is None:
            raise ValueError(f"env:// rendezvous: {STORE_ADDR} is set but {STORE_PORT} is not")
        store: Store = TCPStore(
            os.environ[STORE_ADDR],
            port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    elif _uses_agent_store():
        store = _join_agent_store(world_size, timeout)
        prefix = prefix or f"tdist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    else:
        addr, port = _master(hosting=rank == 0)
        store = connect_tcp_store(addr, port, rank, world_size, timeout)
    return PrefixStore(prefix, store, owns=True) if prefix else store


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
    return job_store(_store(rank, world_size, timeout), group_name), rank, world_size
