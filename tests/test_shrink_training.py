"""A training loop that survives a lost rank (tests/survivor_training.py): 4 real
processes, one lost mid-step, the others shrink the default group, rebuild DDP and
train on; a replacement joins later (started by a survivor, or by tdistrun) and
receives the model and optimizer state; every rank's parameters agree with each other
and with a one-process reference that used the same world sizes at the same steps."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

from repo_paths import TESTS  # noqa: E402
from tdist.testing.processes import base_env, python_job, run_job  # noqa: E402

import survivor_training as S  # noqa: E402

WORLD = 4
TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]
JOB_TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOB_TIMEOUT + 60)]


@pytest.mark.parametrize("ddp,loss", [("torch", "kill"), ("tdist", "stop")])
def test_survivors_shrink_rebuild_ddp_and_train_on(tmp_path, ddp, loss):
    """torch's DDP through the bridge with a SIGKILLed rank; tdist's DDP with a rank
    SIGSTOPped past the group's timeout."""
    args = [os.path.join(TESTS, "survivor_training.py"), "--ddp", ddp, "--loss", loss, "--out", str(tmp_path)]
    job = python_job([*args, "--replacer", "self"], WORLD, timeout=JOB_TIMEOUT)
    for rank, res in enumerate(job[: WORLD - 1]):
        assert res.returncode == 0, f"survivor {rank} exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert job[WORLD - 1].returncode < 0, f"the lost rank exited with {job[WORLD - 1].returncode}, not by a signal"
    check_results(tmp_path)


def test_under_tdistrun_a_lost_worker_is_replaced(tmp_path):
    """tdistrun --tolerate-failures 1 --replace-failed: the SIGKILLed worker is not a job
    failure; the launcher starts a replacement, which joins when the survivors grow."""
    script = os.path.join(TESTS, "survivor_training.py")
    args = ["--tolerate-failures", "1", "--replace-failed", "--nproc-per-node", str(WORLD), script]
    args += ["--ddp", "torch", "--loss", "kill", "--out", str(tmp_path), "--replacer", "launcher"]
    res = run_job([[*TDISTRUN, *args]], [base_env()], JOB_TIMEOUT)[0]
    assert res.returncode == 0, f"tdistrun exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
    assert "the job goes on (failure 1 of 1 tolerated); started a replacement" in res.stderr, res.stderr
    check_results(tmp_path)


def check_results(tmp_path) -> None:
    """Every rank, the replacement too, ends with the same parameters as the reference."""
    names = [f"rank{r}.pt" for r in range(WORLD - 1)] + ["joiner.pt"]
    results = [torch.load(tmp_path / name, weights_only=False) for name in names]
    sizes = [WORLD] * S.LOSS_STEP + [WORLD - 1] * (S.GROW_STEP - S.LOSS_STEP) + [WORLD] * (S.STEPS - S.GROW_STEP)
    for r, res in enumerate(results):
        assert res["rank"] == r and res["sizes"] == sizes, f"rank {r}: {res['rank']=}, {res['sizes']=}"
        assert r == WORLD - 1 or res["recovery_s"] is not None
        for mine, first in zip(res["params"], results[0]["params"]):
            assert torch.equal(mine, first), f"rank {r}'s parameters differ from rank 0's"
        for mine, ref in zip(res["params"], res["reference"]):
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
