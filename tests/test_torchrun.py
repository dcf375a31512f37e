"""Real tdist programs (tcp backend, env://) under torchrun and under tdistrun with
torchrun's options: the agent's store is joined as a client (no EADDRINUSE), a
restarted group does not trip over the keys of the failed one, two tdistrun "nodes"
meet in one c10d rendezvous, and the token mode's authenticated store. (A token under
plain torchrun is refused: test_env_launchers.py.)

Each launcher runs in its own session, killed when the test ends.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")

from tdist.testing import free_port  # noqa: E402
from tdist.testing.processes import JobResult, base_env, run_job  # noqa: E402

LAUNCH_TIMEOUT = 150
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)]

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]
TOKEN = "launcher-test-token"

PROGRAM = """
import json, os, sys
from datetime import timedelta
import torch
import tdist as dist

dist.init_process_group("tcp", timeout=timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
report = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item(),
          "env": {k: os.environ.get(k) for k in ("TORCHELASTIC_RESTART_COUNT", "TDIST_STORE_PREFIX", "MASTER_PORT",
                                                 "TDIST_STORE_ADDR", "TDIST_STORE_PORT", "GROUP_RANK")}}
if os.environ.get("TDIST_STORE_PORT"):  # token mode: the store refuses a client with the wrong token
    try:
        dist.TCPStore(os.environ["TDIST_STORE_ADDR"], int(os.environ["TDIST_STORE_PORT"]), is_master=False,
                      token="wrong", timeout=timedelta(seconds=10))
        report["impostor"] = "accepted"
    except dist.DistError as exc:
        report["impostor"] = type(exc).__name__
print("REPORT " + json.dumps(report), flush=True)
if "--fail-once" in sys.argv and dist.get_rank() == 1 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(5)  # after init and a collective: the next attempt finds this attempt's keys in the agent store
dist.destroy_process_group()
"""


@pytest.fixture
def logs(tmp_path) -> list[str]:
    """A --log-dir in tmp_path: torchrun otherwise leaves a torchelastic_* directory in /tmp."""
    return ["--log-dir", str(tmp_path / "logs")]


@pytest.fixture
def program(tmp_path) -> str:
    path = tmp_path / "program.py"
    path.write_text(PROGRAM)
    return str(path)


def run(launcher: list[str], args: list[str], **env: str) -> JobResult:
    """Run one launcher to the end (its session is killed whatever happens)."""
    return run_job([[*launcher, *args]], [base_env(**env)], timeout=LAUNCH_TIMEOUT)[0]


def reports(stdout: str) -> list[dict]:
    """The workers' reports. Under torchrun the workers share the console: a report is one
    write, but the newline after it is another, so reports may share a line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(chunk)[0] for chunk in stdout.split("REPORT ")[1:]]


def check_world(found: list[dict], world_size: int) -> None:
    assert sorted(r["rank"] for r in found) == list(range(world_size)), found
    assert all(r["world_size"] == world_size and r["sum"] == world_size * (world_size + 1) / 2 for r in found)


@pytest.mark.parametrize(
    "launcher,mode",
    [("torchrun", []), ("torchrun", ["--standalone"]), ("tdistrun", ["--standalone"])],
    ids=["torchrun", "torchrun-standalone", "tdistrun-standalone"],
)
def test_tdist_program(program, logs, launcher, mode):
    """env:// under the agent (TORCHELASTIC_USE_AGENT_STORE=True) joins its store: rank 0 no
    longer binds MASTER_PORT (EADDRINUSE). (tdistrun's default mode runs examples/train.py
    in test_ddp.py.)"""
    launcher_cmd = TORCHRUN if launcher == "torchrun" else TDISTRUN
    res = run(launcher_cmd, [*mode, *logs, "--nproc-per-node", "2", program])
    assert res.returncode == 0, res.stderr[-3000:]
    found = reports(res.stdout)
    check_world(found, 2)
    assert all(r["env"]["TORCHELASTIC_RESTART_COUNT"] == "0" for r in found)
    if launcher == "tdistrun":
        assert all(line.startswith("[rank ") for line in res.stdout.splitlines())


def test_restart_after_a_failure(program):
    """--max-restarts 1 (static rendezvous: the agent store lives across attempts): rank 1 fails
    after its first all_reduce; the new group gets a fresh key prefix and succeeds."""
    res = run(
        TDISTRUN,
        ["--nproc-per-node", "2", "--max-restarts", "1", "--master-port", str(free_port()), program, "--fail-once"],
    )
    assert res.returncode == 0, res.stderr[-3000:]
    found = reports(res.stdout)
    attempts = {c: [r for r in found if r["env"]["TORCHELASTIC_RESTART_COUNT"] == c] for c in ("0", "1")}
    check_world(attempts["1"], 2)
    assert [r["rank"] for r in attempts["0"] if r["rank"] == 1] == [1]  # rank 1 reported, then failed
    prefixes = {c: {r["env"]["TDIST_STORE_PREFIX"] for r in rs} for c, rs in attempts.items()}
    assert len(prefixes["1"]) == 1 and not prefixes["0"] & prefixes["1"]
    assert "restarting the worker group (restart 1 of 1)" in res.stderr


def test_two_nodes_join_one_c10d_rendezvous(program):
    """--nnodes 1:2 with c10d: two tdistrun processes (two "nodes" on this host) join one
    rendezvous and their workers form one world of 2. With a token, both use the
    authenticated store of group rank 0's agent, whose address travels through the rendezvous."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "two-nodes",
        "--rdzv-conf",
        "last_call_timeout=60",
        program,
    ]
    found = []
    for res in run_job([[*TDISTRUN, *args]] * 2, [base_env(TDIST_STORE_TOKEN=TOKEN)] * 2, timeout=LAUNCH_TIMEOUT):
        assert res.returncode == 0, res.stderr[-3000:]
        found += reports(res.stdout)
    check_world(found, 2)
    assert sorted(r["env"]["GROUP_RANK"] for r in found) == ["0", "1"]
    assert len({(r["env"]["TDIST_STORE_ADDR"], r["env"]["TDIST_STORE_PORT"]) for r in found}) == 1
    assert all(r["impostor"] != "accepted" for r in found)


def test_token_mode_hosts_an_authenticated_store(program):
    """With TDIST_STORE_TOKEN, tdistrun hosts a tdist store that refuses a wrong token;
    env:// uses it instead of the agent's torch store."""
    res = run(TDISTRUN, ["--nproc-per-node", "2", program], TDIST_STORE_TOKEN=TOKEN)
    assert res.returncode == 0, res.stderr[-3000:]
    found = reports(res.stdout)
    check_world(found, 2)
    for r in found:
        assert r["env"]["TDIST_STORE_ADDR"] == "127.0.0.1"
        assert r["env"]["TDIST_STORE_PORT"] not in (None, r["env"]["MASTER_PORT"])
        assert r["impostor"] != "accepted"
