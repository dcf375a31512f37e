"""A training loop that survives a lost rank, run by tests/test_shrink_training.py in 4
real processes (RANK/WORLD_SIZE/MASTER_* set as a launcher would):

    python tests/survivor_training.py --ddp torch|tdist --loss kill|stop --out DIR [--replacer self|launcher]

Every step each rank trains on its shard of one global batch (rows ``rank::world``)
through DDP. At step ``LOSS_STEP`` the last rank is lost mid-step: SIGKILLed (``kill``)
or SIGSTOPped past the group's timeout (``stop``). The survivors' backward fails; they
``tdist.shrink_group`` the lost rank away, rebuild DDP on the new default group, redo
the step and train on. With ``--replacer self``, rank 0 starts a replacement process
(``--joiner``); with ``--replacer launcher``, ``tdistrun --tolerate-failures 1
--replace-failed`` starts it (``tdist.replaced_rank()`` is set there). The replacement
calls ``tdist.join_process_group``; at step ``GROW_STEP`` the
survivors ``tdist.grow_group(min_joiners=1)``, rebuild DDP (its constructor sends rank
0's parameters to the newcomer) and send the optimizer state and the step with
``broadcast_object_list``. Each rank saves its parameters and the world sizes it
trained with to ``DIR/rank<N>.pt``; rank 0 kills the stopped rank at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import tdist
import torch
import torch.nn.functional as F

FEATURES, OUTPUTS, BATCH, STEPS, LOSS_STEP, GROW_STEP = 8, 4, 24, 8, 3, 5
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
    opt = optimizer(net)
    for step, world in enumerate(world_sizes):
        x, y = batch(step)
        opt.zero_grad()
        for r in range(world):
            (F.mse_loss(net(x[r::world]), y[r::world]) / world).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # state a newcomer must receive


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
    parser.add_argument("--replacer", choices=("self", "launcher"), help="who starts the replacement")
    parser.add_argument("--joiner", action="store_true", help="this process is the replacement")
    args = parser.parse_args()
    net = model()
    opt = optimizer(net)
    joiner = args.joiner or tdist.replaced_rank() is not None
    if joiner:
        tdist.join_process_group("tcp", timeout=timedelta(seconds=60))
        first_rank, n, pids = -1, 0, []
        ddp = wrap(net, args.ddp)  # receives rank 0's parameters
        state = [None, None, None]
        tdist.broadcast_object_list(state, src=0)
        opt.load_state_dict(state[0])
        sizes, step, recovery_s = state[1], state[2], None
    else:
        tdist.init_process_group("tcp", timeout=timedelta(seconds=TIMEOUT_S))
        first_rank, n = tdist.get_rank(), tdist.get_world_size()
        pids = [None] * n
        tdist.all_gather_object(pids, os.getpid())
        ddp = wrap(net, args.ddp)
        sizes, step, recovery_s = [], 0, None
    replacement = None
    while step < STEPS:
        if args.replacer and step == GROW_STEP and tdist.get_world_size() < n:
            if first_rank == 0 and args.replacer == "self":
                replacement = subprocess.Popen([sys.executable, *sys.argv, "--joiner"])
            tdist.grow_group(min_joiners=1, timeout=timedelta(seconds=60))
            ddp = wrap(net, args.ddp)  # a new DDP on the grown group: the newcomer gets the parameters
            tdist.broadcast_object_list([opt.state_dict(), sizes, step], src=0)
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
            failed = tdist.failed_ranks()  # as every survivor agrees
            assert failed == [n - 1], f"the survivors agree that ranks {failed} failed"
            tdist.shrink_group(failed)
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
    torch.save(result, os.path.join(args.out, "joiner.pt" if joiner else f"rank{first_rank}.pt"))
    tdist.barrier()
    if first_rank == 0 and args.loss == "stop":
        os.kill(pids[n - 1], signal.SIGKILL)
    tdist.destroy_process_group()
    if replacement is not None:
        replacement.wait(timeout=60)


if __name__ == "__main__":
    main()
