"""How MPI was initialised decides Open MPI's nonblocking allreduce algorithm.
Run: mpirun -n 2 python init_order.py {init_mpi|mpi4py_first}

init_mpi: tdist_mpi.init_mpi() first, then mpi4py.MPI is the same, initialised module and
init_process_group warns about nothing; mpi4py_first: `from mpi4py import MPI` first, and
init_process_group("mpi") warns (RuntimeWarning) how to get the fast algorithm."""

import os
import sys
import warnings

import torch

mode = sys.argv[1]
if mode == "init_mpi":
    from tdist_mpi import init_mpi

    MPI = init_mpi()
    assert MPI.Is_initialized()
    from mpi4py import MPI as again

    assert again is MPI
else:
    from mpi4py import MPI  # noqa: F401
import tdist as dist  # noqa: E402

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.init_process_group("mpi")
messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
t = torch.ones(8)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 8
algorithm = os.environ.get("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "unset")
print(f"RESULT rank {dist.get_rank()} algorithm={algorithm} warnings={len(messages)} {messages}", flush=True)
dist.destroy_process_group()
