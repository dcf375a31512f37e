"""A training loop that survives a lost rank, run by tests/test_shrink_training.py in 4
real processes (RANK/WORLD_SIZE/MASTER_* set as a launcher would):

    python tests/survivor_training.py --ddp torch|tdist --loss kill|stop --out DIR

Every step each rank trains on its shard of one global batch (rows ``rank::world``)
through DDP. At step ``LOSS_STEP`` the last rank is lost mid-step: SIGKILLed (``kill``)
or SIGSTOPped past the group's timeout (``stop``). The survivors' backward fails; they
``tdist.shrink_group`` the lost rank away, rebuild DDP on the new default group, redo
the step and train on. Each survivor saves its parameters and the world sizes it
trained with to ``DIR/rank<N>.pt``; rank 0 kills the stopped rank at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from datetime import timedelta

import tdist
import torch
import torch.nn.functional as F

FEATURES, OUTPUTS, BATCH, STEPS, LOSS_STEP = 8, 4, 24, 6, 3
TIMEOUT_S = 4.0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, OUTPUTS))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, OUTPUTS, generator=gen)


def reference(world_sizes: list[int]) -> list[torch.Tensor]:
    """One process: each step the mean of the shards' gradients, as DDP averages them."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step, world in enumerate(world_sizes):
        x, y = batch(step)
        opt.zero_grad()
        for r in range(world):
            (F.mse_loss(net(x[r::world]), y[r::world]) / world).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def wrap(net: torch.nn.Module, kind: str) -> torch.nn.Module:
    if kind == "torch":
        return torch.nn.parallel.DistributedDataParallel(net)
    return tdist.nn.DistributedDataParallel(net)


def lose_myself(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ddp", choices=("torch", "tdist"), required=True)
    parser.add_argument("--loss", choices=("kill", "stop"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    tdist.init_process_group("tcp", timeout=timedelta(seconds=TIMEOUT_S))
    first_rank, n = tdist.get_rank(), tdist.get_world_size()
    pids: list = [None] * n
    tdist.all_gather_object(pids, os.getpid())
    net = model()
    ddp = wrap(net, args.ddp)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sizes: list[int] = []
    recovery_s = None
    step = 0
    while step < STEPS:
        rank, world = tdist.get_rank(), tdist.get_world_size()
        x, y = batch(step)
        opt.zero_grad()
        out = ddp(x[rank::world])
        if step == LOSS_STEP and first_rank == n - 1:
            lose_myself(args.loss)  # mid-step: the others are already in backward's all_reduce
        try:
            F.mse_loss(out, y[rank::world]).backward()
        except Exception:  # noqa: BLE001 - the lost rank: shrink it away and redo the step
            lost_at = time.monotonic()
            tdist.shrink_group([n - 1])
            ddp = wrap(net, args.ddp)  # a new DDP on the new default group
            recovery_s = time.monotonic() - lost_at
            continue
        opt.step()
        sizes.append(world)
        step += 1
    result = {
        "rank": tdist.get_rank(),
        "first_rank": first_rank,
        "sizes": sizes,
        "params": [p.detach().clone() for p in net.parameters()],
        "reference": reference(sizes),
        "recovery_s": recovery_s,
    }
    torch.save(result, os.path.join(args.out, f"rank{first_rank}.pt"))
    tdist.barrier()
    if first_rank == 0 and args.loss == "stop":
        os.kill(pids[n - 1], signal.SIGKILL)
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
