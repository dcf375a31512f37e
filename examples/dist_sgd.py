#!/usr/bin/env python
"""The tutorial's distributed synchronous SGD (dist_tuto.rst), with ``import tdist as dist``.

MNIST is replaced by a synthetic classification set generated from a fixed seed,
so the demo needs no download. Run directly to spawn the processes itself:

    python examples/dist_sgd.py --world-size 4 --backend tcp
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from math import ceil
from random import Random

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import tdist as dist


class Partition:
    """Dataset partitioning helper (from the tutorial)."""

    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        return self.data[self.index[index]]


class DataPartitioner:
    """Splits a dataset into shuffled partitions of the given fractions (from the tutorial)."""

    def __init__(self, data, sizes=(0.7, 0.2, 0.1), seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()
        rng.seed(seed)
        indexes = list(range(len(data)))
        rng.shuffle(indexes)
        for frac in sizes:
            part_len = int(frac * len(data))
            self.partitions.append(indexes[:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def synthetic_dataset(samples: int = 4096, features: int = 32, classes: int = 10):
    """A fixed, learnable classification problem: labels from a random linear map."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=gen)
    w = torch.randn(features, classes, generator=gen)
    y = (x @ w).argmax(dim=1)
    return list(zip(x, y))


class Net(nn.Module):
    def __init__(self, features: int = 32, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(features, 64)
        self.fc2 = nn.Linear(64, classes)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def partition_dataset():
    dataset = synthetic_dataset()
    size = dist.get_world_size()
    bsz = 128 // size
    partition = DataPartitioner(dataset, [1.0 / size for _ in range(size)]).use(dist.get_rank())
    return torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True), bsz


def average_gradients(model):
    """Gradient averaging (from the tutorial)."""
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


def run(rank: int, size: int, epochs: int) -> None:
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    num_batches = ceil(len(train_set.dataset) / float(bsz))
    start = time.perf_counter()
    for epoch in range(epochs):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print(f"Rank {dist.get_rank()}, epoch {epoch}: loss {epoch_loss / num_batches:.4f}", flush=True)
    if rank == 0:
        print(f"done: {epochs} epochs on {size} ranks in {time.perf_counter() - start:.2f} s", flush=True)


def init_process(rank: int, size: int, backend: str, port: int, epochs: int) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=size)
    try:
        run(rank, size, epochs)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--backend", default="tcp")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher
        dist.init_process_group(args.backend)
        try:
            run(dist.get_rank(), dist.get_world_size(), args.epochs)
        finally:
            dist.destroy_process_group()
        return 0
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=init_process, args=(r, args.world_size, args.backend, port, args.epochs))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(abs(p.exitcode or 0) for p in procs)


if __name__ == "__main__":
    sys.exit(main())
