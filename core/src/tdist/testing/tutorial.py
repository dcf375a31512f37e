"""The programs of "Writing Distributed Applications with PyTorch" (pytorch/tutorials: intermediate_source/dist_tuto.rst),
verbatim apart from the import (``dist`` is the module under test), run as bodies.

The MNIST data of the distributed SGD example is replaced by a small synthetic
classification set (no download); ``Partition``, ``DataPartitioner``,
``average_gradients`` and the ring ``allreduce`` are the tutorial's code unchanged.
"""

from __future__ import annotations

import contextlib
import io
from math import ceil
from random import Random

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

from ._registry import body
from .helpers import assert_tensor, assert_true
from .helpers import dist  # the module under test: "import tdist as dist"

__all__ = [
    "tutorial_blocking_p2p",
    "tutorial_nonblocking_p2p",
    "tutorial_all_reduce_group",
    "tutorial_distributed_sgd",
    "tutorial_ring_allreduce",
]


def _capture(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    return out.getvalue()


# --------------------------------------------------------------------------- Point-to-Point
"""Blocking point-to-point communication."""


def run_blocking(rank, size):
    tensor = torch.zeros(1)
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        dist.send(tensor=tensor, dst=1)
    else:
        # Receive tensor from process 0
        dist.recv(tensor=tensor, src=0)
    print("Rank ", rank, " has data ", tensor[0])


"""Non-blocking point-to-point communication."""


def run_nonblocking(rank, size):
    tensor = torch.zeros(1)
    req = None
    if rank == 0:
        tensor += 1
        # Send the tensor to process 1
        req = dist.isend(tensor=tensor, dst=1)
        print("Rank 0 started sending")
    else:
        # Receive tensor from process 0
        req = dist.irecv(tensor=tensor, src=0)
        print("Rank 1 started receiving")
    req.wait()
    print("Rank ", rank, " has data ", tensor[0])


@body(suite="tutorial", min_world_size=2)
def tutorial_blocking_p2p():
    """The tutorial's blocking send/recv program (on ranks 0 and 1): both end with 1.0."""
    rank = dist.get_rank()
    if rank < 2:
        printed = _capture(run_blocking, rank, 2)
        assert_true("has data  tensor(1.)" in printed, f"rank {rank} printed {printed!r}")
    dist.barrier()


@body(suite="tutorial", min_world_size=2)
def tutorial_nonblocking_p2p():
    """The tutorial's isend/irecv program (on ranks 0 and 1): both end with 1.0 after wait()."""
    rank = dist.get_rank()
    if rank < 2:
        printed = _capture(run_nonblocking, rank, 2)
        assert_true("has data  tensor(1.)" in printed, f"rank {rank} printed {printed!r}")
        assert_true(("started sending" if rank == 0 else "started receiving") in printed, printed)
    dist.barrier()


# ---------------------------------------------------------------------- Collective Communication
""" All-Reduce example."""


def run_all_reduce(rank, size):
    """Simple collective communication."""
    group = dist.new_group([0, 1])
    tensor = torch.ones(1)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    print("Rank ", rank, " has data ", tensor[0])


@body(suite="tutorial", min_world_size=2)
def tutorial_all_reduce_group():
    """The tutorial's all-reduce in new_group([0, 1]): members get 2.0, other ranks keep 1.0."""
    rank, size = dist.get_rank(), dist.get_world_size()
    printed = _capture(run_all_reduce, rank, size)
    expected = "tensor(2.)" if rank < 2 else "tensor(1.)"
    assert_true(f"has data  {expected}" in printed, f"rank {rank} printed {printed!r}, expected {expected}")


# --------------------------------------------------------------------------- Distributed Training
""" Dataset partitioning helper """


class Partition(object):
    def __init__(self, data, index):
        self.data = data
        self.index = index

    def __len__(self):
        return len(self.index)

    def __getitem__(self, index):
        data_idx = self.index[index]
        return self.data[data_idx]


class DataPartitioner(object):
    def __init__(self, data, sizes=[0.7, 0.2, 0.1], seed=1234):
        self.data = data
        self.partitions = []
        rng = Random()  # from random import Random
        rng.seed(seed)
        data_len = len(data)
        indexes = [x for x in range(0, data_len)]
        rng.shuffle(indexes)

        for frac in sizes:
            part_len = int(frac * data_len)
            self.partitions.append(indexes[0:part_len])
            indexes = indexes[part_len:]

    def use(self, partition):
        return Partition(self.data, self.partitions[partition])


def synthetic_dataset(n=512, features=20, classes=4, seed=0):
    """Instead of MNIST: linearly separable-ish points, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, features, generator=gen) * 3
    target = torch.arange(n) % classes
    data = centers[target] + torch.randn(n, features, generator=gen)
    return [(data[i], int(target[i])) for i in range(n)]


""" Partitioning MNIST (here: a synthetic set) """


def partition_dataset():
    dataset = synthetic_dataset()
    size = dist.get_world_size()
    bsz = 128 // size
    partition_sizes = [1.0 / size for _ in range(size)]
    partition = DataPartitioner(dataset, partition_sizes)
    partition = partition.use(dist.get_rank())
    train_set = torch.utils.data.DataLoader(partition, batch_size=bsz, shuffle=True)
    return train_set, bsz


class Net(nn.Module):
    """A small classifier in place of the tutorial's MNIST convnet."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(20, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


""" Gradient averaging. """


def average_gradients(model):
    size = float(dist.get_world_size())
    for param in model.parameters():
        dist.all_reduce(param.grad.data, op=dist.ReduceOp.SUM)
        param.grad.data /= size


""" Distributed Synchronous SGD Example """


def run_sgd(rank, size, epochs=10):
    torch.manual_seed(1234)
    train_set, bsz = partition_dataset()
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=0.01, momentum=0.5)

    num_batches = ceil(len(train_set.dataset) / float(bsz))
    losses = []
    for epoch in range(epochs):
        epoch_loss = 0.0
        for data, target in train_set:
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            epoch_loss += loss.item()
            loss.backward()
            average_gradients(model)
            optimizer.step()
        print("Rank ", dist.get_rank(), ", epoch ", epoch, ": ", epoch_loss / num_batches)
        losses.append(epoch_loss / num_batches)
    return model, losses


@body(suite="tutorial", timeout=180)
def tutorial_distributed_sgd():
    """The tutorial's synchronous SGD with average_gradients: the replicas stay identical
    (checked by gathering every parameter) and the loss goes down."""
    rank, size = dist.get_rank(), dist.get_world_size()
    with contextlib.redirect_stdout(io.StringIO()):
        model, losses = run_sgd(rank, size)
    assert_true(losses[-1] < losses[0] * 0.7, f"loss did not go down: {losses}")
    flat = torch.cat([p.data.reshape(-1) for p in model.parameters()])
    copies = [torch.zeros_like(flat) for _ in range(size)]
    dist.all_gather(copies, flat)
    for i, c in enumerate(copies):
        assert_tensor(c, copies[0], f"parameters of rank {i} vs rank 0 (replicas diverged)", atol=1e-6, rtol=1e-5)
    return losses[-1]


# ----------------------------------------------------------------------------- Ring-Allreduce
""" Implementation of a ring-reduce with addition. """


def allreduce(send, recv):
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


@body(suite="tutorial")
def tutorial_ring_allreduce():
    """The tutorial's ring allreduce built on isend/recv equals dist.all_reduce."""
    rank = dist.get_rank()
    for numel in (1, 7, 1000):
        send = torch.arange(numel, dtype=torch.float32) + 10 * rank
        recv = torch.zeros(numel)
        allreduce(send, recv)
        reference = send.clone()
        dist.all_reduce(reference)
        assert_tensor(recv, reference, f"ring allreduce of {numel} elements")
