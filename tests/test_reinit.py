"""Worlds made again and again, and worlds whose ranks were started wrong (real processes).

- ``destroy_process_group()`` then ``init_process_group()`` 30 times on one port (env://
  and tcp://, tcp and gloo, and under tdistrun with a token, whose store outlives every
  world): a fast rank never joins the previous world, whose store may still serve while
  rank 0 tears it down, or whose keys the launcher's store still holds.
- Ranks started with different world sizes, or two processes with one rank: every rank
  raises a DistError naming them instead of waiting out the timeout (init's timeout here
  is 60 s, and a timeout would raise another error).
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("torch")

import tdist  # noqa: E402
from tdist.testing import free_port  # noqa: E402
from tdist.testing.processes import JobResult, base_env, run_job  # noqa: E402

JOB_TIMEOUT = 150
ROUNDS = 30
pytestmark = [pytest.mark.slow, pytest.mark.timeout(JOB_TIMEOUT + 30)]

TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]

REINIT = """
import json, os, sys
from datetime import timedelta
import torch
import tdist as dist

backend, method, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
args = {} if method == "env://" else {"rank": rank, "world_size": size}
sums = []
for _ in range(rounds):
    dist.init_process_group(backend, init_method=method, timeout=timedelta(seconds=30), **args)
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    sums.append(t[0].item())
    dist.destroy_process_group()
print("REPORT " + json.dumps({"rank": rank, "sums": sums}), flush=True)
"""

SHRINK_AGAIN = """
import json, os
from datetime import timedelta
import torch
import tdist as dist

rank = int(os.environ["RANK"])
sums = []
for lost in (2, 0):  # world 1: ranks 0 and 1 shrink without rank 2; world 2: ranks 1 and 2 without rank 0
    dist.init_process_group("tcp", timeout=timedelta(seconds=30))
    if rank != lost:
        dist.shrink_group([lost])
        t = torch.ones(2) * (rank + 1)
        dist.all_reduce(t)
        sums.append(t[0].item())
    dist.destroy_process_group()
print("REPORT " + json.dumps({"rank": rank, "sums": sums}), flush=True)
"""

MISMATCH = """
import json, os, time
from datetime import timedelta
import tdist as dist

after = os.environ.get("START_AFTER")  # a file another process writes once it has raised
if after:
    deadline = time.monotonic() + 60
    while not os.path.exists(after) and time.monotonic() < deadline:
        time.sleep(0.02)
try:
    dist.init_process_group("tcp", timeout=timedelta(seconds=60))
    report = {"type": None}
    dist.destroy_process_group()
except Exception as exc:
    report = {"type": type(exc).__name__, "dist_error": isinstance(exc, dist.DistError), "message": str(exc)}
finally:
    open(os.environ["DONE"], "w").close()
print("REPORT " + json.dumps(report), flush=True)
"""


def _report(result: JobResult) -> dict:
    lines = result.lines("REPORT ")
    assert result.returncode == 0 and len(lines) == 1, f"rc {result.returncode}\n{result.output[-4000:]}"
    return json.loads(lines[0][len("REPORT ") :])


def _check_sums(reports: list[dict], world_size: int) -> None:
    assert sorted(r["rank"] for r in reports) == list(range(world_size)), reports
    for r in reports:
        assert r["sums"] == [world_size * (world_size + 1) / 2] * ROUNDS, r


@pytest.mark.parametrize(
    "backend,scheme,world_size",
    [("tcp", "env", 3), ("tcp", "tcp", 2), ("gloo", "env", 2), ("gloo", "tcp", 2)],
    ids=["tcp-env-3", "tcp-tcp-2", "gloo-env-2", "gloo-tcp-2"],
)
def test_destroy_and_init_again_on_the_same_port(tmp_path, backend, scheme, world_size):
    if not tdist.is_backend_available(backend):
        pytest.skip(f"backend {backend!r} is not available here")
    program = tmp_path / "reinit.py"
    program.write_text(REINIT)
    port = free_port()
    method = "env://" if scheme == "env" else f"tcp://127.0.0.1:{port}"
    envs = [
        base_env(RANK=str(r), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        for r in range(world_size)
    ]
    cmd = [sys.executable, str(program), backend, method, str(ROUNDS)]
    results = run_job([cmd] * world_size, envs, timeout=JOB_TIMEOUT)
    _check_sums([_report(r) for r in results], world_size)


def test_destroy_and_init_again_under_tdistrun_with_a_token(tmp_path):
    """tdistrun's authenticated store (TDIST_STORE_TOKEN) serves every world of the job
    under one prefix: each world's keys, the tcp mesh's nonces included, are its own."""
    program = tmp_path / "reinit.py"
    program.write_text(REINIT)
    args = ["--nproc-per-node", "2", str(program), "tcp", "env://", str(ROUNDS)]
    env = base_env(TDIST_STORE_TOKEN="reinit-test-token")
    (res,) = run_job([[*TDISTRUN, *args]], [env], timeout=JOB_TIMEOUT)
    assert res.returncode == 0, res.output[-4000:]
    decoder = json.JSONDecoder()
    reports = [decoder.raw_decode(chunk)[0] for chunk in res.stdout.split("REPORT ")[1:]]
    _check_sums(reports, 2)


def test_shrink_in_every_world_of_a_process(tmp_path):
    """A process that shrank the default group of an earlier world meets, in a later world,
    one that never shrank: their shrunken groups still get one name (a group's shrinks are
    counted per group, not per process and group name)."""
    program = tmp_path / "shrink_again.py"
    program.write_text(SHRINK_AGAIN)
    port = str(free_port())
    envs = [base_env(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(3)]
    results = run_job([[sys.executable, str(program)]] * 3, envs, timeout=JOB_TIMEOUT)
    reports = {r["rank"]: r["sums"] for r in map(_report, results)}
    assert reports == {0: [3.0], 1: [3.0, 5.0], 2: [5.0]}, reports


def _mismatch_job(tmp_path, processes: list[tuple[int, int, int]]) -> list[dict]:
    """One process per (rank, world size, index of the process to start after, or -1),
    env:// on one port; each process's report."""
    program = tmp_path / "mismatch.py"
    program.write_text(MISMATCH)
    port = str(free_port())
    envs = []
    for i, (rank, size, after) in enumerate(processes):
        extra = {"START_AFTER": str(tmp_path / f"done.{after}")} if after >= 0 else {}
        envs.append(
            base_env(
                RANK=str(rank),
                WORLD_SIZE=str(size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                DONE=str(tmp_path / f"done.{i}"),
                **extra,
            )
        )
    results = run_job([[sys.executable, str(program)]] * len(processes), envs, timeout=JOB_TIMEOUT)
    return [_report(r) for r in results]


@pytest.mark.parametrize(
    "processes",
    [
        [(0, 3, -1), (1, 2, -1), (2, 3, -1)],  # rank 0 waits for a rank 2 the ranks with 2 never start
        [(0, 2, -1), (2, 3, -1), (1, 2, 1)],  # rank 0 and rank 1 agree; rank 1 comes after rank 2 raised
    ],
    ids=["rank0-has-3", "rank0-has-2"],
)
def test_ranks_started_with_different_world_sizes_all_raise(tmp_path, processes):
    reports = _mismatch_job(tmp_path, processes)
    first_size = next(size for rank, size, _ in processes if rank == 0)
    odd_rank, odd_size = next((rank, size) for rank, size, _ in processes if size != first_size)
    expected = f"rank {odd_rank} was started with world_size {odd_size}, rank 0 with {first_size}"
    for (rank, _, _), report in zip(processes, reports):
        assert report["dist_error"] and expected in report["message"], (rank, report)


def test_two_processes_with_one_rank_all_raise(tmp_path):
    """Two processes started as rank 1 of 3: both, rank 0, and rank 2 (started after one
    of them raised) raise naming the duplicate."""
    reports = _mismatch_job(tmp_path, [(0, 3, -1), (1, 3, -1), (1, 3, -1), (2, 3, 1)])
    for report in reports:
        assert report["dist_error"] and "rank 1 was started twice" in report["message"], report
