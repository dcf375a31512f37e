"""The "torch" suite: torch's own utilities over the groups of the module under test.

After ``init_process_group`` torch.distributed's default group is the module's default
group, and the groups either API makes are accepted by both (:mod:`tdist._torch`). These
bodies run torch's utilities -- ``DistributedSampler``, ``DistributedDataParallel``,
FSDP2's ``fully_shard``, distributed checkpointing, ``ZeroRedundancyOptimizer``,
``torch.distributed.nn.functional``, ``Join``, ``SyncBatchNorm`` -- unchanged, and compare
them with torch's own results (torch's gloo in the same processes, or one process).
They run against torch.distributed too (``--tdist-dist-module torch.distributed``),
which validates them.

Collect them with ``collect(globals(), suite="torch")``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from typing import Any, Callable

from ._registry import body
from .helpers import assert_equal, assert_tensor, assert_true, backend_name, check_world_works, dist, is_tdist, raises

__all__ = [
    "shared_default_group",
    "groups_both_ways",
    "distributed_sampler",
    "ddp_matches_gloo",
    "ddp_features_match_gloo",
    "fsdp2_matches_one_process",
    "zero_redundancy_optimizer",
    "functional_all_reduce_autograd",
    "join_uneven_inputs",
    "sync_batch_norm_on_cpu",
    "checkpoint_resharding",
    "unsupported_bridged_ops",
]

FEATURES, HIDDEN, OUTPUTS, BATCH, STEPS = 8, 16, 4, 16, 5
_SLOW = 240.0  # seconds: first use of torch.optim / FSDP / DCP imports a lot on a loaded machine


def _torch() -> Any:
    import torch

    return torch


def _td() -> Any:
    import torch.distributed as torch_dist

    return torch_dist


def _mlp(seed: int = 0) -> Any:
    nn = _torch().nn
    _torch().manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUTPUTS))


def _batch(step: int) -> tuple[Any, Any]:
    torch = _torch()
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, OUTPUTS, generator=gen)


def _shard(t: Any) -> Any:
    return t.chunk(dist.get_world_size())[dist.get_rank()]


def _sgd_step(params: Any, lr: float = 0.1) -> None:
    torch = _torch()
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


def _reference(steps: int = STEPS) -> dict[str, Any]:
    """SGD on the full batch in one process: what every data-parallel replica must end with."""
    F = _torch().nn.functional
    model = _mlp()
    for step in range(steps):
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        _sgd_step(model.parameters())
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_ddp(process_group: Any, steps: int = STEPS) -> dict[str, Any]:
    torch = _torch()
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
    for step in range(steps):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(ddp(_shard(x)), _shard(y)).backward()
        _sgd_step(model.parameters())
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _ours_and_gloo(train: Callable[[Any], dict]) -> tuple[dict, dict]:
    """``train(group)`` over the module's default group, then over torch's own gloo
    (a new group of the same processes)."""
    td = _td()
    ours = train(dist.group.WORLD)
    gloo = td.new_group(backend="gloo")
    try:
        return ours, train(gloo)
    finally:
        td.destroy_process_group(gloo)


def _assert_params(actual: dict, expected: dict, what: str, atol: float = 0.0) -> None:
    assert_equal(sorted(actual), sorted(expected), f"{what}: parameter names")
    for name, value in expected.items():
        assert_tensor(actual[name], value, f"{what}: {name}", atol=atol)


def _same_everywhere(values: Any, what: str) -> None:
    """``values`` (any picklable object) is equal on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    for r, other in enumerate(gathered):
        if isinstance(values, dict):
            for k in values:
                assert_tensor(other[k], values[k], f"{what}: {k} on rank {r}")
        else:
            assert_equal(other, values, f"{what} on rank {r}")


# ---------------------------------------------------------------------------- the groups themselves
@body(suite="torch")
def shared_default_group() -> None:
    """torch.distributed's default group is the module's: same object, rank, size; torch
    reports tdist's backend as ``tdist-<name>``."""
    td = _td()
    assert_true(td.is_initialized(), "torch.distributed is not initialized after init_process_group")
    assert_true(td.group.WORLD is dist.group.WORLD, "torch's group.WORLD is not the module's group.WORLD")
    assert_equal(td.get_rank(), dist.get_rank(), "torch.distributed.get_rank()")
    assert_equal(td.get_world_size(), dist.get_world_size(), "torch.distributed.get_world_size()")
    if is_tdist():
        assert_equal(str(td.get_backend()), f"tdist-{backend_name()}", "torch.distributed.get_backend()")


@body(suite="torch")
def groups_both_ways() -> None:
    """A group made by the module is accepted by torch's functions, a group torch makes
    (``new_group``, ``init_device_mesh``) by the module's; both see one set of operations."""
    torch, td = _torch(), _td()
    from torch.distributed.device_mesh import init_device_mesh

    r, n = dist.get_rank(), dist.get_world_size()
    ours, theirs = dist.new_group(list(range(n))), td.new_group(list(range(n)))
    mesh_group = init_device_mesh("cpu", (n,)).get_group()
    for group, what in ((ours, "module's group"), (theirs, "torch's new_group"), (mesh_group, "device mesh group")):
        t = torch.full((3,), float(r + 1))
        td.all_reduce(t, group=group)
        dist.all_reduce(t, group=group)
        assert_tensor(t, torch.full((3,), float(n * n * (n + 1) / 2)), f"torch then module all_reduce, {what}")
        assert_equal(td.get_process_group_ranks(group), list(range(n)), f"torch get_process_group_ranks, {what}")
        assert_equal(dist.get_world_size(group), n, f"get_world_size, {what}")
    gathered = [torch.zeros(2) for _ in range(n)]
    work = td.all_gather(gathered, torch.full((2,), float(r)), group=ours, async_op=True)
    work.wait()
    assert_true(work.is_completed(), "torch's Work.is_completed() after wait()")
    assert_tensor(
        torch.stack(gathered),
        torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(n, 2),
        "torch all_gather with async_op over the module's group",
    )
    value = torch.full((2,), float(r))
    result = td.all_reduce(value, group=ours, async_op=True).get_future().wait()
    assert_tensor(result[0], torch.full((2,), float(n * (n - 1) / 2)), "torch Work.get_future() value")
    from torch.distributed import _functional_collectives as functional

    reduced = functional.all_reduce(torch.ones(2), "sum", ours).wait()  # torch's C++ side finds the group by name
    assert_tensor(reduced, torch.full((2,), float(n)), "functional all_reduce over the module's group")
    if hasattr(td, "gather_single"):  # torch 2.14 and later: its new functions on the module's group
        out = torch.zeros(n, 2) if r == 0 else None
        td.gather_single(torch.full((2,), float(r)), out, dst=0, group=ours)
        if out is not None:
            expected = torch.arange(n, dtype=torch.float32).repeat_interleave(2).view(n, 2)
            assert_tensor(out, expected, "torch gather_single over the module's group")
        td.set_timeout(timedelta(seconds=77), group=ours)
        if is_tdist():
            got = dist.get_backend_impl(ours).timeout
            assert_equal(got, timedelta(seconds=77), "torch's set_timeout reaches the module's backend")
    first = dist.new_group([0])
    if r != 0:  # a non-member's handle is torch's non-member too: torch warns and does nothing
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            td.all_reduce(torch.ones(1), group=first)
    td.destroy_process_group(ours)
    dist.destroy_process_group(theirs)
    check_world_works("destroying groups from both sides")


# ---------------------------------------------------------------------------- data and models
@body(suite="torch")
def distributed_sampler() -> None:
    """``DistributedSampler(ds)`` with no arguments takes the rank and world size from the
    default group; the ranks' indices cover the dataset."""
    from torch.utils.data.distributed import DistributedSampler

    r, n = dist.get_rank(), dist.get_world_size()
    dataset: Any = list(range(11))  # any sized sequence is a map-style dataset
    mine: list[int] = list(DistributedSampler(dataset, seed=3))
    explicit: list[int] = list(DistributedSampler(dataset, num_replicas=n, rank=r, seed=3))
    assert_equal(mine, explicit, "DistributedSampler(ds) indices vs num_replicas/rank given")
    everyone: list = [None] * n
    dist.all_gather_object(everyone, mine)
    assert_equal(sorted(set(i for part in everyone for i in part)), dataset, "indices of all ranks together")


@body(suite="torch", min_world_size=2, max_world_size=2, timeout=_SLOW)
def ddp_matches_gloo() -> None:
    """torch's DistributedDataParallel over the module's default group ends 5 SGD steps
    with parameters bitwise equal to torch's DDP over torch's own gloo (two ranks)."""
    ours, reference = _ours_and_gloo(_train_ddp)
    _assert_params(ours, reference, "DDP over the module's group vs DDP over torch's gloo")
    _assert_params(ours, _reference(), "DDP vs one process on the full batch", atol=1e-5)


def _branchy() -> Any:
    """A model with a layer its forward never uses."""
    nn = _torch().nn

    class Branchy(nn.Module):  # type: ignore[name-defined]  # nn is torch.nn, imported lazily
        def __init__(self) -> None:
            super().__init__()
            self.net, self.unused = _mlp(), nn.Linear(OUTPUTS, OUTPUTS)

        def forward(self, x: Any) -> Any:
            return self.net(x)

    return Branchy()


def _train_ddp_features(process_group: Any) -> dict[str, Any]:
    """torch DDP with find_unused_parameters, torch's fp16 compression hook and a no_sync step."""
    torch = _torch()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = _branchy()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group, find_unused_parameters=True)
    ddp.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
    for step in range(3):
        x, y = _batch(step)
        xs, ys = _shard(x).chunk(2), _shard(y).chunk(2)
        with ddp.no_sync():  # the first micro-batch only accumulates
            torch.nn.functional.mse_loss(ddp(xs[0]), ys[0]).backward()
        torch.nn.functional.mse_loss(ddp(xs[1]), ys[1]).backward()
        _sgd_step(model.parameters())
    return {k: v.detach().clone() for k, v in model.named_parameters()}


@body(suite="torch", min_world_size=2, max_world_size=2, timeout=_SLOW)
def ddp_features_match_gloo() -> None:
    """torch DDP's communication hook (fp16 compression), ``no_sync`` and
    ``find_unused_parameters`` over the module's group: parameters bitwise equal to the
    same training over torch's gloo."""
    ours, reference = _ours_and_gloo(_train_ddp_features)
    _assert_params(ours, reference, "DDP (fp16 hook, no_sync, unused parameters) vs the same over torch's gloo")


@body(suite="torch", min_world_size=2, max_world_size=2, timeout=_SLOW)
def fsdp2_matches_one_process() -> None:
    """FSDP2's ``fully_shard`` on CPU over a device mesh of the default group: parameters
    after 5 SGD steps match one process on the full batch within 1e-5, and each rank
    holds only its shard."""
    torch = _torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    n = dist.get_world_size()
    mesh = init_device_mesh("cpu", (n,))
    model = _mlp()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = model[0].weight.to_local()
    assert_equal(tuple(local.shape), (HIDDEN // n, FEATURES), "a rank's shard of the first weight")
    for step in range(STEPS):
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        _sgd_step(model.parameters())
    full = {k: v.full_tensor().detach() for k, v in model.named_parameters()}
    _assert_params(full, _reference(), "FSDP2 vs one process", atol=1e-5)


@body(suite="torch", min_world_size=2, max_world_size=2, timeout=_SLOW)
def zero_redundancy_optimizer() -> None:
    """``ZeroRedundancyOptimizer`` over the module's group: each rank keeps the optimizer
    state of its share of the parameters; training matches one process within 1e-5."""
    torch = _torch()
    from torch.distributed.optim import ZeroRedundancyOptimizer

    group = dist.group.WORLD
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, process_group=group)
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(_shard(x)), _shard(y)).backward()
        opt.step()
    total = len(list(model.parameters()))
    owned = len(opt.optim.param_groups[0]["params"])
    assert_true(0 < owned < total, f"rank owns {owned} of {total} parameters' optimizer state")
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    _assert_params(params, _reference(), "ZeroRedundancyOptimizer vs one process", atol=1e-5)
    opt.consolidate_state_dict(to=0)
    if dist.get_rank() == 0:
        assert_equal(len(opt.state_dict()["param_groups"][0]["params"]), total, "consolidated state on rank 0")


@body(suite="torch", min_world_size=2)
def functional_all_reduce_autograd() -> None:
    """``torch.distributed.nn.functional.all_reduce`` is differentiable over the module's
    group: the gradient of a sum is the all-reduced gradient."""
    torch = _torch()
    from torch.distributed.nn.functional import all_reduce

    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = all_reduce(x * (r + 1))
    y.sum().backward()
    assert_tensor(y.detach(), torch.full((3,), float(sum((k + 1) ** 2 for k in range(n)))), "all_reduce forward")
    assert_tensor(x.grad, torch.full((3,), float(n * (r + 1))), "gradient through all_reduce")


@body(suite="torch", min_world_size=2, max_world_size=2, timeout=_SLOW)
def join_uneven_inputs() -> None:
    """``Join`` with DDP over the module's group: ranks with fewer batches shadow the
    others' all-reduces, nothing hangs, and every replica ends with the same parameters."""
    torch = _torch()
    from torch.distributed.algorithms.join import Join

    r = dist.get_rank()
    model = _mlp()
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=dist.group.WORLD)
    with Join([ddp]):
        for step in range(3 + 2 * r):  # rank 0: 3 batches, rank 1: 5
            x, y = _batch(step)
            torch.nn.functional.mse_loss(ddp(_shard(x)), _shard(y)).backward()
            _sgd_step(model.parameters())
    _same_everywhere({k: v.detach().clone() for k, v in model.named_parameters()}, "parameters after Join")
    check_world_works("Join")


@body(suite="torch")
def sync_batch_norm_on_cpu() -> None:
    """``SyncBatchNorm`` behaves as torch 2.13 does on CPU once torch.distributed is
    initialized: training raises torch's ValueError (it synchronises GPU tensors only),
    eval normalises with the running statistics, ``convert_sync_batchnorm`` keeps the group."""
    torch = _torch()
    nn = torch.nn
    bn = nn.SyncBatchNorm(3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(7))
    with raises(ValueError, match="SyncBatchNorm expected input tensor to be on GPU"):
        bn(x)
    bn.eval()
    expected = nn.functional.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, bn.eps)
    assert_tensor(bn(x).detach(), expected.detach(), "SyncBatchNorm in eval mode")
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(
        nn.Sequential(nn.BatchNorm1d(3)), process_group=dist.group.WORLD
    )
    assert_true(isinstance(converted[0], nn.SyncBatchNorm), "convert_sync_batchnorm made no SyncBatchNorm")
    assert_true(converted[0].process_group is dist.group.WORLD, "convert_sync_batchnorm lost the group")


# ---------------------------------------------------------------------------- checkpoints
def _shared_dir() -> str:
    """A fresh directory made by rank 0, its path broadcast to every rank."""
    path = [tempfile.mkdtemp(prefix="tdist-dcp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    return str(path[0])


@body(suite="torch", min_world_size=4, max_world_size=4, timeout=_SLOW)
def checkpoint_resharding() -> None:
    """Distributed checkpointing: saved by a group of 2 ranks (one file per rank, the
    metadata written once, DTensor shards where their ranks are), loaded by 4 ranks and by
    a group of 1 with the values intact."""
    torch = _torch()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    r = dist.get_rank()
    path = _shared_dir()
    pair, single = dist.new_group([0, 1]), dist.new_group([0])
    full = torch.arange(32.0).view(8, 4)
    try:
        if r < 2:
            mesh = DeviceMesh.from_group(pair, "cpu")
            state = {
                f"rank{r}": torch.arange(5.0) + 100 * (r + 1),
                "shared": torch.arange(6.0),
                "sharded": distribute_tensor(full, mesh, [Shard(0)]),
            }
            dcp.save(state, checkpoint_id=path, process_group=pair)
        dist.barrier()
        if r == 0:
            assert_equal(sorted(os.listdir(path)), [".metadata", "__0_0.distcp", "__1_0.distcp"], "checkpoint files")
        mesh4 = init_device_mesh("cpu", (4,))
        state = {
            "rank0": torch.zeros(5),
            "rank1": torch.zeros(5),
            "shared": torch.zeros(6),
            "sharded": distribute_tensor(torch.zeros(8, 4), mesh4, [Shard(0)]),
        }
        dcp.load(state, checkpoint_id=path)
        assert_tensor(state["sharded"].to_local(), full.chunk(4)[r], "a 4-way shard loaded from a 2-way save")
        for k, expected in (
            ("rank0", torch.arange(5.0) + 100),
            ("rank1", torch.arange(5.0) + 200),
            ("shared", torch.arange(6.0)),
        ):
            assert_tensor(state[k], expected, f"{k} loaded by 4 ranks")
        if r == 0:
            state = {"sharded": torch.zeros(8, 4), "rank1": torch.zeros(5)}
            dcp.load(state, checkpoint_id=path, process_group=single)
            assert_tensor(state["sharded"], full, "the whole DTensor loaded by a group of one")
            assert_tensor(state["rank1"], torch.arange(5.0) + 200, "rank 1's tensor loaded by a group of one")
        dist.barrier()
    finally:
        if r == 0:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- bad input
@body(suite="torch", tdist_only="checks tdist's errors for what torch passes it")
def unsupported_bridged_ops() -> None:
    """What tdist's backend cannot do, called through torch, is a clear error before any
    communication, and the group works afterwards: a device the backend does not serve,
    a reduction the dtype cannot do."""
    torch, td = _torch(), _td()
    with raises(RuntimeError, match="no support for meta tensors"):
        td.all_reduce(torch.ones(2, device="meta"))
    with raises(TypeError, match="BAND"):
        td.all_reduce(torch.ones(2), op=td.ReduceOp.BAND)
    check_world_works("unsupported operations through torch")
