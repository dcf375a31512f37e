"""tdist-gloo: torch's gloo (``torch.distributed.ProcessGroupGloo``) as the tdist backend ``gloo``.

Importing this package imports neither torch nor the backend; the backend module
(:mod:`tdist_gloo.backend`) is imported by the factory when a group is built.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from tdist.plugin import ANY_SOURCE_OP, COLLECTIVES
from tdist.plugin import OPERATIONS as _ALL

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "BACKEND_NAME",
    "CHECK_ENV",
    "CPU_OPERATIONS",
    "CUDA_OPERATIONS",
    "OPERATIONS",
    "unavailable_reason",
]

BACKEND_NAME = "gloo"
#: Set to 1 (or ``pg_options={"gloo_check_collectives": True}``) to check every collective
#: first (tdist's collective check, one extra all-gather per collective).
CHECK_ENV = "TDIST_GLOO_CHECK_COLLECTIVES"

#: Every tdist operation works on CPU tensors (those gloo lacks are built on what it has).
CPU_OPERATIONS = frozenset(_ALL) | {ANY_SOURCE_OP}

#: CUDA tensors: the collectives (gloo stages them through pinned host memory: broadcast,
#: allreduce, reduce, allgather, gather, scatter and alltoall_base; all_to_all,
#: reduce_scatter and reduce_scatter_tensor are built here on alltoall_base / allreduce).
#: gloo's send/recv take host pointers only: no CUDA point-to-point.
CUDA_OPERATIONS = frozenset(COLLECTIVES)

OPERATIONS = {"cpu": CPU_OPERATIONS, "cuda": CUDA_OPERATIONS}


def unavailable_reason() -> Optional[str]:
    """None when torch's gloo can be used here, else why not.

    Finds torch without importing it when it is missing; otherwise imports
    ``torch.distributed`` to ask whether this build of torch has gloo.
    """
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    try:
        import torch.distributed as td
    except Exception as exc:  # a broken torch install must not break plugin loading
        return f"torch.distributed cannot be imported: {type(exc).__name__}: {exc}"
    if not td.is_available():
        return "this build of torch has no torch.distributed support"
    if not td.is_gloo_available():
        return "this build of torch was compiled without gloo (torch.distributed.is_gloo_available() is False)"
    return None
