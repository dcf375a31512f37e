"""What the launcher told this process through its environment: ``get_node_local_rank``
and ``is_torchelastic_launched``, as torch.distributed has them, and tdist's
``replaced_rank`` (tdistrun ``--replace-failed``)."""

from __future__ import annotations

import os
from typing import Optional

__all__ = [
    "get_node_local_rank",
    "is_torchelastic_launched",
    "replaced_rank",
    "LOCAL_RANK_VARIABLES",
    "REPLACEMENT_ENV",
]

#: Set by tdistrun (``--replace-failed``) in a worker it started in place of a failed one:
#: the failed worker's global rank.
REPLACEMENT_ENV = "TDIST_REPLACEMENT"

#: Where launchers put the rank of a process among those on its node, in order of
#: preference: tdistrun/torchrun, Open MPI's mpirun, MPICH/Intel MPI, Slurm's srun
#: (only inside a job step, where SLURM_STEP_ID is set, as for env://).
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")


def get_node_local_rank(fallback_rank: Optional[int] = None) -> int:
    """This process's rank on its node, from the first launcher variable set (see
    :data:`LOCAL_RANK_VARIABLES`), else ``fallback_rank``, else a RuntimeError."""
    for name in LOCAL_RANK_VARIABLES:
        if name == "SLURM_LOCALID" and "SLURM_STEP_ID" not in os.environ:
            continue
        value = os.environ.get(name, "")
        if value:
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"get_node_local_rank: {name}={value!r} is not an integer") from None
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError(
        f"get_node_local_rank: none of {', '.join(LOCAL_RANK_VARIABLES)} is set (launch with tdistrun, "
        "torchrun, mpirun or srun), and no fallback_rank was given"
    )


def is_torchelastic_launched() -> bool:
    """Whether torchelastic (``torchrun``) started this process (TORCHELASTIC_RUN_ID is set)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def replaced_rank() -> Optional[int]:
    """The global rank of the failed worker this process replaces, when tdistrun started
    it as a replacement (``--replace-failed``): it then joins the running job with
    :func:`tdist.join_process_group` instead of ``init_process_group``. Else None."""
    value = os.environ.get(REPLACEMENT_ENV, "")
    try:
        return int(value) if value else None
    except ValueError:
        raise ValueError(f"replaced_rank: {REPLACEMENT_ENV}={value!r} is not an integer") from None
