"""Ranks issuing different collectives, with TDIST_MPI_CHECK_COLLECTIVES=1: every rank
raises DistBackendError promptly, and the world still works after it. The mismatches
are the conformance kit's own (tdist.testing.scenarios).
Run: mpirun -n 2 python mismatch.py op,size,dtype_float64,dtype_int32,root"""

import sys

import torch

import tdist as dist
from tdist.testing.scenarios import _w_mismatch

dist.init_process_group("mpi")
r = dist.get_rank()

for kind in sys.argv[1].split(","):
    outcome = _w_mismatch(kind)
    if "DistBackendError" in outcome.get("mro", ()):
        print(f"MISMATCH DETECTED {kind} rank {r}: {outcome['message']}", flush=True)
    else:
        print(f"MISMATCH MISSED {kind} rank {r}: {outcome}", flush=True)
    t = torch.ones(2)
    dist.all_reduce(t)  # the world still works
    assert t.tolist() == [2.0, 2.0]
print(f"STILL WORKS rank {r}", flush=True)
