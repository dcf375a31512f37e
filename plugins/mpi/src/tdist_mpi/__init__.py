"""tdist-mpi: the ``mpi`` backend for tdist (MPI through mpi4py, launched by mpirun).

Importing this package loads neither mpi4py nor an MPI library; see
:mod:`tdist_mpi.plugin` for the hooks and :mod:`tdist_mpi.backend` for the backend.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["init_mpi", "__version__"]


def init_mpi() -> Any:
    """Initialise MPI as the ``mpi`` backend wants it and return ``mpi4py.MPI``.

    Call it instead of ``from mpi4py import MPI`` when the program needs MPI before
    ``init_process_group("mpi")``: MPI_THREAD_MULTIPLE, MPI_Init with the GIL released,
    and Open MPI's nonblocking allreduce set to reduce-scatter + allgather (its default, a
    binomial tree, is ~3x slower at 16 MiB). An MPI initialised by mpi4py first keeps
    mpi4py's settings (the backend then warns about the allreduce algorithm)."""
    from ._runtime import runtime

    return runtime().MPI
