"""tdist-mpi: the ``mpi`` backend for tdist (MPI through mpi4py, launched by mpirun).

Importing this package loads neither mpi4py nor an MPI library; see
:mod:`tdist_mpi.plugin` for the hooks and :mod:`tdist_mpi.backend` for the backend.
"""

__version__ = "0.1.0"
