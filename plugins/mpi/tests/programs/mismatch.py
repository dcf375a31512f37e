"""Ranks issuing different collectives, with TDIST_MPI_CHECK_COLLECTIVES=1: every rank
raises DistBackendError promptly, and the world still works after it.
Run: mpirun -n 2 python mismatch.py op,dtype,root,size"""
import sys

import torch

import tdist as dist

dist.init_process_group("mpi")
r = dist.get_rank()


def mismatch(kind):
    try:
        if kind == "op":
            t = torch.full((4,), float(r + 1))
            if r == 0:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
        elif kind == "dtype":
            t = torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32)
            dist.all_reduce(t)
        elif kind == "root":
            t = torch.full((4,), float(r))
            dist.broadcast(t, src=r)
        elif kind == "size":
            t = torch.ones(4 + r)
            dist.all_reduce(t)
    except dist.DistBackendError as exc:
        print(f"MISMATCH DETECTED {kind} rank {r}: {exc}", flush=True)
    else:
        print(f"MISMATCH MISSED {kind} rank {r}: {t.tolist()}", flush=True)
    t = torch.ones(2)
    dist.all_reduce(t)  # the world still works
    assert t.tolist() == [2.0, 2.0]


for kind in sys.argv[1].split(","):
    mismatch(kind)
print(f"STILL WORKS rank {r}", flush=True)
