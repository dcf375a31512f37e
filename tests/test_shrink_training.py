"""A training loop that survives a lost rank (tests/survivor_training.py): 4 real
processes, one lost mid-step, the others shrink the default group, rebuild DDP and
train on; their parameters agree with each other and with a one-process reference
that used the same world sizes at the same steps."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from repo_paths import TESTS  # noqa: E402
from tdist.testing.processes import python_job  # noqa: E402

import survivor_training as S  # noqa: E402

WORLD = 4
JOB_TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOB_TIMEOUT + 60)]


@pytest.mark.parametrize("ddp,loss", [("torch", "kill"), ("tdist", "stop")])
def test_survivors_shrink_rebuild_ddp_and_train_on(tmp_path, ddp, loss):
    """torch's DDP through the bridge with a SIGKILLed rank; tdist's DDP with a rank
    SIGSTOPped past the group's timeout."""
    args = [os.path.join(TESTS, "survivor_training.py"), "--ddp", ddp, "--loss", loss, "--out", str(tmp_path)]
    job = python_job(args, WORLD, timeout=JOB_TIMEOUT)
    for rank, res in enumerate(job[: WORLD - 1]):
        assert res.returncode == 0, f"survivor {rank} exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert job[WORLD - 1].returncode < 0, f"the lost rank exited with {job[WORLD - 1].returncode}, not by a signal"
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD - 1)]
    expected_sizes = [WORLD] * S.LOSS_STEP + [WORLD - 1] * (S.STEPS - S.LOSS_STEP)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["sizes"] == expected_sizes, f"survivor {r}: {res['rank']=}, {res['sizes']=}"
        assert res["recovery_s"] is not None
        for mine, first in zip(res["params"], results[0]["params"]):
            assert torch.equal(mine, first), f"survivor {r}'s parameters differ from survivor 0's"
        for mine, ref in zip(res["params"], res["reference"]):
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
