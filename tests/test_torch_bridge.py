"""tdist and torch.distributed share one group (tdist._torch).

Single process: tdist's default group and new groups are torch's, destroying either side
destroys both, the opt-outs, a program that initialized torch itself (same world: left
alone with one warning; another world: an error before any communication), an operation
the backend does not declare. Real processes: torch's autoloading registers tdist's
backends without importing tdist; a plain torch DDP program runs on ``tdist-tcp`` under
torchrun and on ``tdist-gloo`` with launcher variables; ranks that name different backends
fail at once, through both APIs. torch's utilities over the groups of every backend are
the kit's "torch" suite (tests/test_torch_utilities.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as td  # noqa: E402

import tdist  # noqa: E402
from repo_paths import ROOT, TESTS  # noqa: E402
from tdist.testing import free_port  # noqa: E402
from tdist.testing.processes import base_env, python_job, run_job  # noqa: E402

JOB_TIMEOUT = 180
SHORT = timedelta(seconds=10)


@pytest.fixture
def no_torch_group():
    """Tear down whatever a test left initialized, on both sides."""
    yield
    if tdist.is_initialized():
        tdist.destroy_process_group()
    if td.is_initialized():
        td.destroy_process_group()


def _init_tdist(**kwargs) -> None:
    tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, timeout=SHORT, **kwargs)


# ---------------------------------------------------------------------------- one group, both APIs
def test_default_group_is_torchs_and_destroy_tears_down_both(no_torch_group):
    _init_tdist()
    assert td.is_initialized() and td.group.WORLD is tdist.group.WORLD
    assert td.get_backend() == "tdist-tcp" and tdist.get_backend() == "tcp"
    ours = tdist.new_group([0])
    theirs = td.new_group([0])
    assert isinstance(ours, td.ProcessGroup) and td.get_process_group_ranks(ours) == [0]
    assert tdist.get_world_size(theirs) == 1 and tdist.get_process_group_ranks(theirs) == [0]
    assert ours.ranks == [0] and set(ours.backends) == {"cpu"}  # tdist's view of the group reads through
    t = torch.ones(2)
    td.all_reduce(t, group=ours)
    tdist.all_reduce(t, group=theirs)
    assert t.tolist() == [1.0, 1.0]
    tdist.destroy_process_group(ours)
    with pytest.raises(KeyError):
        td.get_process_group_ranks(ours)  # gone from torch too
    td.destroy_process_group(theirs)
    with pytest.raises(tdist.DistError, match="destroyed"):
        tdist.get_rank(theirs)  # gone from tdist too
    tdist.destroy_process_group()
    assert not td.is_initialized()


def test_torch_destroy_tears_down_tdist(no_torch_group):
    _init_tdist()
    tdist.new_group([0])
    td.destroy_process_group()
    assert not tdist.is_initialized() and not td.is_initialized()
    _init_tdist()  # and both can start again
    assert td.is_initialized()


@pytest.mark.parametrize("how", ["keyword", "environment"])
def test_opt_out_leaves_torch_alone(no_torch_group, monkeypatch, how):
    if how == "keyword":
        _init_tdist(torch_bridge=False)
    else:
        monkeypatch.setenv("TDIST_TORCH_BRIDGE", "0")
        _init_tdist()
    assert tdist.is_initialized() and not td.is_initialized()
    assert isinstance(tdist.group.WORLD, tdist.ProcessGroup)


def test_program_that_initialized_torch_is_left_alone(no_torch_group, monkeypatch):
    import tdist._torch as bridge

    monkeypatch.setattr(bridge, "_warned_left_alone", False)
    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    with pytest.warns(UserWarning, match="initialized by the program .*'gloo'.* leaves it alone"):
        _init_tdist()
    assert td.get_backend() == "gloo" and tdist.group.WORLD is not td.group.WORLD
    tdist.destroy_process_group()
    assert td.is_initialized()  # still the program's
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _init_tdist()
    assert not [w for w in seen if "leaves it alone" in str(w.message)], "warned twice"


def test_torch_initialized_with_another_world_is_an_error_before_any_communication(no_torch_group):
    td.init_process_group("gloo", store=td.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match="already initialized as rank 0 of 1 .*'gloo'.* rank 0 of 2"):
        # world_size 2 over a HashStore would wait the timeout for rank 1: the error comes first
        tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=2, timeout=timedelta(hours=1))
    assert not tdist.is_initialized()


def test_operation_the_backend_does_not_declare(no_torch_group):
    _init_tdist()
    world = tdist.group.WORLD.tdist_group
    spec = world.specs["cpu"]
    world.specs["cpu"] = dataclasses.replace(spec, operations={"cpu": spec.operations["cpu"] - {"broadcast"}})
    try:
        with pytest.raises(tdist.DistError, match="broadcast: not supported by backend 'tcp' on cpu tensors"):
            td.broadcast(torch.ones(1), src=0)
    finally:
        world.specs["cpu"] = spec
    td.broadcast(torch.ones(1), src=0)


def test_backend_that_cannot_serve_torch_says_why(no_torch_group):
    from tdist._torch.registry import create_torch_group

    spec = tdist.get_backend_spec("tcp")
    from tdist._plugins import plugins

    registry = plugins().backends
    registry._specs["tcp"] = dataclasses.replace(spec, torch_bridge="it only speaks to itself")
    try:
        with pytest.warns(UserWarning, match="left uninitialized: tcp: it only speaks to itself"):
            _init_tdist()
        assert not td.is_initialized()
        with pytest.raises(tdist.DistError, match="tdist-tcp: tdist's backend 'tcp' cannot serve torch.distributed"):
            create_torch_group("tcp", None, None)
    finally:
        registry._specs["tcp"] = spec


def test_tdist_store_under_torchs_prefix_store():
    """torch's C++ side (a PrefixStore of a group torch makes) reaches every method of a
    tdist store it was given (as_torch_store), by the C++ names pybind looks up."""
    store = td.PrefixStore("group/", tdist.as_torch_store(tdist.HashStore()))
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and store.add("n", 2) == 2
    assert store.compare_set("a", b"1", b"2") == b"2"
    store.wait(["a", "n"], timedelta(seconds=5))
    assert store.num_keys() == 2 and store.delete_key("a") and store.num_keys() == 1


# ---------------------------------------------------------------------------- torch's side, real processes
def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], env=base_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_autoload_registers_backends_without_importing_tdist():
    code = (
        "import sys, torch.distributed as td; "
        "print(sorted(k for k in td.Backend._plugins if k.startswith('TDIST-')), 'tdist' in sys.modules)"
    )
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("]")[0].count("TDIST-") >= 3 and "'TDIST-TCP'" in proc.stdout, proc.stdout
    assert proc.stdout.strip().endswith("False"), "importing torch imported tdist"
    for off in ({"TDIST_TORCH_BRIDGE": "0"}, {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}):
        proc = _python(code, **off)
        assert proc.returncode == 0 and proc.stdout.startswith("[]"), (off, proc.stdout, proc.stderr)
    late = "import torch.distributed as td, tdist; print('TDIST-TCP' in td.Backend._plugins)"
    proc = _python(late, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert proc.stdout.strip() == "True", proc.stdout + proc.stderr  # `import tdist` registers them


def _results(out, world_size: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check_train(results: list[dict], backend: str) -> None:
    for res in results:
        assert res["registered"] and not res["tdist_imported_before_init"], res
        assert res["max_diff"] <= 1e-5, res
        assert res["gathered"] == [0, 1] and res["pair_sum"] == [2.0, 2.0]
        assert res["torch_backend"] == backend and res["tdist_backend"] == backend[len("tdist-") :]
        assert res["same_world"] and res["tdist_rank_of_pair"] == res["rank"]
        assert not res["tdist_initialized_after_destroy"]


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_plain_torch_program_under_torchrun_on_tdist_tcp(tmp_path):
    """torchrun + torch DDP + DistributedSampler, only the backend string says tdist."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [
        torchrun,
        "--standalone",
        "--nproc-per-node",
        "2",
        os.path.join(TESTS, "torch_programs.py"),
        "train",
        "--backend",
        "tdist-tcp",
        "--out",
        str(tmp_path),
    ]
    (res,) = run_job([cmd], [base_env()], timeout=JOB_TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_train(_results(tmp_path), "tdist-tcp")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_plain_torch_program_on_tdist_gloo(tmp_path):
    job = python_job(
        [os.path.join(TESTS, "torch_programs.py"), "train", "--backend", "tdist-gloo", "--out", str(tmp_path)],
        2,
        timeout=JOB_TIMEOUT,
    )
    for res in job:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_train(_results(tmp_path), "tdist-gloo")


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_ranks_that_disagree_on_the_backend_fail_at_once(tmp_path):
    """Rank 0 names tcp, rank 1 gloo: every rank raises the same clear error (tdist's API
    and torch's), instead of waiting out the timeout in backends that never meet."""
    job = python_job(
        [os.path.join(TESTS, "torch_programs.py"), "disagree", "--out", str(tmp_path), "--port", str(free_port())],
        2,
        timeout=JOB_TIMEOUT,
    )
    for res in job:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for res in _results(tmp_path):
        assert "disagree on the backend: 'tcp' on rank(s) [0]; 'gloo' on rank(s) [1]" in res["tdist"], res
        assert "disagree on the backend: 'tcp' on rank(s) [0]; 'gloo' on rank(s) [1]" in res["torch"], res


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_tdist_side_group_beside_torchs_gloo_default_group(tmp_path):
    """torch's default group on gloo, a side group on tdist-tcp: the side group's
    collectives and its monitored_barrier work without a tdist default group."""
    job = python_job([os.path.join(TESTS, "torch_programs.py"), "side", "--out", str(tmp_path)], 2, timeout=JOB_TIMEOUT)
    for res in job:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for res in _results(tmp_path):
        assert res["sum"] == [3.0, 3.0] and res["backend"] == "tdist-tcp", res


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kit_through_torchs_api():
    """Every conformance body -- written against torch.distributed's API -- and the torch
    suite (DDP, FSDP2, ZeRO, Join, ...) run as a plain torch program would: the module
    under test is torch.distributed, the backend ``tdist-tcp`` (torch's functions, through
    the bridge, to tdist's backend; tdist's default group made over torch's store), 2 ranks.
    Left out: what torch itself does not offer such a backend (the multi-GPU functions
    torch 2.13 removed; monitored_barrier, gloo only)."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        os.path.join(TESTS, "test_conformance.py"),
        os.path.join(TESTS, "test_torch_utilities.py"),
        "--tdist-dist-module",
        "torch.distributed",
        "--tdist-backend",
        "tdist-tcp",
        "--tdist-world-sizes",
        "2",
        "-k",
        "not multigpu and not monitored_barrier",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=540)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert int(re.search(r"(\d+) passed", summary).group(1)) >= 160, summary
