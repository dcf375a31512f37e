"""One rank raises while the others wait on it; the job must end promptly, non-zero.

``abort.py recv``       rank 0 waits in recv from the last rank, which raises
``abort.py collective`` every rank but the last waits in all_reduce; the last raises
``abort.py mismatch``   every rank passes rank=0: a clear error on every rank (caught, rc 0)
"""

import sys
from datetime import timedelta

import torch

import tdist as dist

mode = sys.argv[1]
if mode == "mismatch":
    try:
        dist.init_process_group("mpi", rank=0, world_size=int(sys.argv[2]))
    except ValueError as exc:
        print(f"MISMATCH ERROR: {exc}", flush=True)
    else:
        from mpi4py import MPI

        assert MPI.COMM_WORLD.rank == 0, "rank=0 accepted on a rank that is not MPI rank 0"
        print("MISMATCH ACCEPTED on rank 0", flush=True)
    sys.exit(0)

dist.init_process_group("mpi", timeout=timedelta(minutes=10))
rank, n = dist.get_rank(), dist.get_world_size()
last = n - 1
print(f"ready {rank}", flush=True)
if rank == last:
    raise RuntimeError(f"boom on rank {rank}")
if mode == "recv":
    if rank == 0:
        dist.recv(torch.zeros(1), src=last)
    else:
        dist.barrier()
else:
    dist.all_reduce(torch.ones(4))
print(f"NOT ABORTED {rank}", flush=True)
