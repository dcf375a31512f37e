"""Fault-tolerance scenarios: a rank is lost (killed, stopped past the timeout) or a group
is aborted, and the survivors agree on what failed, shrink the group and go on.

Registered with :func:`~tdist.testing.scenario_kit.scenario` like the other failure
scenarios; the worker-side parts are the ``_w_*`` functions below.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from .scenario_kit import ScenarioContext, _fmt, _info, _w_collectives_until_error, _w_ready, scenario
from .world import RankFailure

__all__: list[str] = []


# =========================================================================== agreed failure
def _w_until_failure(seconds: float) -> dict:
    """Loop all_reduce until it fails; report the error, its agreed failed ranks, and what
    the next operation on the group raises (it must fail at once, with the same ranks)."""
    import torch

    from ._common import dist

    out = _w_collectives_until_error(seconds)
    if out["type"] is None:
        return out
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        out["next"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        out["next"] = {**_info(exc, started), "failed_ranks": list(getattr(exc, "failed_ranks", []))}
    return out


def _failed_ranks_of(outcome: dict) -> list:
    return [int(r) for r in outcome.get("failed_ranks", [])]


@scenario(
    params=[{"how": "kill"}, {"how": "stop"}],
    timeout=150,
    requires=("peer_failure",),
    tdist_only="the agreed DistRankFailureError is tdist's",
)
def failed_ranks_agreed(ctx: ScenarioContext, how: str = "kill") -> None:
    """A rank SIGKILLed, or SIGSTOPped past the group's timeout, mid all_reduce: every
    survivor raises DistRankFailureError naming the same failed rank, and so does its next
    operation on the group, at once."""
    n = 4
    with ctx.spawn(n, pg_timeout=20 if how == "kill" else 4) as world:
        world.run(_w_ready)
        pending = world.submit(_w_until_failure, timeout=100, seconds=60.0)
        time.sleep(1.0)
        world.kill_rank(n - 1, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        if how == "stop":  # the survivors time out after 4 s; then end the stopped rank, which never reports
            time.sleep(15.0)
            world.kill_rank(n - 1, signal.SIGKILL)
        outcomes = pending.outcomes()[: n - 1]
    for r, o in enumerate(outcomes):
        assert not isinstance(o, RankFailure), f"rank {r} did not report back: {_fmt(o)}"
        assert "DistRankFailureError" in o["mro"], f"rank {r} raised {o['type']}: {o['message']}"
        assert o["next"] is not None and "DistRankFailureError" in o["next"]["mro"], (
            f"rank {r}: the next all_reduce on the failed group gave {o['next']}"
        )
        if how == "stop":  # found by the group's timeout: also a TimeoutError
            assert "TimeoutError" in o["mro"], f"rank {r} raised {o['type']}, not a TimeoutError"
        assert o["next"]["failed_ranks"] == [n - 1], f"rank {r} names {o['next']['failed_ranks']}, not [{n - 1}]"
        assert o["next"]["elapsed"] < 1.0, f"rank {r}: the next operation took {o['next']['elapsed']:.1f} s to fail"
        assert f"rank {n - 1}" in o["message"], f"rank {r}'s error does not name rank {n - 1}: {o['message']}"


# =========================================================================== shrink
def _w_shrink_after_loss(seconds: float, api: str) -> dict:
    """Loop all_reduce until the lost peer makes it fail, then shrink the default group
    and a subgroup without it -- through tdist's ``shrink_group`` or, with ``api="torch"``,
    torch.distributed's on the same groups -- and use both; report ranks, sizes, sums
    and timings."""
    import torch
    import torch.distributed as td

    from ._common import dist

    old_rank, n = dist.get_rank(), dist.get_world_size()
    pair = dist.new_group([0, n - 1])  # a subgroup with the rank that will be lost
    failure = _w_collectives_until_error(seconds)
    if failure["type"] is None:
        return {"failure": failure}
    if api == "torch" and not td.is_initialized():
        return {"failure": failure, "skipped": "torch.distributed does not see tdist's groups here"}
    shrink = td.shrink_group if api == "torch" else dist.shrink_group
    started = time.monotonic()
    out: dict = {"failure": failure}
    if old_rank == 0:  # shrink the subgroup first: the world's shrink destroys it
        alone = shrink([1], group=pair)
        out["pair"] = dist.get_process_group_ranks(alone)
    world = shrink([n - 1])
    t = torch.full((4,), float(old_rank + 1))
    (td if api == "torch" else dist).all_reduce(t)
    out["first_step_s"] = time.monotonic() - started
    out.update(
        rank=dist.get_rank(),
        size=dist.get_world_size(),
        sum=t.tolist(),
        default_is_new=world is dist.group.WORLD,
    )
    if td.is_initialized():
        out["torch_size"] = td.get_world_size()
        out["torch_default_is_new"] = world is td.group.WORLD
    dist.barrier()
    return out


@scenario(
    params=[{"api": "tdist"}, {"api": "torch"}],
    timeout=150,
    requires=("shrink_group",),
    tdist_only="torch's shrink_group is NCCL-only",
)
def shrink_after_peer_killed(ctx: ScenarioContext, api: str = "tdist") -> None:
    """A peer SIGKILLed mid all_reduce: the survivors shrink the default group (and a
    subgroup) without it, with no restart -- with tdist's ``shrink_group`` or, on the same
    groups, torch.distributed's (``api="torch"``: the bridge routes it to tdist); the new
    default group is renumbered 0..n-2, torch's default group follows, and collectives
    on it give the survivors' sums."""
    n = 3
    with ctx.spawn(n, pg_timeout=15) as world:
        world.run(_w_ready)
        pending = world.submit(_w_shrink_after_loss, timeout=100, seconds=60.0, api=api)
        time.sleep(1.0)
        world.kill_rank(n - 1, signal.SIGKILL)
        outcomes = pending.outcomes()
    if api == "torch" and not isinstance(outcomes[0], RankFailure) and "skipped" in outcomes[0]:
        pytest.skip(outcomes[0]["skipped"])
    for r in range(n - 1):
        o = outcomes[r]
        assert not isinstance(o, RankFailure), f"rank {r} failed to shrink: {o}"
        assert o["failure"]["type"] is not None, f"rank {r}'s all_reduce kept completing after its peer died"
        assert (o["rank"], o["size"]) == (r, n - 1), f"rank {r} is rank {o['rank']} of {o['size']} after the shrink"
        assert o["sum"] == [float(sum(range(1, n)))] * 4, f"rank {r}: all_reduce on the shrunken world gave {o['sum']}"
        assert o["default_is_new"], f"rank {r}: shrink_group's result is not the default group"
        if "torch_size" in o:
            assert o["torch_size"] == n - 1, f"rank {r}: torch's default group has {o['torch_size']} ranks"
            assert o["torch_default_is_new"], f"rank {r}: shrink_group's result is not torch's default group"
    assert outcomes[0]["pair"] == [0], f"the shrunken pair is {outcomes[0]['pair']}"


# =========================================================================== abort
def _w_abort_pending(abort_after: float) -> dict:
    """Ranks 0 and 1 wait in an all_reduce that the last rank never joins; rank 0 aborts
    the group from another thread: both pending all_reduces must fail, promptly."""
    import torch

    from ._common import dist

    rank, n = dist.get_rank(), dist.get_world_size()
    if rank == n - 1:
        time.sleep(abort_after + 8.0)  # alive, but never joins
        return {"rank": rank}
    if rank == 0:
        threading.Timer(abort_after, lambda: dist.group.WORLD.abort()).start()
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        return {"rank": rank, "type": None}
    except Exception as exc:  # noqa: BLE001 - reported to the controller
        return {"rank": rank, **_info(exc, started)}


@scenario(
    timeout=120,
    requires=("peer_failure", "abort"),
    tdist_only="torch's abort of a non-NCCL group is not guaranteed to unblock the peers",
)
def abort_unblocks_peers(ctx: ScenarioContext) -> None:
    """``group.WORLD.abort()`` on one rank, while it and a peer wait in an all_reduce that
    a third rank never joins: both pending operations fail within seconds (the group's
    timeout is 60 s), and the peer does not report a rank failure."""
    abort_after = 1.0
    with ctx.spawn(3, pg_timeout=60) as world:
        world.run(_w_ready)
        outcomes = world.run(_w_abort_pending, timeout=90, abort_after=abort_after)
    for r in (0, 1):
        o = outcomes[r]
        assert not isinstance(o, RankFailure), f"rank {r} did not report back: {_fmt(o)}"
        assert o["type"] is not None, f"rank {r}'s all_reduce completed although rank 2 never joined"
        assert o["elapsed"] < abort_after + 10.0, f"rank {r}'s all_reduce failed only after {o['elapsed']:.1f} s"
        assert "DistRankFailureError" not in o["mro"], (
            f"rank {r} reported a rank failure after an abort: {o['message']}"
        )
