"""Growing a running job (tdist.join_process_group / tdist.grow_group): the refusals.

The whole path (a replacement joins four real processes and receives their state) is
tests/test_shrink_training.py; here each bad input is a clear error, nothing hangs.
"""

from __future__ import annotations

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
