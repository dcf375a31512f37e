"""Bodies of test_tcp_shrink.py, run on every rank of a :class:`tdist.testing.World` (a real
process per rank, the default group built by ``init_process_group("tcp")``): a rank is
lost (it SIGKILLs itself), the others shrink the default group and report what the new
group's backend holds (connections, listeners, shared segments, by their inode) and
what its collectives and point-to-point operations gave."""

from __future__ import annotations

import os
import signal
import time

import torch

import tdist as dist


# ------------------------------------------------------------------ introspection
def _inode(obj) -> int:
    return os.fstat(obj.fileno()).st_ino


def segments() -> list[str]:
    """The tcp shared segments this process maps (their memfd names)."""
    names = set()
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:tdist-tcp-" in line:
                names.add(line.split("memfd:", 1)[1].split()[0])
    return sorted(names)


def snapshot() -> dict:
    """What the default group's tcp backend holds: its epoch, its links by peer (socket
    inodes), its listeners and this process's shared segments."""
    from tdist._groups import resolve_group

    backend = resolve_group(None).backends["cpu"]
    tr = backend._tr  # test introspection
    links = {p.rank: [_inode(link.sock) for link in p.links] for p in tr.peers if p is not None and p.links}
    listeners = [_inode(s) for s in tr.mesh.acceptor.listeners] if tr.mesh is not None else []
    return {
        "rank": dist.get_rank(),
        "size": dist.get_world_size(),
        "epoch": tr.epoch,
        "links": links,
        "kinds": sorted({type(link.sock).__name__ for p in tr.peers if p is not None for link in p.links}),
        "listeners": listeners,
        "segments": segments(),
        "uses_shm": backend.uses_shm,
        "hosts": backend.hosts,
        "factory_keys": _factory_keys(),
    }


def _backend_of(group):
    from tdist._groups import resolve_group

    return resolve_group(group).backends["cpu"]


def _factory_keys() -> bool:
    """Whether the factory published this group's setup (rank 0's answer) in the store (it
    does for a group it builds; a group made from the old one's connections needs none)."""
    from tdist._groups import STATE, resolve_group
    from tdist_tcp.net.roster import SETUP_KEY

    name = resolve_group(None).name  # (the group's own name, not torch's mirror's)
    return bool(dist.PrefixStore("tcp", dist.PrefixStore(name, STATE.store)).check([SETUP_KEY]))


# ------------------------------------------------------------------ operations
def exercise() -> dict:
    """Collectives (small and large: one step and the multi-round algorithms) and
    point-to-point (a ring, any-source receives) on the default group; what each gave."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.full((5,), float(r + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist() == [n * (n + 1) / 2] * 5
    big = torch.arange(70001, dtype=torch.float64) * (r + 1)
    dist.all_reduce(big)
    out["all_reduce_big"] = torch.equal(big, torch.arange(70001, dtype=torch.float64) * (n * (n + 1) / 2))
    b = torch.full((100,), float(r))
    dist.broadcast(b, src=n - 1)
    out["broadcast"] = bool(torch.all(b == n - 1))
    gathered = [torch.zeros(3) for _ in range(n)]
    dist.all_gather(gathered, torch.full((3,), float(r)))
    out["all_gather"] = [g[0].item() for g in gathered] == [float(q) for q in range(n)]
    dist.barrier()
    got = torch.zeros(4)
    sent = dist.isend(torch.full((4,), float(r)), (r + 1) % n, tag=3)
    dist.recv(got, (r - 1) % n, tag=3)
    sent.wait()
    out["ring"] = got.tolist() == [float((r - 1) % n)] * 4
    if r == 0:
        senders = set()
        for _ in range(n - 1):
            buf = torch.zeros(2)
            senders.add(dist.recv(buf, tag=7))
            assert buf.tolist() == [float(buf[0])] * 2
        out["any_source"] = senders == set(range(1, n))
    else:
        dist.send(torch.full((2,), float(r)), 0, tag=7)
        out["any_source"] = True
    dist.barrier()
    return out


def _lose(rank_to_lose: int) -> dict:
    """The group's ``rank_to_lose`` SIGKILLs itself; the others find out, shrink and report."""
    r = dist.get_rank()
    dist.barrier()
    if r == rank_to_lose:
        os.kill(os.getpid(), signal.SIGKILL)
    before = snapshot()
    try:
        dist.all_reduce(torch.ones(3))
        raise AssertionError("the all_reduce completed without the lost rank")
    except dist.DistRankFailureError as exc:
        failed = list(exc.failed_ranks)
        if failed != [rank_to_lose]:
            raise AssertionError(f"rank {r} lost rank {rank_to_lose}, but the survivors agreed on {failed}") from exc
    started = time.monotonic()
    dist.shrink_group(failed)
    shrink_s = time.monotonic() - started
    after = snapshot()
    results = exercise()
    return {
        "failed": failed,
        "before": before,
        "after": after,
        "shrink_s": shrink_s,
        "results": results,
        "after_ops": snapshot(),
    }


def shrink_rounds(losses: list[int], warm_up: bool = True) -> list[dict]:
    """One :func:`_lose` per entry of ``losses`` (a rank of the group at that time), after
    a round of every operation (``warm_up``: every pair of ranks then has its connection);
    the lost rank itself never returns."""
    if warm_up:
        exercise()
    return [_lose(rank) for rank in losses]


# ------------------------------------------------------------------ stale frames
def stale_broadcast() -> dict:
    """Rank 0 starts a broadcast (its frames, or its shared-memory step, carry 10s) that
    rank 1 never joins; rank 2 dies; the survivors shrink and, after as many barriers as the
    old group had collectives before it, broadcast 5s from rank 0: the same sequence number,
    shape and sender as the old broadcast. Rank 1 must get 5s, never the old group's 10s."""
    r = dist.get_rank()
    dist.barrier()
    if r == 2:
        time.sleep(1.5)  # rank 0's frames (sent to rank 2, then rank 1) are out by now
        os.kill(os.getpid(), signal.SIGKILL)
    issued = dist.group.WORLD.backends["cpu"]._seq  # collectives so far (the same on every rank)
    try:
        if r == 0:  # collective #issued + 1 of the old group: the new group's broadcast gets that number too
            dist.broadcast(torch.full((64,), 10.0), src=0)
        else:
            dist.recv(torch.zeros(1), src=2)  # fails when rank 2 dies
        raise AssertionError("rank 2's death went unnoticed")
    except dist.DistRankFailureError as exc:
        failed = list(exc.failed_ranks)
    dist.shrink_group(failed)
    for _ in range(issued):
        dist.barrier()
    t = torch.full((64,), 5.0 if r == 0 else -1.0)
    dist.broadcast(t, src=0)
    u = torch.full((3,), float(r + 1))
    dist.all_reduce(u)
    return {
        "failed": failed,
        "broadcast": t.tolist() == [5.0] * 64,
        "all_reduce": u.tolist() == [3.0] * 3,
        "epoch": snapshot()["epoch"],
    }


# ------------------------------------------------------------------ excluded while alive
def exclude_live_rank() -> dict:
    """Ranks 0 and 1 exclude rank 2, which is alive and waiting in a receive from rank 0
    on the old group: its receive fails (its connections are closed), and a pending receive
    of rank 0 on the old group fails at once (SHRINK_ABORT); the survivors go on."""
    r = dist.get_rank()
    dist.barrier()
    if r == 2:
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(2), src=0, tag=1)
            return {"rank": r, "error": None}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"rank": r, "error": f"{type(exc).__name__}: {exc}", "elapsed": time.monotonic() - started}
    pending = dist.irecv(torch.zeros(2), src=1 - r, tag=9) if r == 0 else None  # never sent
    time.sleep(0.5)
    dist.shrink_group([2], shrink_flags=dist.SHRINK_ABORT)
    pending_error = None
    if pending is not None:
        try:
            pending.wait()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            pending_error = type(exc).__name__
    u = torch.full((3,), float(r + 1))
    dist.all_reduce(u)
    snap = snapshot()
    return {
        "rank": r,
        "all_reduce": u.tolist() == [3.0] * 3,
        "pending_error": pending_error,
        "epoch": snap["epoch"],
        "peers": sorted(snap["links"]),
    }


def exclude_and_exercise() -> dict:
    """Ranks 1 and 2 shrink a subgroup [1, 2, 3] without 3 (the shrunken subgroup keeps its
    own options, and so its connections); then ranks 0-2 exclude rank 3 (alive: it waits,
    then leaves) from the default group and use it twice."""
    from tdist._groups import resolve_group

    r = dist.get_rank()
    # a subgroup shrinks too (its own connections): ranks 1 and 2 drop 3
    sub = dist.new_group([1, 2, 3], pg_options={"streams": 2})
    dist.barrier()
    if r == 3:
        time.sleep(3.0)
        return {"excluded": True}
    if r in (1, 2):
        pair = dist.shrink_group([2], group=sub)
        u = torch.full((2,), float(r))
        dist.all_reduce(u, group=pair)
        kept = resolve_group(pair).options == {"streams": 2}
        sub_ok = u.tolist() == [3.0, 3.0] and _backend_of(pair)._tr.epoch == 1 and kept
    before = snapshot()
    dist.shrink_group([3])
    after = snapshot()
    results = exercise()
    if r in (1, 2):
        results["subgroup"] = sub_ok
    done = snapshot()
    again = exercise()
    return {"before": before, "after": after, "results": results, "done": done, "again": again, "twice": snapshot()}


# ------------------------------------------------------------------ abort, then shrink
def abort_then_shrink() -> dict:
    """Rank 0 aborts a group of all four ranks (its connections are released), then the
    three survivors shrink it without the lost rank 3: they all build it anew (epoch 0),
    which works."""
    from tdist._groups import resolve_group

    r = dist.get_rank()
    group = dist.new_group([0, 1, 2, 3])
    dist.barrier(group=group)
    if r == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if r == 0:  # tdist's group (torch's handle would also destroy it, leaving nothing to shrink)
        time.sleep(0.5)
        resolve_group(group).abort()
    try:
        dist.all_reduce(torch.ones(2), group=group)
    except Exception:  # noqa: BLE001 - aborted or failed: either way the group is done
        pass
    new = dist.shrink_group([3], group=group)
    u = torch.full((3,), float(r + 1))
    dist.all_reduce(u, group=new)
    return {"all_reduce": u.tolist() == [6.0] * 3, "epoch": resolve_group(new).backends["cpu"]._tr.epoch}
