"""torch.distributed's names and keyword arguments, as tdist spells them (single process).

The behaviour of the collectives behind these names is in the conformance suite
(conformance_coalesced, conformance_objects, conformance_groups); here: that every
public function both packages have takes torch's parameters, and the helpers that need
no peers.
"""

from __future__ import annotations

import inspect
from datetime import timedelta

import pytest
import tdist as dist
import torch
import torch.distributed as td

#: torch.distributed parameters tdist does not take, with the reason.
_NOT_TAKEN = {"init_process_group": {"_ranks"}}  # private to torch


def _torch_public_names() -> list[str]:
    return sorted(name for name in dir(td) if not name.startswith("_"))


def test_every_public_name_of_torch_distributed_is_in_tdist():
    """``import tdist as dist`` keeps a torch.distributed program's names working: each is
    tdist's own, torch's own object (``tdist._torch_names.FROM_TORCH``), or listed with a
    reason in ``NOT_PROVIDED``."""
    from tdist._torch_names import NOT_PROVIDED

    missing = [name for name in _torch_public_names() if name not in NOT_PROVIDED and not hasattr(dist, name)]
    assert not missing, f"torch.distributed names tdist lacks: {missing}"
    for name in ("breakpoint", "_coalescing_manager", "rpc", "DeviceMesh", "init_device_mesh", "AllreduceOptions"):
        assert getattr(dist, name) is not None and name in dir(dist), name
    assert dist.get_debug_level is td.get_debug_level and dist.rpc is td.rpc
    import torch.distributed.elastic  # noqa: F401 - a subpackage some program imported: in torch's namespace now

    assert dist.elastic is td.elastic
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        dist.no_such_name  # noqa: B018


def test_every_name_dir_lists_is_there():
    """``dir(tdist)`` lists only names this torch has: copying tdist's namespace
    (``{k: getattr(tdist, k) for k in dir(tdist)}``) works on CPU builds, where torch
    has no ProcessGroupNCCL."""
    unreachable = [name for name in dir(dist) if not hasattr(dist, name)]
    assert not unreachable, f"dir(tdist) lists names getattr cannot reach: {unreachable}"
    assert ("ProcessGroupNCCL" in dir(dist)) == hasattr(td, "ProcessGroupNCCL")


def _shared_functions() -> list[str]:
    names = []
    for name in sorted({*dist.__all__, *_torch_public_names(), "_coalescing_manager"}):
        ours, theirs = getattr(dist, name, None), getattr(td, name, None)
        if ours is None or theirs is None or ours is theirs:
            continue
        if inspect.isclass(ours) or not callable(ours) or not callable(theirs):
            continue
        try:
            inspect.signature(theirs)
        except (TypeError, ValueError):
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("name", _shared_functions())
def test_takes_torch_parameters(name):
    """tdist's function takes every parameter of torch's, in the same order, so calls
    written for torch.distributed (positional or keyword) work unchanged."""
    ours = list(inspect.signature(getattr(dist, name)).parameters)
    theirs = [p for p in inspect.signature(getattr(td, name)).parameters if p not in _NOT_TAKEN.get(name, ())]
    assert ours[: len(theirs)] == theirs, f"{name}: tdist {ours}, torch {theirs}"


def test_compatibility_names_exist():
    for name in (
        "all_gather_single",
        "reduce_scatter_single",
        "all_reduce_coalesced",
        "all_gather_coalesced",
        "new_subgroups",
        "new_subgroups_by_enumeration",
        "get_pg_count",
        "get_node_local_rank",
        "is_torchelastic_launched",
        "is_gloo_available",
        "is_mpi_available",
        "is_nccl_available",
        "get_default_backend_for_device",
        "supports_complex",
    ):
        assert name in dist.__all__ and callable(getattr(dist, name)), name
    assert dist.all_gather_single is dist.all_gather_into_tensor
    assert dist.reduce_scatter_single is dist.reduce_scatter_tensor


def test_backend_availability_names():
    for name in ("gloo", "mpi", "nccl"):
        assert getattr(dist, f"is_{name}_available")() == dist.is_backend_available(name)
    assert dist.is_backend_available(backend="tcp")
    assert not dist.is_nccl_available()  # no GPU (and a CPU torch) here


@pytest.mark.parametrize("op", list(dist.ReduceOp))
def test_supports_complex_matches_torch(op):
    theirs = getattr(td.ReduceOp, op.name if op.name != "PREMUL_SUM" else "SUM")
    expected = td.supports_complex(theirs) if op.name != "PREMUL_SUM" else True
    assert dist.supports_complex(op) is expected


def test_default_backend_for_device():
    assert dist.get_default_backend_for_device("cpu") == "tcp"
    assert dist.get_default_backend_for_device(torch.device("cpu")) == "tcp"
    cuda = dist.get_default_backend_for_device("cuda:1")  # nccl where it is usable, else one serving cuda
    assert cuda == "nccl" if dist.is_nccl_available() else "cuda" in dist.get_backend_spec(cuda).devices
    with pytest.raises(ValueError, match="no available backend serves xpu tensors"):
        dist.get_default_backend_for_device("xpu")


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 3),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),
        ({"MPI_LOCALRANKID": "2"}, 2),
        ({"SLURM_LOCALID": "5", "SLURM_STEP_ID": "0"}, 5),
    ],
)
def test_node_local_rank_from_launchers(env, expected, monkeypatch):
    for name in (*dist._environment.LOCAL_RANK_VARIABLES, "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert dist.get_node_local_rank() == expected


def test_node_local_rank_fallback_and_errors(monkeypatch):
    for name in (*dist._environment.LOCAL_RANK_VARIABLES, "SLURM_STEP_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "4")  # a batch script, not an srun step: ignored
    assert dist.get_node_local_rank(fallback_rank=7) == 7
    with pytest.raises(RuntimeError, match="none of LOCAL_RANK, .* is set"):
        dist.get_node_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        dist.get_node_local_rank()


def test_torchelastic_launched(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    assert dist.is_torchelastic_launched()


def test_pg_count():
    assert dist.get_pg_count() == 0
    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        assert dist.get_pg_count() == 1
        dist.new_group([0])
        assert dist.get_pg_count() == 2
    finally:
        dist.destroy_process_group()
    assert dist.get_pg_count() == 0


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: dist.all_reduce_coalesced([]), ValueError, "tensors is empty"),
        (
            lambda: dist.all_reduce_coalesced([torch.ones(1), torch.ones(1, dtype=torch.int64)]),
            ValueError,
            r"tensors\[1\] has dtype torch.int64, expected torch.float32",
        ),
        (lambda: dist.all_reduce_coalesced("x"), TypeError, "must be a list of tensors"),
        (
            lambda: dist.all_reduce_coalesced([torch.ones(1, dtype=torch.complex64)], op=dist.ReduceOp.MAX),
            TypeError,
            "not supported for complex",
        ),
        (
            lambda: dist.all_gather_coalesced([[torch.ones(2)], [torch.ones(2)]], [torch.ones(2)]),
            ValueError,
            "list of 1 lists",
        ),
        (
            lambda: dist.all_gather_coalesced([[torch.ones(3)]], [torch.ones(2)]),
            ValueError,
            r"holds \[3\] elements per tensor, input_tensor_list \[2\]",
        ),
        (
            lambda: dist.all_gather_coalesced([[torch.ones(2, dtype=torch.int64)]], [torch.ones(2)]),
            ValueError,
            "dtype torch.int64, expected torch.float32",
        ),
        (lambda: dist.new_subgroups(group_size=2), ValueError, "group_size 2 must divide the group's size 1"),
        (lambda: dist.new_subgroups(group_size=0), ValueError, "must be a positive integer"),
        (lambda: dist.new_subgroups(), ValueError, "group_size is required where CUDA is not available"),
        (lambda: dist.new_subgroups_by_enumeration([]), ValueError, "is empty"),
        (
            lambda: dist.new_subgroups_by_enumeration([[0], [0]]),
            ValueError,
            r"rank 0 is in both subgroup \[0\] and \[0\]",
        ),
        (lambda: dist.barrier(timeout=3), TypeError, "timeout must be a datetime.timedelta"),
        (lambda: dist.gather_object(1, [None], dst=0, group_dst=0), ValueError, "either dst or group_dst"),
        (lambda: dist.send_object_list([1], group_dst=0), ValueError, "own rank"),
    ],
)
def test_bad_arguments_raise_before_communicating(call, error, message):
    count = dist.get_pg_count()
    with pytest.raises(error, match=message):
        call()
    assert dist.get_pg_count() == count  # no group was created on the way
    t = torch.ones(2)
    dist.all_reduce(t)  # the world still works
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.usefixtures("world1")
def test_coalesced_single_rank_values_and_future():
    a, b = torch.arange(4.0).view(2, 2), torch.ones(3)
    fut = dist.all_reduce_coalesced([a, b], async_op=True)
    assert isinstance(fut, torch._C.Future)  # the type torch's own Work.get_future() returns
    fut.wait()
    assert a.tolist() == [[0.0, 1.0], [2.0, 3.0]] and b.tolist() == [1.0, 1.0, 1.0]
    outs = [[torch.zeros(2, 2), torch.zeros(3)]]
    assert dist.all_gather_coalesced(outs, [a, b]) is None
    assert torch.equal(outs[0][0], a) and torch.equal(outs[0][1], b)


def test_tdist_subpackages_win_over_torchs():
    """``tdist.nn`` is tdist's own package (its DistributedDataParallel), also when nothing
    imported it yet, although torch.distributed has an ``nn`` too."""
    import subprocess
    import sys

    code = "import tdist; print(tdist.nn.__name__, hasattr(tdist.nn, 'DistributedDataParallel'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["tdist.nn", "True"], out.stdout + out.stderr
