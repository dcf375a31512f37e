"""A job that goes wrong on purpose, for the flight recorder's tests.

    faulty.py BACKEND MODE TIMEOUT_S

MODE ``skip``: rank 2 skips the third all_reduce (the others wait in #5 for it).
MODE ``stop``: rank 1 stops itself (SIGSTOP) before the third all_reduce.
MODE ``root``: broadcast with a root that differs between ranks (rank r uses r % 2).
Ranks come from the environment (tdistrun, torchrun or mpirun).
"""

import os
import signal
import sys
from datetime import timedelta

import torch

import tdist as dist

backend, mode, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
rank = dist.get_rank()
t = torch.ones(4)
if mode == "root":
    dist.all_reduce(t)
    dist.broadcast(t, src=rank % 2)
    dist.barrier()
else:
    for i in range(5):
        if i == 2 and mode == "skip" and rank == 2:
            continue
        if i == 2 and mode == "stop" and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(t)
dist.destroy_process_group()
