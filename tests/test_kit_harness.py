"""The kit's harness: a failing rank stops the world at once (fail-fast), one-off
worlds get an address of their own when the session's init_method is fixed, and a
world without a process group replaces only its dead ranks."""

from __future__ import annotations

import os
import time

import pytest

from tdist.testing.scenarios import own_address
from tdist.testing import RankFailure
from tdist.testing.world import World, WorldRunError


def _rank1_asserts_rank0_waits() -> None:
    from tdist.testing._common import dist

    if dist.get_rank() == 1:
        raise AssertionError("rank 1's own check failed")
    dist.barrier()  # waits for rank 1, which never comes


def test_a_failing_rank_stops_the_others_and_is_reported_first():
    with World.spawn("tcp", 2, pg_timeout=60) as world:
        started = time.monotonic()
        with pytest.raises(WorldRunError) as caught:
            world.run(_rank1_asserts_rank0_waits, timeout=60, fail_fast=1.0)
        elapsed = time.monotonic() - started
    message = str(caught.value)
    assert elapsed < 20, f"took {elapsed:.1f} s: the waiting rank was not stopped"
    assert "ranks [0] were stopped once rank 1 had failed" in message, message
    assert message.index("--- rank 1: AssertionError: rank 1's own check failed") < message.index("--- rank 0"), message


def test_one_off_worlds_get_their_own_address():
    tcp = own_address("tcp://127.0.0.1:29555")
    assert tcp.startswith("tcp://127.0.0.1:") and not tcp.endswith(":29555")
    assert own_address("tcp://[::1]:29555?x=1").startswith("tcp://[::1]:")
    assert own_address("tcp://[::1]:29555?x=1").endswith("?x=1")
    first, second = own_address("file:///tmp/rdv"), own_address("file:///tmp/rdv")
    assert first.startswith("file:///tmp/rdv.") and first != second
    assert own_address("env://") == "env://"


def _pid_unless_rank_exits(exiting: int) -> int:
    if int(os.environ["RANK"]) == exiting:
        os._exit(3)
    return os.getpid()


def test_a_world_without_process_group_replaces_only_its_dead_ranks():
    with World.spawn("tcp", 3, init=False) as world:
        before = world.pids
        survivor, dead, other = world.try_run(_pid_unless_rank_exits, exiting=1, timeout=30)
        assert isinstance(dead, RankFailure) and dead.kind == "died" and "exit code 3" in dead.message, dead
        assert [survivor, other] == [before[0], before[2]]
        assert world.alive and 1 not in world.pids
        after = world.run(_pid_unless_rank_exits, exiting=-1, timeout=60)  # starts a new rank 1 first
        assert after[0] == before[0] and after[2] == before[2] and after[1] not in (before[1], None)
        assert world.pids == dict(enumerate(after))
