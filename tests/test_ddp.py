"""tdist.nn.DistributedDataParallel: two replicas on half batches against one
process on the full batch, no_sync, unused parameters, buffers, buckets, comm hooks.

The scenarios run in real processes (tests/ddp_scenarios.py, 2 ranks) once per
installed CPU backend (tcp, gloo: env://; mpi: under mpirun); each test checks
one scenario's saved results.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import tdist  # noqa: E402
from tdist._local import find_mpirun, mpirun_env  # noqa: E402

import ddp_scenarios as S  # noqa: E402
from repo_paths import ROOT, TESTS  # noqa: E402
from tdist.testing.processes import base_env, kill_session, python_job, run_job  # noqa: E402

WORLD_SIZE = 2
TOLERANCE = 1e-5
JOB_TIMEOUT = 180
pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOB_TIMEOUT + 60)]


def _backends() -> list[str]:
    """tcp always (ours); the other installed CPU backends: gloo (env://), mpi (under mpirun)."""
    try:
        others = [b for b in tdist.available_backends() if b == "gloo" or (b == "mpi" and find_mpirun())]
    except Exception:
        others = []
    return ["tcp"] + sorted(others)


@pytest.fixture(scope="module", params=_backends())
def results(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(f"ddp-{backend}")
    args = [os.path.join(TESTS, "ddp_scenarios.py"), "--backend", backend, "--out", str(out)]
    if backend == "mpi":
        env = mpirun_env(base_env(), str(out))
        cmd = [find_mpirun(), "-n", str(WORLD_SIZE), "--oversubscribe", "--bind-to", "none", sys.executable, *args]
        job = run_job([cmd], [env], timeout=JOB_TIMEOUT)
    else:
        job = python_job(args, WORLD_SIZE, timeout=JOB_TIMEOUT)
    for rank, res in enumerate(job):
        assert res.returncode == 0, f"process {rank} exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _scenario(results, name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for rank, res in enumerate(per_rank):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"scenario {name!r} failed on rank {rank}:\n{res['error']}")
    return per_rank


def _assert_close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        if value is None:
            assert actual[name] is None, f"{what}: {name} should have no gradient"
            continue
        assert actual[name] is not None, f"{what}: {name} has no gradient"
        diff = (actual[name] - value).abs().max().item()
        assert diff <= TOLERANCE, f"{what}: {name} differs by {diff:g} (tolerance {TOLERANCE:g})"


def test_two_replicas_match_one_process_on_the_full_batch(results):
    expected = S.reference_training()
    for rank, res in enumerate(_scenario(results, "equivalence")):
        _assert_close(res["params"], expected, f"rank {rank}")
        assert res["stats"]["sync_steps"] == 5
        assert res["stats"]["allreduce_calls"] == 5 * res["buckets"]
        assert res["stats"]["allreduce_bytes"] == 5 * sum(p.numel() * 4 for p in expected.values())


def test_gradient_as_bucket_view(results):
    expected = S.reference_training()
    for rank, res in enumerate(_scenario(results, "view")):
        _assert_close(res["params"], expected, f"rank {rank}")
        assert res["grad_views"], "param.grad should be views of the bucket buffers"


def test_many_parameters_spanning_several_buckets(results):
    expected = S.reference_training(S.deep_mlp)
    for rank, res in enumerate(_scenario(results, "buckets")):
        assert res["buckets"] >= 3
        assert res["stats"]["allreduce_calls"] == 5 * res["buckets"]
        _assert_close(res["params"], expected, f"rank {rank}")


def test_no_sync_accumulates_locally_then_syncs(results):
    expected = S.reference_training()
    for rank, res in enumerate(_scenario(results, "no_sync")):
        assert res["calls_in_no_sync"] == [0] * 5, "no all-reduce may run under no_sync"
        assert res["stats"]["sync_steps"] == 5
        _assert_close(res["params"], expected, f"rank {rank}")


def test_unused_parameter_without_find_unused_parameters_raises(results):
    for res in _scenario(results, "unused_error"):
        for message in res["messages"]:
            assert message is not None, "backward should have raised"
            assert "find_unused_parameters=True" in message
            assert "head_b.weight" in message and "never.bias" in message
        # the group is still usable: nothing was left half-issued
        assert res["after"].tolist() == [3.0, 3.0, 3.0]


def test_find_unused_parameters(results):
    expected_params, expected_grads = S.reference_branches(WORLD_SIZE)
    per_rank = _scenario(results, "find_unused")
    for rank, res in enumerate(per_rank):
        _assert_close(res["grads"], expected_grads, f"rank {rank} gradients")
        _assert_close(res["params"], expected_params, f"rank {rank}")
        assert res["grads"]["never.weight"] is None  # unused on every rank: left alone
    assert per_rank[0]["unused_last"] == ["head_b.weight", "head_b.bias", "never.weight", "never.bias"]
    assert per_rank[1]["unused_last"] == ["head_a.weight", "head_a.bias", "never.weight", "never.bias"]


def test_parameters_and_buffers_broadcast(results):
    per_rank = _scenario(results, "buffers")
    rank0_init = per_rank[0][True]["init"]
    for rank, res in enumerate(per_rank):
        for broadcast_buffers in (True, False):
            # construction: rank 0's parameters and buffers everywhere (rank r was seeded with r)
            _assert_close(res[broadcast_buffers]["init"]["params"], rank0_init["params"], f"rank {rank}")
            assert res[broadcast_buffers]["init"]["count"].tolist() == [0.0] * 3
        bump = 1.0 + 10 * rank
        # broadcast_buffers: before each of the 3 forwards, rank 0's buffer (bumped by 1 each time)
        assert res[True]["count"].tolist() == [2.0 + bump] * 3
        # without: each rank's own buffer
        assert res[False]["count"].tolist() == [3 * bump] * 3


def test_module_attribute_and_state_dict(results):
    for res in _scenario(results, "wrapper"):
        assert res["module_is_model"]
        assert res["keys"] == ["module." + k for k in res["module_keys"]]  # as torch's DDP
        assert res["same_values"] and res["zeroed"]
        assert res["armed_after_no_grad"] is False
        assert res["training"] == (True, True)


@pytest.mark.parametrize(
    "hook, tolerance",
    [("allreduce_hook", TOLERANCE), ("fp16_compress_hook", 5e-4), ("bf16_compress_hook", 5e-3)],
)
def test_builtin_comm_hooks(results, hook, tolerance):
    """The hooks replace the default all_reduce bucket by bucket; compression costs
    precision only (measured on tcp: 3e-5 for fp16, 2e-4 for bf16, after 5 steps)."""
    expected = S.reference_training(S.deep_mlp)
    for rank, res in enumerate(_scenario(results, "hooks")):
        got = res[hook]
        assert got["stats"]["comm_hook_calls"] == 5 * got["buckets"] and got["stats"]["allreduce_calls"] == 0
        worst = max((got["params"][name] - value).abs().max().item() for name, value in expected.items())
        assert worst <= tolerance, f"rank {rank}, {hook}: parameters differ by {worst:g} (tolerance {tolerance:g})"
        if hook != "allreduce_hook":
            assert worst > 1e-6, f"{hook} lost no precision: were the gradients compressed at all?"


def test_custom_comm_hook_with_state(results):
    expected = S.reference_training(S.deep_mlp)
    for rank, res in enumerate(_scenario(results, "custom_hook")):
        _assert_close(res["params"], expected, f"rank {rank}")
        n = res["buckets"]
        assert n >= 3 and len(res["seen"]) == 5 * n
        assert [s["index"] for s in res["seen"]] == list(range(n)) * 5  # bucket order, every step
        assert [s["is_last"] for s in res["seen"][:n]] == [False] * (n - 1) + [True]
        assert all(s["shapes_match"] and s["views"] for s in res["seen"])
        assert "already registered" in res["second"]


def test_failing_comm_hook_raises_at_end_of_backward(results):
    for res in _scenario(results, "failing_hook"):
        assert res["raised"] == "hook refused bucket"
        assert res["calls"] == 2 * res["buckets"]  # every bucket went to the hook, both steps
        assert res["after"].tolist() == [3.0, 3.0]


@pytest.mark.timeout(60)
def test_needs_an_initialized_process_group():
    from tdist.nn import DistributedDataParallel

    if tdist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))


@pytest.mark.timeout(120)
def test_train_example_under_tdistrun():
    """examples/train.py (the demo), small, launched by the launcher as `make demo` does."""
    cmd = [
        sys.executable,
        "-m",
        "tdist.launch",
        "--nproc_per_node",
        "2",
        "--grace_period",
        "2",
        os.path.join(ROOT, "examples", "train.py"),
        "--backend",
        "tcp",
        "--epochs",
        "2",
        "--samples",
        "1024",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base_env(), cwd=ROOT, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=100)
    finally:
        kill_session(proc.pid)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "[rank 1] epoch 2/2: 4 steps" in out
    assert "[rank 0]   replicas identical: yes" in out
    assert "all-reduced gradients:" in out


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("world1")
def test_comm_hook_contract_single_process():
    """register_comm_hook's refusals, and a hook whose future holds the wrong size."""
    from tdist.nn import DistributedDataParallel as DDP
    from tdist.nn import GradBucket, comm_hooks

    def step(ddp):
        ddp(torch.ones(1, 2)).sum().backward()

    ddp = DDP(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="hook must be callable"):
        ddp.register_comm_hook(None, "allreduce")
    ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
    with pytest.raises(RuntimeError, match="already registered"):
        ddp.register_comm_hook(None, comm_hooks.allreduce_hook)
    step(ddp)
    assert ddp.stats.comm_hook_calls == 1 and ddp.stats.sync_steps == 1

    late = DDP(torch.nn.Linear(2, 2))
    step(late)
    with pytest.raises(RuntimeError, match="before the first backward"):
        late.register_comm_hook(None, comm_hooks.allreduce_hook)

    from datetime import timedelta

    pending = DDP(torch.nn.Linear(2, 2), process_group=tdist.new_group([0], timeout=timedelta(seconds=0.5)))
    pending.register_comm_hook(None, lambda state, bucket: torch.futures.Future())  # never completes
    with pytest.raises(tdist.DistBackendTimeoutError, match=r"bucket 0 did not complete within .* \(0.5 s\)"):
        step(pending)

    bad = DDP(torch.nn.Linear(2, 2))
    bad.register_comm_hook(None, lambda state, bucket: _done(torch.zeros(3)))
    with pytest.raises(RuntimeError, match=r"holds \(3,\), expected a tensor of 6 elements"):
        step(bad)
    step(DDP(torch.nn.Linear(2, 2)))  # the group still works

    bucket = GradBucket(0, torch.zeros(6), [torch.zeros(2, 2), torch.zeros(2)], [0, 4], True)
    assert [tuple(g.shape) for g in bucket.gradients()] == [(2, 2), (2,)]
    bucket.set_buffer(torch.arange(6.0))
    assert bucket.gradients()[1].tolist() == [4.0, 5.0]
    with pytest.raises(ValueError, match="5 elements, the bucket holds 6"):
        bucket.set_buffer(torch.zeros(5))


def _done(value):
    future = torch.futures.Future()
    future.set_result(value)
    return future
