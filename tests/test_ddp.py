"""tdist.nn.DistributedDataParallel: two replicas on half batches against one
process on the full batch, no_sync, unused parameters, buffers, buckets.

The scenarios run in real processes (tests/ddp_scenarios.py, 2 ranks, env://)
once per backend; each test checks one scenario's saved results.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import tdist  # noqa: E402

import ddp_scenarios as S  # noqa: E402
from jobs import TESTS, python_job  # noqa: E402

WORLD_SIZE = 2
TOLERANCE = 1e-5
JOB_TIMEOUT = 180
pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOB_TIMEOUT + 60)]


def _backends() -> list[str]:
    """tcp always (ours); other installed CPU backends that env:// can start."""
    try:
        others = [b for b in tdist.available_backends() if b in ("gloo",)]
    except Exception:
        others = []
    return ["tcp"] + others


@pytest.fixture(scope="module", params=_backends())
def results(request, tmp_path_factory):
    backend = request.param
    out = tmp_path_factory.mktemp(f"ddp-{backend}")
    script = os.path.join(TESTS, "ddp_scenarios.py")
    job = python_job([script, "--backend", backend, "--out", str(out)], WORLD_SIZE, timeout=JOB_TIMEOUT)
    for rank, res in enumerate(job):
        assert res.returncode == 0, f"rank {rank} exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
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
    for rank, res in enumerate(_scenario(results, "unused_error")):
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


@pytest.mark.timeout(60)
def test_needs_an_initialized_process_group():
    from tdist.nn import DistributedDataParallel

    if tdist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedDataParallel(torch.nn.Linear(2, 2))
