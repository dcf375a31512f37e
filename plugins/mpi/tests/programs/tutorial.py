"""The MPI section of "Writing Distributed Applications with PyTorch" (dist_tuto.rst):
the tutorial's init_process and run functions, launched by ``mpirun -n N``.

``python tutorial.py``             -> init_process(0, 0, run, backend='mpi'), as the tutorial says
``python tutorial.py no-args``     -> dist.init_process_group('mpi') with no rank / world_size
"""

import os
import sys

import torch

import tdist as dist


def run(rank, size):
    """Simple collective communication (the tutorial's all_reduce over a group) plus
    its blocking point-to-point example."""
    group = dist.new_group([0, 1] if size > 1 else [0])
    tensor = torch.ones(1)
    if rank in (0, 1):
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])
    tensor = torch.zeros(1)
    if size > 1:
        if rank == 0:
            tensor += 1
            dist.send(tensor=tensor, dst=1)
        elif rank == 1:
            dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " p2p data ", tensor[0])
    assert float(dist.get_world_size()) == size


def init_process(rank, size, fn, backend="gloo"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(dist.get_rank(), dist.get_world_size())


if __name__ == "__main__":
    if sys.argv[1:] == ["no-args"]:
        dist.init_process_group("mpi")
        run(dist.get_rank(), dist.get_world_size())
    else:
        init_process(0, 0, run, backend="mpi")
    print(f"TUTORIAL OK rank {dist.get_rank()} of {dist.get_world_size()}", flush=True)
