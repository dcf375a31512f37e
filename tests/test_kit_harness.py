"""The kit's harness: a failing rank stops the world at once (fail-fast), and one-off
worlds get an address of their own when the session's init_method is fixed."""

from __future__ import annotations

import time

import pytest

from tdist.testing.scenarios import own_address
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
