"""Failure scenarios: each one starts its own one-off world (``World.spawn``),
breaks it on purpose, and checks the survivors fail promptly and clearly.

A scenario is a controller-side function ``fn(ctx)`` (``ctx`` a
:class:`ScenarioContext`) registered with :func:`scenario`; the worker-side
parts are the ``_w_*`` functions below. Scenarios raise AssertionError when
the backend misbehaves.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import time
from datetime import timedelta
from typing import Any, Iterator

from . import scenarios_ft  # noqa: F401  (registers the fault-tolerance scenarios)
from .scenario_kit import (
    Scenario,
    ScenarioContext,
    _fmt,
    _info,
    _w_collectives_until_error,
    _w_ready,
    own_address,
    registered,
    scenario,
)
from .world import RankFailure, free_port

__all__ = ["Scenario", "ScenarioContext", "scenario", "scenarios", "own_address"]


def scenarios() -> list[Scenario]:
    """Every failure scenario of the kit (this module's and :mod:`~tdist.testing.scenarios_ft`'s)."""
    return registered()


@scenario(
    timeout=120,
    requires=("peer_failure",),
)
def peer_killed_mid_collective(ctx: ScenarioContext) -> None:
    """A peer SIGKILLed while the others are in all_reduce: every survivor raises
    (DistBackendError for tdist) within 10 s, instead of hanging."""
    n = 3
    with ctx.spawn(n, pg_timeout=20) as world:  # detection must come from the dead peer, not the timeout
        world.run(_w_ready)
        pending = world.submit(_w_collectives_until_error, timeout=60, seconds=40.0)
        time.sleep(1.0)
        killed_at = time.time()
        world.kill_rank(n - 1, signal.SIGKILL)
        outcomes = pending.outcomes()
    victim = outcomes[n - 1]
    assert isinstance(victim, RankFailure) and victim.kind == "died", f"the killed rank reported {_fmt(victim)}"
    for r in range(n - 1):
        o = outcomes[r]
        assert not isinstance(o, RankFailure), f"rank {r} did not report back: {o}"
        assert o["type"] is not None, f"rank {r} kept completing all_reduce ({o['count']} calls) after its peer died"
        delay = o["at"] - killed_at
        assert delay <= 10.0, f"rank {r} noticed the dead peer only after {delay:.1f} s ({o['type']}: {o['message']})"
        if ctx.strict:
            assert "DistBackendError" in o["mro"], (
                f"rank {r} raised {o['type']} ({o['message']}), expected tdist.DistBackendError"
            )


# =========================================================================== missing peer at init
@scenario(timeout=120, not_with={"mpi": "mpirun always starts every rank"})
def init_missing_peer(ctx: ScenarioContext) -> None:
    """init_process_group(world_size=3) with only ranks 0 and 1 started fails on both
    within its timeout (+ slack), naming the missing rank 2 (tdist)."""
    timeout = 5.0
    with ctx.spawn(3, ranks=[0, 1], init=False, pg_timeout=timeout) as world:
        started = time.monotonic()
        outcomes = world.try_init(timeout=timeout + 60)
        elapsed = time.monotonic() - started
    for r, o in zip((0, 1), outcomes):
        assert isinstance(o, RankFailure) and o.kind == "error", (
            f"rank {r}: init_process_group with a missing peer gave {_fmt(o)}, expected an error"
        )
    assert elapsed <= timeout * 3 + 10, f"init with a missing peer took {elapsed:.1f} s (timeout {timeout} s)"
    if ctx.strict:
        host = outcomes[0]  # rank 0 hosts the store and is the one that waits for the peers
        assert host.is_a("TimeoutError") and host.is_a("DistError"), (
            f"rank 0: {host.type_name} is not a tdist DistError + TimeoutError: {host.message}"
        )
        other = outcomes[1]  # may time out itself or lose the store when rank 0 gives up
        assert other.is_a("DistError"), f"rank 1: {other.type_name} is not a tdist DistError: {other.message}"
        assert re.search(r"\b2\b", outcomes[0].message), (
            f"rank 0's error does not name the missing rank 2: {outcomes[0].message}"
        )


# =========================================================================== mismatched collectives
def _w_mismatch(kind: str) -> Any:
    import torch

    from ._common import dist

    r = dist.get_rank()
    started = time.monotonic()
    try:
        if kind == "op":
            t = torch.full((4,), float(r + 1))
            if r == 0:
                dist.broadcast(t, src=0)
            else:
                dist.all_reduce(t)
        elif kind == "size":
            t = torch.ones(4 if r == 0 else 8)
            dist.all_reduce(t)
        elif kind == "dtype_float64":
            t = torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)
            dist.all_reduce(t)
        elif kind == "dtype_int32":
            t = torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32)
            dist.all_reduce(t)
        elif kind == "root":
            t = torch.full((4,), float(r))
            dist.broadcast(t, src=r)  # every rank believes it is the root
        else:
            raise ValueError(kind)
    except Exception as exc:
        return _info(exc, started)
    return {"type": None, "result": t.tolist(), "elapsed": time.monotonic() - started}


@scenario(
    params=[{"kind": k} for k in ("op", "size", "dtype_float64", "dtype_int32", "root")],
    requires=("collective_mismatch",),
    timeout=120,
)
def collective_mismatch(ctx: ScenarioContext, kind: str = "op") -> None:
    """Ranks disagreeing on the collective (broadcast vs all_reduce), the size, the dtype or
    the root all raise, rather than return corrupted data or hang."""
    timeout = 5.0
    with ctx.spawn(2, pg_timeout=timeout) as world:
        outcomes = world.try_run(_w_mismatch, timeout=timeout + 60, kind=kind)
    problems = []
    for r, o in enumerate(outcomes):
        if isinstance(o, RankFailure):
            problems.append(str(o))
        elif o["type"] is None:
            problems.append(f"rank {r} completed the mismatched collective and got {o['result']} instead of an error")
        elif o["elapsed"] > timeout + 10:
            problems.append(f"rank {r} took {o['elapsed']:.1f} s to fail (timeout {timeout} s)")
        elif ctx.strict and "DistBackendError" not in o["mro"]:
            problems.append(f"rank {r} raised {o['type']} ({o['message']}), expected a DistBackendError")
    if problems:
        report = "; ".join(
            f"rank {r}: "
            + (
                _fmt(o)
                if isinstance(o, RankFailure) or o["type"] is None
                else f"{o['type']} after {o['elapsed']:.1f} s: {o['message'][:200]}"
            )
            for r, o in enumerate(outcomes)
        )
        raise AssertionError(f"mismatched collective ({kind}): " + "; ".join(problems) + f"\n  outcomes: {report}")


# =========================================================================== timeouts
def _w_recv_nobody(group_timeout: float) -> Any:
    import torch

    from ._common import dist

    r = dist.get_rank()
    g = dist.new_group([0, 1], timeout=timedelta(seconds=group_timeout))
    result: dict = {}
    if r == 0:
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(2), src=1, group=g)
            result["recv"] = {"type": None, "elapsed": time.monotonic() - started}
        except Exception as exc:
            result["recv"] = _info(exc, started)
    return result


def _w_wait_timeout() -> Any:
    import torch

    from ._common import dist

    r = dist.get_rank()
    result: dict = {}
    if r == 0:
        started = time.monotonic()
        work = dist.irecv(torch.zeros(2), src=1)
        try:
            work.wait(timeout=timedelta(seconds=1))
            result["wait"] = {"type": None, "elapsed": time.monotonic() - started}
        except Exception as exc:
            result["wait"] = _info(exc, started)
    return result


@scenario(timeout=120)
def recv_timeout(ctx: ScenarioContext) -> None:
    """A recv with no sender in a group created with timeout=2 s raises after about 2 s
    (a TimeoutError for tdist); the peer is unaffected."""
    with ctx.spawn(2, pg_timeout=60) as world:
        outcomes = world.try_run(_w_recv_nobody, timeout=60, group_timeout=2.0)
    for r, o in enumerate(outcomes):
        assert not isinstance(o, RankFailure), f"rank {r}: {o}"
    got = outcomes[0]["recv"]
    assert got["type"] is not None, "recv with no sender returned normally"
    assert 1.0 <= got["elapsed"] <= 12.0, f"recv timed out after {got['elapsed']:.1f} s, expected about 2 s"
    if ctx.strict:
        assert "TimeoutError" in got["mro"] and "DistError" in got["mro"], (
            f"recv timeout raised {got['type']} ({got['message']}), expected a DistError that is a TimeoutError"
        )


#: The collectives :func:`collective_timeout` leaves without their last rank.
#: (Each rank's result depends on every rank's input: none may complete without the last rank.)
_TIMED_COLLECTIVES = ("all_reduce", "all_gather", "barrier")


def _w_collectives_without_last(group_timeout: float, set_later: bool = False) -> Any:
    """Every rank but the last issues each of :data:`_TIMED_COLLECTIVES` on its own group
    (created with ``group_timeout``, or with 120 s and then given ``group_timeout`` by
    ``set_timeout`` when ``set_later``); report how each ended."""
    import torch

    from ._common import dist

    r, n = dist.get_rank(), dist.get_world_size()
    created = timedelta(seconds=120 if set_later else group_timeout)
    groups = {op: dist.new_group(list(range(n)), timeout=created) for op in _TIMED_COLLECTIVES}
    if set_later:
        for g in groups.values():
            dist.set_timeout(timedelta(seconds=group_timeout), group=g)
    result: dict = {}
    if r == n - 1:
        return result  # the rank that never arrives
    for op, g in groups.items():
        t = torch.ones(4)
        started = time.monotonic()
        try:
            if op == "all_reduce":
                dist.all_reduce(t, group=g)
            elif op == "all_gather":
                dist.all_gather([torch.zeros(4) for _ in range(n)], t, group=g)
            else:
                dist.barrier(group=g)
            result[op] = {"type": None, "elapsed": time.monotonic() - started}
        except Exception as exc:
            result[op] = _info(exc, started)
    return result


def _names_rank(message: str, rank: int) -> bool:
    """Whether ``message`` names ``rank`` after the word rank ("rank 2", "ranks [0, 2]", "rank(s) 2")."""
    return any(
        str(rank) in re.findall(r"\d+", numbers)
        for numbers in re.findall(r"rank(?:s|\(s\))?\W*((?:\d+\W{0,3})+)", message)
    )


def _timed_outcomes(outcomes: list, n: int, problems: list[str]) -> Iterator[tuple[int, str, dict]]:
    """``(rank, op, outcome)`` of each of :data:`_TIMED_COLLECTIVES` on every rank but the
    last (the one that never arrives); a rank that failed outright goes to ``problems``."""
    for r, o in enumerate(outcomes[: n - 1]):
        if isinstance(o, RankFailure):
            problems.append(f"rank {r}: {o.headline}")
            continue
        for op in _TIMED_COLLECTIVES:
            yield r, op, o[op]


@scenario(requires=("timeout_names_ranks",), timeout=150)
def collective_timeout(ctx: ScenarioContext) -> None:
    """Collectives whose last rank never arrives (all_reduce, all_gather, barrier on
    groups created with timeout=2 s) raise after about 2 s on every rank that issued them; for
    tdist a DistBackendTimeoutError naming the missing rank."""
    group_timeout, n = 2.0, 3
    with ctx.spawn(n, pg_timeout=60) as world:
        outcomes = world.try_run(_w_collectives_without_last, timeout=90, group_timeout=group_timeout)
    problems: list[str] = []
    for r, op, got in _timed_outcomes(outcomes, n, problems):
        if got["type"] is None:
            problems.append(f"rank {r}: {op} without rank {n - 1} returned normally")
        elif got["elapsed"] > group_timeout + 10:
            problems.append(f"rank {r}: {op} raised after {got['elapsed']:.1f} s (group timeout {group_timeout} s)")
        elif ctx.strict and "DistBackendTimeoutError" not in got["mro"]:
            problems.append(
                f"rank {r}: {op} raised {got['type']} ({got['message'][:200]}), expected DistBackendTimeoutError"
            )
        elif ctx.strict and not _names_rank(got["message"], n - 1):
            problems.append(f"rank {r}: {op}'s timeout does not name the missing rank {n - 1}: {got['message'][:300]}")
    assert not problems, "collective timeout: " + "; ".join(problems)


@scenario(tdist_only="set_timeout is torch 2.14's (the reference runs an older torch)", timeout=150)
def set_timeout_applies(ctx: ScenarioContext) -> None:
    """set_timeout(2 s) on groups created with a 120 s timeout: collectives whose last rank
    never arrives raise after about 2 s on every rank that issued them."""
    group_timeout, n = 2.0, 3
    with ctx.spawn(n, pg_timeout=60) as world:
        outcomes = world.try_run(_w_collectives_without_last, timeout=90, group_timeout=group_timeout, set_later=True)
    problems: list[str] = []
    for r, op, got in _timed_outcomes(outcomes, n, problems):
        if got["type"] is None:
            problems.append(f"rank {r}: {op} without rank {n - 1} returned normally")
        elif got["elapsed"] > group_timeout + 30:
            problems.append(f"rank {r}: {op} raised after {got['elapsed']:.1f} s: set_timeout(2 s) did not apply")
    assert not problems, "set_timeout: " + "; ".join(problems)


@scenario(timeout=120)
def work_wait_timeout(ctx: ScenarioContext) -> None:
    """Work.wait(timeout=1 s) on an irecv nobody matches raises after about 1 s."""
    with ctx.spawn(2, pg_timeout=60) as world:
        outcomes = world.try_run(_w_wait_timeout, timeout=60)
    assert not isinstance(outcomes[0], RankFailure), str(outcomes[0])
    got = outcomes[0]["wait"]
    assert got["type"] is not None, "Work.wait(timeout=1 s) on an unmatched irecv returned normally"
    assert got["elapsed"] <= 10.0, f"Work.wait(timeout=1 s) raised after {got['elapsed']:.1f} s"
    if ctx.strict:
        assert "TimeoutError" in got["mro"], f"Work.wait timeout raised {got['type']}: {got['message']}"


# =========================================================================== lifecycle
def _w_before_init() -> dict:
    import torch

    from ._common import dist

    out: dict = {"is_initialized": dist.is_initialized()}
    calls = {
        "get_rank": lambda: dist.get_rank(),
        "get_world_size": lambda: dist.get_world_size(),
        "all_reduce": lambda: dist.all_reduce(torch.ones(1)),
        "barrier": lambda: dist.barrier(),
        "send": lambda: dist.send(torch.ones(1), dst=0),
        "new_group": lambda: dist.new_group([0]),
    }
    for name, call in calls.items():
        started = time.monotonic()
        try:
            call()
            out[name] = {"type": None}
        except Exception as exc:
            out[name] = _info(exc, started)
    return out


@scenario(timeout=60)
def op_before_init(ctx: ScenarioContext) -> None:
    """In a fresh process, is_initialized() is False and every operation raises a clear
    error at once (mentioning init_process_group for tdist)."""
    with ctx.spawn(1, init=False) as world:
        (out,) = world.run(_w_before_init, timeout=30)
    assert out.pop("is_initialized") is False, "is_initialized() is True before init_process_group"
    for name, got in out.items():
        assert got["type"] is not None, f"{name} before init_process_group did not raise"
        assert got["elapsed"] < 5, f"{name} before init took {got['elapsed']:.1f} s to raise"
        if ctx.strict:
            assert "ValueError" in got["mro"] or "DistError" in got["mro"], f"{name}: {got['type']}: {got['message']}"
            assert "init_process_group" in got["message"], f"{name}: message does not say what to do: {got['message']}"


def _w_reinit(backend: str, init_method: str) -> float:
    import torch

    from ._common import dist

    r, n = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    assert not dist.is_initialized(), "is_initialized() still True after destroy_process_group()"
    dist.init_process_group(backend, init_method=init_method, rank=r, world_size=n, timeout=timedelta(seconds=30))
    t = torch.ones(2) * (r + 1)
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 2, f"all_reduce after re-init gave {t.tolist()}"
    return t[0].item()


@scenario(timeout=120)
def destroy_and_reinit(ctx: ScenarioContext) -> None:
    """destroy_process_group() then init_process_group() again (tcp:// this time) works."""
    with ctx.spawn(2) as world:
        port = free_port()
        world.run(_w_reinit, timeout=60, backend=ctx.backend, init_method=f"tcp://127.0.0.1:{port}")


def _w_all_reduce_check() -> int:
    from ._common import dist
    from .helpers import check_world_works

    check_world_works("init")
    return dist.get_rank()


@scenario(params=[{"scheme": s} for s in ("tcp", "file")], timeout=120)
def init_methods(ctx: ScenarioContext, scheme: str = "tcp") -> None:
    """init_method="tcp://host:port" and "file:///path" (with rank= and world_size=) rendezvous."""
    if scheme == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
        tmp = None
    else:
        tmp = tempfile.mkdtemp(prefix="tdist-file-init-")
        method = "file://" + os.path.join(tmp, "rendezvous")
    try:
        with ctx.spawn(2, init_method=method) as world:
            assert world.run(_w_all_reduce_check) == [0, 1]
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


# =========================================================================== monitored_barrier
def _w_monitored_barrier_without(missing: int) -> Any:
    from ._common import dist

    r = dist.get_rank()
    if r == missing:
        time.sleep(4.0)
        return {"type": "skipped"}
    started = time.monotonic()
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2))
    except Exception as exc:
        return _info(exc, started)
    return {"type": None, "elapsed": time.monotonic() - started}


@scenario(requires=("monitored_barrier",), timeout=120)
def monitored_barrier_names_missing_rank(ctx: ScenarioContext) -> None:
    """monitored_barrier(timeout=2 s) with one rank absent: rank 0 raises, naming that rank."""
    n = 3
    with ctx.spawn(n, pg_timeout=30) as world:
        outcomes = world.try_run(_w_monitored_barrier_without, timeout=60, missing=n - 1)
    o = outcomes[0]
    assert not isinstance(o, RankFailure), str(o)
    assert o["type"] is not None, "monitored_barrier passed although a rank never arrived"
    assert o["elapsed"] <= 12.0, f"monitored_barrier raised after {o['elapsed']:.1f} s (timeout 2 s)"
    assert re.search(rf"\b{n - 1}\b", o["message"]), f"error does not name rank {n - 1}: {o['message']}"
