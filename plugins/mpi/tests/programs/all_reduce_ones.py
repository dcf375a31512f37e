"""init_process_group("mpi") and an all_reduce of ones: prints the rank, world size and sum."""

import torch

import tdist as dist

dist.init_process_group("mpi")
t = torch.ones(1)
dist.all_reduce(t)
print(f"RESULT rank={dist.get_rank()} size={dist.get_world_size()} sum={t.item():g}", flush=True)
