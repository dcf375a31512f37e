#!/usr/bin/env python
"""Data-parallel training of a small MLP with tdist.nn.DistributedDataParallel.

The data set is synthetic (generated from a fixed seed: a random "teacher"
network labels Gaussian inputs), so nothing is downloaded. Start it with the
launcher, one process per replica:

    tdistrun --nproc_per_node 4 examples/train.py --backend tcp

Every rank prints its progress per epoch; rank 0 then prints a summary: the
global loss and accuracy per epoch, the wall time, and how many gradient bytes
were all-reduced (counted by DistributedDataParallel's ``stats``).
"""

from __future__ import annotations

import time

_PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import tdist as dist  # noqa: E402
from tdist.nn import DistributedDataParallel  # noqa: E402


def synthetic_dataset(samples: int, features: int, classes: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ~ N(0, 1); labels: argmax of a fixed random two-layer teacher network."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    w1 = torch.randn(features, 64, generator=gen) / features**0.5
    w2 = torch.randn(64, classes, generator=gen) / 8
    y = (torch.tanh(x @ w1) @ w2).argmax(dim=1)
    return x, y


def make_model(features: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class SGD:
    """SGD with momentum (the update torch.optim.SGD(lr, momentum) makes).

    Written out because constructing a torch.optim optimizer the first time
    imports torch._dynamo: about 5 s of CPU in each process, longer than this
    whole training on a small machine."""

    def __init__(self, params, lr: float, momentum: float = 0.9) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.momentum = lr, momentum
        self.velocity = [torch.zeros_like(p) for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, v in zip(self.params, self.velocity):
            if p.grad is not None:
                v.mul_(self.momentum).add_(p.grad)
                p.add_(v, alpha=-self.lr)


def shard_indices(samples: int, epoch: int, rank: int, world_size: int, seed: int = 1234) -> torch.Tensor:
    """This rank's share of a permutation that every rank draws identically (as DistributedSampler)."""
    gen = torch.Generator().manual_seed(seed + epoch)
    order = torch.randperm(samples, generator=gen)
    usable = samples - samples % world_size  # equal shares, so every rank runs the same number of steps
    return order[rank:usable:world_size]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="tcp", help="tdist backend (default: tcp)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--samples", type=int, default=8192, help="size of the synthetic data set")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size (split across ranks)")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.05,
        help="DDP bucket size (small here, to show several overlapping buckets)",
    )
    parser.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by the launcher (unused: CPU training)",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    start = time.perf_counter()
    dist.init_process_group(args.backend)  # env:// : RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    init_seconds = time.perf_counter() - start
    if args.batch_size % world_size:
        parser.error(f"--batch-size {args.batch_size} is not divisible by the world size {world_size}")
    local_batch = args.batch_size // world_size

    x, y = synthetic_dataset(args.samples, args.features, args.classes)
    torch.manual_seed(rank)  # different initial weights per rank: DDP broadcasts rank 0's
    model = DistributedDataParallel(
        make_model(args.features, args.hidden, args.classes), bucket_cap_mb=args.bucket_cap_mb
    )
    optimizer = SGD(model.parameters(), lr=args.lr, momentum=0.9)
    n_params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(
            f"training a {n_params:,}-parameter MLP on {args.samples} samples, {world_size} ranks "
            f"({args.backend} backend), global batch {args.batch_size}, {len(model._buckets)} gradient buckets",
            flush=True,
        )

    history = []
    train_start = time.perf_counter()
    setup_seconds = train_start - start - init_seconds
    for epoch in range(args.epochs):
        epoch_start = time.perf_counter()
        model.train()
        indices = shard_indices(args.samples, epoch, rank, world_size)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, samples
        steps = 0
        for begin in range(0, len(indices) - local_batch + 1, local_batch):
            idx = indices[begin : begin + local_batch]
            inputs, target = x[idx], y[idx]
            optimizer.zero_grad()
            output = model(inputs)
            loss = F.cross_entropy(output, target)
            loss.backward()  # gradients are averaged across the ranks during backward
            optimizer.step()
            totals += torch.tensor(
                [loss.item() * len(idx), (output.argmax(1) == target).sum().item(), len(idx)], dtype=torch.float64
            )
            steps += 1
        local_loss = (totals[0] / totals[2]).item()
        dist.all_reduce(totals)  # global loss and accuracy of the epoch
        epoch_seconds = time.perf_counter() - epoch_start
        history.append((epoch + 1, (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item(), epoch_seconds))
        print(
            f"epoch {epoch + 1}/{args.epochs}: {steps} steps, local loss {local_loss:.4f}, {epoch_seconds:.2f} s",
            flush=True,
        )
    train_seconds = time.perf_counter() - train_start

    # Communication counters, summed over the ranks; and a check that the replicas agree.
    stats = model.stats
    counters = torch.tensor([stats.allreduce_bytes, stats.allreduce_calls, stats.wait_seconds], dtype=torch.float64)
    dist.all_reduce(counters)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    drift = torch.tensor([(flat - reference).abs().max().item()])
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)

    if rank == 0:
        print("", flush=True)
        print("summary", flush=True)
        print("  epoch   loss     accuracy   time", flush=True)
        for epoch, loss, accuracy, seconds in history:
            print(f"  {epoch:5d}   {loss:.4f}   {accuracy:7.2%}   {seconds:5.2f} s", flush=True)
        samples_seen = args.epochs * (args.samples - args.samples % args.batch_size)
        print(
            f"  wall time: {time.perf_counter() - _PROCESS_START:.2f} s (imports {start - _PROCESS_START:.2f} s, "
            f"init {init_seconds:.2f} s, setup {setup_seconds:.2f} s, training "
            f"{train_seconds:.2f} s, {samples_seen / train_seconds:,.0f} samples/s)",
            flush=True,
        )
        print(
            f"  all-reduced gradients: {fmt_bytes(stats.allreduce_bytes)} on rank 0 in {stats.allreduce_calls} "
            f"bucket all-reduces ({stats.sync_steps} steps); {fmt_bytes(counters[0].item())} over all "
            f"{world_size} ranks; mean wait at end of backward {counters[2].item() / world_size / max(stats.sync_steps, 1) * 1e3:.2f} ms/step",
            flush=True,
        )
        print(
            f"  replicas identical: {'yes' if drift.item() == 0 else 'NO'} (max |param - rank 0's| = {drift.item():g})",
            flush=True,
        )
    dist.destroy_process_group()
    return 0 if drift.item() <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
