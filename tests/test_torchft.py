"""tdist's backend as torchft's process group (``tdist.integrations.torchft``).

torchft (pinned in constraints.txt, installed by ``make venv``) builds reconfigurable
process groups from a store address, a rank and a world size. These tests run:

* the adapter's contract, as torchft's Manager drives it (two processes: configure on a
  fresh store prefix, collectives, send/recv, futures, a peer that dies, configure alone);
* torchft's own DDP example on CPU (``examples/torchft/train_ddp.py``: a lighthouse in
  this process, two replica groups of one process each) with one replica group SIGKILLed
  mid-training and restarted: the survivor keeps committing steps, the restarted one heals
  from it (torchft fetches its state) and both end with the same parameters. The same
  runs on torchft's own ``ProcessGroupGloo`` with the kill between steps (a kill in the
  middle of a step, while the survivor is in the all-reduce, crashes torchft 0.2's
  ``DistributedDataParallel`` on gloo: its comm hook fails an assertion when the Work
  raises; the adapter reports the failure through ``errored()`` instead).

Recovery times are measured by ``python -m tdist.bench --torchft`` (run once here, as a
smoke test), not asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tdist._local import free_port
from tdist.testing.processes import base_env, run_job

from repo_paths import ROOT

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install torchft)")

EXAMPLE = os.path.join(ROOT, "examples", "torchft", "train_ddp.py")
PROGRAMS = os.path.join(ROOT, "tests", "torchft_programs.py")
STEPS, KILL_AT = 12, 4


def _records(output: str, tag: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith(tag + " ")]


def test_importing_tdist_does_not_import_torchft():
    code = "import sys, tdist, tdist.integrations; assert 'torchft' not in sys.modules; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], env=base_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["tcp", "gloo"])
def test_adapter_contract(backend):
    import tdist

    if not tdist.is_backend_available(backend):
        pytest.skip(f"tdist-{backend} is not installed")
    port = str(free_port())
    results = run_job(
        [[sys.executable, PROGRAMS, "contract", backend, str(rank), port] for rank in range(2)], [base_env()] * 2, 150
    )
    seen = []
    for res in results:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        records = _records(res.stdout, "CONTRACT")
        assert len(records) == 1, res.stdout[-3000:]
        seen.append(records[0])
    for view in seen:
        assert view["name"] == f"torchft-tdist-{backend}" and view["size"] == 2
        assert view["all_reduce"] == [3.0] * 4 and view["broadcast"] == [1.0, 1.0]
        assert view["future"] == [[2.0, 2.0]] and view["errored_healthy"]
        assert view["after_reconfigure"] == [3.0]
    assert seen[1]["recv"] == [0.0, 1.0, 2.0]
    survivor = seen[0]
    assert survivor["wait_raised"] is False  # torchft's contract: reported by errored(), not raised
    assert survivor["errored_after_death"] is not None
    assert survivor["errored_after_configure"] and survivor["alone"] == [5.0]
    assert survivor["errored_after_abort"] and survivor["late_future"] == [[1.0]]


def test_backends_torchft_cannot_use_are_refused_at_construction():
    import tdist
    from tdist.integrations.torchft import ProcessGroupTdist

    with pytest.raises(tdist.DistError, match="not installed"):
        ProcessGroupTdist(backend="no-such-backend")
    if tdist.is_backend_available("mpi"):
        with pytest.raises(tdist.DistError, match="one mpirun"):
            ProcessGroupTdist(backend="mpi")


def _train(pg: str, kill_when: str) -> list:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100, heartbeat_timeout_ms=2000
    )
    try:
        # Both go on past STEPS until they have committed a step together (the restarted one
        # may take seconds to start); the survivor's steps are slowed down meanwhile.
        common = [sys.executable, EXAMPLE, "--pg", pg, "--steps", str(STEPS), "--end-with", "2", "--step-sleep", "0.05"]
        commands = [common, [*common, "--kill-at", str(KILL_AT), "--kill-when", kill_when, "--restarts", "1"]]
        envs = [
            base_env(TORCHFT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS="2")
            for r in range(2)
        ]
        return run_job(commands, envs, 240, cwd=ROOT)
    finally:
        lighthouse.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "pg, kill_when",
    [("tdist-tcp", "mid-step")],  # the bench's smoke run below covers between steps and torchft's gloo
    ids=["tdist-tcp-mid-step"],
)
def test_ddp_example_survives_a_sigkill_and_the_restarted_replica_heals(pg, kill_when):
    survivor, restarted = _train(pg, kill_when)
    for res in (survivor, restarted):
        assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    out = survivor.stdout + restarted.stdout
    (kill,) = _records(restarted.stdout, "TORCHFT_KILL")
    # The survivor never restarted and kept committing steps after the kill.
    survivor_steps = _records(survivor.stdout, "TORCHFT_STEP")
    assert {r["attempt"] for r in survivor_steps} == {0}, out[-4000:]
    after = [r for r in survivor_steps if r["t"] > kill["t"]]
    assert after and after[-1]["step"] >= STEPS, out[-4000:]
    # The restarted replica healed from the survivor: its first committed step is past the kill's.
    second = [r for r in _records(restarted.stdout, "TORCHFT_STEP") if r["attempt"] == 1]
    assert second and second[0]["step"] > KILL_AT, out[-4000:]
    assert any(r["participants"] == 2 for r in second), out[-4000:]  # and trained with it again
    (done_survivor,) = _records(survivor.stdout, "TORCHFT_DONE")
    (done_restarted,) = _records(restarted.stdout, "TORCHFT_DONE")
    assert done_survivor["step"] == done_restarted["step"] >= STEPS
    assert done_survivor["params"] == done_restarted["params"], out[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_torchft_mode(tmp_path):
    """``python -m tdist.bench --torchft --repeats 1``: a row per (kill, process group);
    tdist's survivor recovers from both kills. No timing is asserted."""
    out = tmp_path / "torchft.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tdist.bench", "--torchft", "--repeats", "1", "--json", str(out)],
        cwd=tmp_path,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "recovered" in proc.stdout and "ProcessGroupGloo" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert {(r["kill"], r["pg"]) for r in rows} == {
        (kill, pg) for kill in ("between-steps", "mid-step") for pg in ("tdist-tcp", "gloo")
    }
    for row in rows:
        assert "recovered_s" in row or row.get("error"), row
        if row["pg"] == "tdist-tcp":
            assert row["samples"] == 1 and row["recovered_s"] > 0 and row["configure_s"] > 0, row
