"""Bad arguments raise clear errors before any communication (single process)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

import tdist as dist



def test_op_before_init_raises():
    with pytest.raises(dist.DistError, match="not initialized"):
        dist.all_reduce(torch.ones(1))
    with pytest.raises(dist.DistError, match="not initialized"):
        dist.get_rank()


def test_unknown_backend_names_installed_and_package():
    with pytest.raises(dist.DistError, match=r"'nosuch' is not installed \(installed: .*tcp.*\); pip install tdist-nosuch"):
        dist.init_process_group("nosuch", store=dist.HashStore(), rank=0, world_size=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=2, world_size=2), "out of range"),
        (dict(rank=0, world_size=-2), "world_size must be a positive"),
        (dict(rank=0, world_size=0, store=dist.HashStore()), "world_size must be a positive"),
        (dict(init_method="tcp://127.0.0.1", rank=0, world_size=1), "port number missing"),
        (dict(init_method="tcp://:29500", rank=0, world_size=1), "host missing"),
        (dict(init_method="nosuch://x", rank=0, world_size=1), r"no rendezvous handler for nosuch:// \(installed: env://"),
        (dict(init_method="127.0.0.1:29500", rank=0, world_size=1), "no scheme"),
        (dict(init_method="file://", rank=0, world_size=1), "path missing"),
        (dict(init_method="tcp://127.0.0.1:1?rank=x", world_size=1), "not an integer"),
        (dict(init_method="tcp://127.0.0.1:1?rank=1", rank=0, world_size=2), "conflicting values for rank"),
    ],
)
def test_bad_init_arguments(kwargs, message, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises((ValueError, dist.DistError), match=message):
        dist.init_process_group("tcp", timeout=timedelta(seconds=2), **kwargs)
    assert not dist.is_initialized()


def test_env_method_names_missing_variable(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        dist.init_process_group("tcp")


def test_init_twice(world1):
    with pytest.raises(dist.DistError, match="already initialized"):
        dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1)


def test_world_of_one_runs_every_collective(world1):
    t = torch.arange(4.0)
    dist.all_reduce(t)
    assert t.tolist() == [0, 1, 2, 3]
    out = [torch.zeros(4)]
    dist.all_gather(out, t)
    assert torch.equal(out[0], t)
    assert dist.get_rank() == 0 and dist.get_world_size() == 1 and dist.get_backend() == "tcp"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: dist.broadcast(torch.ones(1), src=1), "src=1 is not a rank of group"),
        (lambda: dist.reduce(torch.ones(1), dst=-1), "not a valid rank"),
        (lambda: dist.send(torch.ones(1), dst=0), "own rank"),
        (lambda: dist.recv(torch.ones(1), src=5), "not a rank of group"),
        (lambda: dist.all_gather([], torch.ones(1)), "tensor_list is empty"),
        (lambda: dist.all_gather([torch.ones(1), torch.ones(1)], torch.ones(1)), "has 2 tensors but the group has 1"),
        (lambda: dist.all_gather([torch.ones(2)], torch.ones(1)), "has 2 elements, expected 1"),
        (lambda: dist.all_gather([torch.ones(1, dtype=torch.int32)], torch.ones(1)), "dtype"),
        (lambda: dist.all_reduce([1.0]), "must be a torch.Tensor"),
        (lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BAND), "BAND"),
        (lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.PREMUL_SUM), "make_premul_sum"),
        (lambda: dist.all_reduce(torch.ones(1), op="sum"), "ReduceOp"),
        (lambda: dist.all_gather_into_tensor(torch.ones(3), torch.ones(2)), "expected 1 × 2"),
        (lambda: dist.all_to_all_single(torch.ones(2), torch.ones(2), [1], [2]), "sums to 1"),
        (lambda: dist.gather(torch.ones(1), [torch.ones(1)], dst=3), "dst=3"),
        (lambda: dist.new_group([0, 0]), "duplicates"),
        (lambda: dist.new_group([1]), "out of range"),
        (lambda: dist.send(torch.ones(1), dst=0, tag="x"), "tag must be an int"),
    ],
)
def test_bad_arguments_raise_and_world_keeps_working(world1, call, message):
    with pytest.raises((ValueError, TypeError, dist.DistError), match=message):
        call()
    t = torch.ones(3)
    dist.all_reduce(t)
    assert t.tolist() == [1, 1, 1]


def test_reduce_op_names_and_deprecated_alias():
    assert {op.name for op in dist.ReduceOp} == {
        "SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR", "AVG", "PREMUL_SUM"
    }
    with pytest.warns(FutureWarning):
        assert dist.reduce_op.SUM is dist.ReduceOp.SUM
    assert dist.make_premul_sum(2.0).factor == 2.0
    assert dist._make_nccl_premul_sum(0.5).op is dist.ReduceOp.PREMUL_SUM
