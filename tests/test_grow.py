"""Growing a running job (tdist.join_process_group / tdist.grow_group): the refusals.

The whole path (a replacement joins four real processes and receives their state) is
tests/test_shrink_training.py; here each bad input is a clear error, nothing hangs.
"""

from __future__ import annotations

import json
import sys
import textwrap
from datetime import timedelta

import pytest

import tdist
from tdist.testing import free_port
from tdist.testing.processes import base_env, run_job

pytestmark = pytest.mark.timeout(120)

JOINER = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import tdist
    started = time.monotonic()
    try:
        tdist.join_process_group("tcp", timeout=timedelta(seconds=float(sys.argv[1])))
    except Exception as exc:
        print(f"{type(exc).__name__} after {time.monotonic() - started:.1f} s: {exc}")
        sys.exit(3)
    """
)


MEMBER = textwrap.dedent(
    """
    import json, os, signal, time
    from datetime import timedelta
    import torch
    import tdist
    tdist.init_process_group("tcp", timeout=timedelta(seconds=20))
    rank = tdist.get_rank()
    t = torch.ones(1)
    tdist.all_reduce(t)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        while True:
            tdist.all_reduce(t)
    except tdist.DistRankFailureError as exc:
        failed = list(exc.failed_ranks)
    tdist.shrink_group(failed)
    tdist.grow_group(min_joiners=1)
    t = torch.ones(1) * (tdist.get_rank() + 1)
    tdist.all_reduce(t)
    print("REPORT " + json.dumps({"rank": tdist.get_rank(), "size": tdist.get_world_size(), "sum": t.item(),
                                  "failed": failed}), flush=True)
    tdist.destroy_process_group()
    """
)

NEWCOMER = textwrap.dedent(
    """
    import json
    from datetime import timedelta
    import torch
    import tdist
    tdist.join_process_group("tcp", timeout=timedelta(seconds=60))
    t = torch.ones(1) * (tdist.get_rank() + 1)
    tdist.all_reduce(t)
    print("REPORT " + json.dumps({"rank": tdist.get_rank(), "size": tdist.get_world_size(), "sum": t.item()}),
          flush=True)
    tdist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_a_join_filed_during_a_shrink_is_admitted_by_the_next_grow():
    """A newcomer files its join while the members lose a rank and shrink: it waits (no
    error, no half-built group on anyone) and the grow after the shrink admits it."""
    port = str(free_port())
    envs = [base_env(RANK=str(r), WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(3)]
    envs.append(base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
    cmds = [[sys.executable, "-c", MEMBER]] * 3 + [[sys.executable, "-c", NEWCOMER]]
    results = run_job(cmds, envs, timeout=100)
    assert results[2].returncode == -9, results[2].output[-2000:]
    reports = []
    for res in results[:2] + results[3:]:
        lines = res.lines("REPORT ")
        assert res.returncode == 0 and len(lines) == 1, f"rc {res.returncode}\n{res.output[-3000:]}"
        reports.append(json.loads(lines[0][len("REPORT ") :]))
    assert [r["rank"] for r in reports] == [0, 1, 2], reports
    assert all(r["size"] == 3 and r["sum"] == 6.0 for r in reports), reports
    assert all(r["failed"] == [2] for r in reports[:2]), reports


def _join(port: int, token: str, wait: float) -> str:
    env = {**base_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TDIST_STORE_TOKEN": token}
    res = run_job([[sys.executable, "-c", JOINER, str(wait)]], [env], timeout=90)[0]
    assert res.returncode == 3, f"the joiner exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_a_join_with_a_wrong_token_is_refused_by_the_store():
    port = free_port()
    server = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, token="right-token")
    try:
        out = _join(port, "wrong-token", 20)
    finally:
        server.close()
    assert "DistStoreError" in out or "DistNetworkError" in out, out
    assert "token" in out.lower() or "authentic" in out.lower(), out


def test_a_join_nobody_admits_times_out_clearly():
    port = free_port()
    server = tdist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, token="t")
    try:
        server.set("tdist/incarnation", "abc 2")  # a running world, whose members never grow
        out = _join(port, "t", 2)
    finally:
        server.close()
    assert "did not admit this process within 2 s" in out and "grow_group" in out, out


def test_grow_group_refusals_and_nobody_waiting():
    with pytest.raises(tdist.DistStateError):
        tdist.grow_group()
    tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, torch_bridge=False)
    try:
        with pytest.raises(ValueError, match="min_joiners"):
            tdist.grow_group(min_joiners=-1)
        world = tdist.group.WORLD
        assert tdist.grow_group() is world  # nobody waiting: the same group
        with pytest.raises(tdist.DistError, match="1 process"):
            tdist.grow_group(min_joiners=1, timeout=timedelta(seconds=0.3))
        with pytest.raises(tdist.DistStateError, match="already initialized"):
            tdist.join_process_group("tcp")
    finally:
        tdist.destroy_process_group()
