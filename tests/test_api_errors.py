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


_T = torch.ones(2)
#: Calls made before init_process_group, run on torch.distributed and on tdist.
_BEFORE_INIT = {
    "get_rank": lambda m: m.get_rank(),
    "get_world_size": lambda m: m.get_world_size(),
    "get_backend": lambda m: m.get_backend(),
    "barrier": lambda m: m.barrier(),
    "all_reduce": lambda m: m.all_reduce(_T),
    "broadcast": lambda m: m.broadcast(_T, 0),
    "all_gather_into_tensor": lambda m: m.all_gather_into_tensor(torch.ones(4), _T),
    "send": lambda m: m.send(_T, 1),
    "irecv": lambda m: m.irecv(_T, 1),
    "batch_isend_irecv": lambda m: m.batch_isend_irecv([m.P2POp(m.isend, _T, 1)]),
    "monitored_barrier": lambda m: m.monitored_barrier(),
    "gather_object": lambda m: m.gather_object(1, [None], 0),
    "new_group": lambda m: m.new_group([0]),
    "destroy_process_group": lambda m: m.destroy_process_group(),
}


def _raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


@pytest.mark.parametrize("name", sorted(_BEFORE_INIT))
def test_calls_before_init_raise_what_torch_raises(name):
    """torch.distributed raises ValueError (AssertionError for destroy_process_group); tdist
    raises a DistError that is also that type."""
    import torch.distributed as td

    theirs, ours = _raised(lambda: _BEFORE_INIT[name](td)), _raised(lambda: _BEFORE_INIT[name](dist))
    assert isinstance(ours, dist.DistError) and "not initialized" in str(ours), repr(ours)
    assert type(theirs) in (ValueError, AssertionError), repr(theirs)
    assert isinstance(ours, type(theirs)), f"torch raises {theirs!r}, tdist {ours!r}"


@pytest.mark.parametrize("module", ["torch.distributed", "tdist"])
def test_calls_after_destroy_raise_value_error(module, monkeypatch):
    """After destroy_process_group, and on a destroyed group: ValueError in both (a
    DistStateError in tdist); a second init_process_group too."""
    import importlib

    m = importlib.import_module(module)
    backend = "gloo" if module == "torch.distributed" else "tcp"
    m.init_process_group(backend, store=m.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="twice|already initialized"):
            m.init_process_group(backend, store=m.HashStore(), rank=0, world_size=1)
        sub = m.new_group([0])
        m.destroy_process_group(sub)
        with pytest.raises(ValueError):
            m.get_rank(sub)
        with pytest.raises(ValueError):
            m.destroy_process_group(sub)
    finally:
        m.destroy_process_group()
    for call in (lambda: m.all_reduce(_T), m.get_rank, lambda: m.new_group([0])):
        error = _raised(call)
        assert isinstance(error, ValueError), repr(error)
        assert module == "torch.distributed" or isinstance(error, dist.DistStateError), repr(error)
    with pytest.raises(AssertionError):
        m.destroy_process_group()


def test_unknown_backend_names_installed_and_package():
    with pytest.raises(
        dist.DistError, match=r"'nosuch' is not installed \(installed: .*tcp.*\); pip install tdist-nosuch"
    ):
        dist.init_process_group("nosuch", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(dist.DistError, match=r"'tdist-nosuch' is not installed .*; pip install tdist-nosuch$"):
        dist.init_process_group("tdist-nosuch", store=dist.HashStore(), rank=0, world_size=1)


def test_a_backend_is_found_by_its_torch_name_too():
    """``"tdist-tcp"``, as torch.distributed and pip know it, is the tcp backend."""
    dist.init_process_group("tdist-tcp", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0] and dist.get_backend() == "tdist-tcp"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rank=2, world_size=2), "out of range"),
        (dict(rank=0, world_size=-2), "world_size must be a positive"),
        (dict(rank=0, world_size=0, store=dist.HashStore()), "world_size must be a positive"),
        (dict(init_method="tcp://127.0.0.1", rank=0, world_size=1), "port number missing"),
        (dict(init_method="tcp://:29500", rank=0, world_size=1), "host missing"),
        (
            dict(init_method="nosuch://x", rank=0, world_size=1),
            r"no rendezvous handler for nosuch:// \(installed: env://",
        ),
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


def _planted(tmp_path, kind: str) -> str:
    """A path a file:// rendezvous must refuse at once."""
    import os

    if kind == "/dev/null":
        return "/dev/null"
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return str(tmp_path / "fifo")
    if kind == "directory":
        return str(tmp_path)
    shared = tmp_path / "shared"  # world-writable and sticky, like /tmp
    shared.mkdir()
    os.chmod(shared, 0o1777)
    (tmp_path / "target").write_text("")
    os.symlink(tmp_path / "target", shared / "link")
    return str(shared / "link")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "kind, message",
    [
        ("/dev/null", "is a character device"),
        ("fifo", "is a FIFO"),
        ("directory", "is a directory"),
        ("symlink in a world-writable directory", "symbolic link"),
    ],
)
@pytest.mark.parametrize("group_name", ["", "job"])
def test_file_rendezvous_refuses_what_is_not_its_file_at_once(tmp_path, kind, message, group_name):
    import os
    import stat
    import time

    path = _planted(tmp_path, kind)
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        dist.init_process_group(
            "tcp",
            init_method=f"file://{path}",
            rank=0,
            world_size=1,
            group_name=group_name,
            timeout=timedelta(seconds=20),
        )
    assert time.monotonic() - started < 5
    assert not dist.is_initialized()
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and not os.path.exists(f"{path}.tdist-lock")


@pytest.mark.parametrize("group_name", ["", "job"])
def test_file_rendezvous_leaves_a_file_that_is_not_a_store_alone(tmp_path, group_name):
    data = tmp_path / "data"
    data.write_text("not a store")
    with pytest.raises(dist.DistStoreError, match="not a tdist FileStore"):
        dist.init_process_group(
            "tcp",
            init_method=f"file://{data}",
            rank=0,
            world_size=1,
            group_name=group_name,
            timeout=timedelta(seconds=20),
        )
    assert data.read_text() == "not a store" and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_file_rendezvous_follows_a_symlink_in_a_private_directory(tmp_path):
    import os

    os.symlink(tmp_path / "store", tmp_path / "link")
    dist.init_process_group(
        "tcp", init_method=f"file://{tmp_path / 'link'}", rank=0, world_size=1, timeout=timedelta(seconds=20)
    )
    assert (tmp_path / "store").exists()
    dist.destroy_process_group()


def test_env_method_names_missing_variable(monkeypatch):
    for name in (
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ):
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
        "SUM",
        "PRODUCT",
        "MAX",
        "MIN",
        "BAND",
        "BOR",
        "BXOR",
        "AVG",
        "PREMUL_SUM",
    }
    with pytest.warns(FutureWarning):
        assert dist.reduce_op.SUM is dist.ReduceOp.SUM
    assert dist.make_premul_sum(2.0).factor == 2.0
    assert dist._make_nccl_premul_sum(0.5).op is dist.ReduceOp.PREMUL_SUM
