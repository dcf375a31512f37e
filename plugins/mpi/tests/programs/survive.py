"""A training-like loop that survives a lost rank under ``mpirun --with-ft ulfm``.

``survive.py kill``  the last rank SIGKILLs itself at step 5
``survive.py stop``  the last rank SIGSTOPs itself at step 5 (the survivors' timeout finds
                     it); at the end rank 0 SIGKILLs it (a stopped process would hold up
                     MPI_Finalize, which waits for every live process)
``survive.py kill0 PORT``  rank 0 SIGKILLs itself at step 5; the job's store is not rank
                     0's (``mpi://``'s) but a TCPStore served outside the job at PORT

Every step all-reduces ``rank + 1`` (global rank at the start). When the loss is noticed,
every survivor prints the agreed failed ranks, shrinks the default group and a subgroup
(``[0, last]``, which holds the lost rank), redoes the step and finishes the loop on the
shrunken world: each survivor prints ``SUMS <rank> <list>`` (one sum per step) and
``DONE <rank>``.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch

import tdist as dist

mode = sys.argv[1]
steps = 12
timeout = timedelta(seconds=6 if mode == "stop" else 60)
if mode == "kill0":
    from tdist_mpi import init_mpi

    world = init_mpi().COMM_WORLD
    store = dist.TCPStore("127.0.0.1", int(sys.argv[2]), is_master=False, timeout=timeout)
    dist.init_process_group("mpi", store=store, rank=world.Get_rank(), world_size=world.Get_size(), timeout=timeout)
else:
    dist.init_process_group("mpi", timeout=timeout)
first, n = dist.get_rank(), dist.get_world_size()
last = n - 1
lost = 0 if mode == "kill0" else last
pair = dist.new_group([0, last])  # a subgroup with the rank that will be lost
pids = [0] * n
dist.all_gather_object(pids, os.getpid())
sums: list[float] = []
step = 0
shrunk = False
while step < steps:
    if first == lost and step == 5:
        os.kill(os.getpid(), signal.SIGSTOP if mode == "stop" else signal.SIGKILL)
    t = torch.full((4,), float(first + 1))
    try:
        dist.all_reduce(t)
    except dist.DistRankFailureError as exc:
        started = time.monotonic()
        assert not shrunk, f"rank {first}: a second failure: {exc}"
        print(f"FAILED {first} {list(exc.failed_ranks)} {type(exc).__name__} at step {step}", flush=True)
        if first in (0, last) and first != lost:  # the subgroup first: the world's shrink destroys it
            alone = dist.shrink_group([0 if lost == 0 else 1], group=pair)
            print(f"PAIR {dist.get_process_group_ranks(alone)}", flush=True)
        dist.shrink_group(list(exc.failed_ranks))
        shrunk = True
        print(
            f"SHRUNK {first} -> {dist.get_rank()}/{dist.get_world_size()} in {time.monotonic() - started:.3f} s",
            flush=True,
        )
        continue  # redo the step on the shrunken world
    sums.append(t[0].item())
    step += 1
dist.barrier()
print(f"SUMS {first} {sums}", flush=True)
if mode == "stop" and first == 0:
    os.kill(pids[lost], signal.SIGKILL)
dist.destroy_process_group()
print(f"DONE {first}", flush=True)
