"""Conformance bodies for the "musts" of the backend contract that correct results alone
do not show (a backend can compute every value right and still break them):

- ``async_op=True`` collectives and ``isend``/``irecv`` return before the peers arrive;
- results are bit-identical on every rank, also where the summation order matters;
- a send's buffer may be reused as soon as its Work has completed;
- a receive into a buffer of the wrong size fails instead of truncating or padding;
- any-source receives complete in arrival order and name their sender;
- ``is_completed()`` is True only once the output holds the result;
- operations still pending when their group is destroyed fail (they never hang);
- several threads issuing point-to-point and collectives on different groups at once.

Each body says which must it checks in its assertion messages, so a broken backend's
report names the violation.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ._registry import body
from .helpers import assert_tensor, assert_true, cached_group, dist, raises

__all__ = [
    "async_returns_at_once",
    "results_bit_identical",
    "send_buffer_reusable",
    "recv_wrong_size_fails",
    "recv_wrong_dtype_fails",
    "any_source_arrival_order",
    "is_completed_means_done",
    "pending_fail_at_destroy",
    "concurrent_threads",
]

#: Seconds the late ranks wait before joining: a call that must not block returns well before.
PEER_DELAY = 1.5
#: Seconds a Work whose peers have all joined may take to complete without wait().
COMPLETION_LIMIT = 10.0
#: Seconds a peer waits before joining an operation whose is_completed() is being watched.
LATE = 0.3


def _torch() -> Any:
    import torch

    return torch


@body(min_world_size=2, timeout=60)
def async_returns_at_once():
    """async_op=True collectives, isend and irecv return before the peers arrive."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if r == 0:
        big = torch.full((1 << 20,), 3.0)  # 4 MiB: more than any socket buffer holds
        t, b, x = torch.ones(8), torch.zeros(8), torch.zeros(8)
        start = time.monotonic()
        works = [
            dist.isend(big, dst=1),
            dist.all_reduce(t, async_op=True),
            dist.broadcast(b, src=1, async_op=True),
            dist.irecv(x, src=1),
        ]
        took = time.monotonic() - start
        assert_true(
            took < PEER_DELAY / 2,
            f"async calls blocked the caller: they took {took:.2f} s while the peers joined only after "
            f"{PEER_DELAY} s (async_op=True and isend/irecv must return before the peers arrive)",
        )
        for w in works:
            w.wait()
        assert_tensor(t, torch.full((8,), float(n)), "async all_reduce")
        assert_tensor(b, torch.full((8,), 1.0), "async broadcast")
        assert_tensor(x, torch.full((8,), 5.0), "irecv")
    else:
        time.sleep(PEER_DELAY)
        t, b = torch.ones(8), torch.full((8,), float(r == 1))
        dist.all_reduce(t)
        dist.broadcast(b, src=1)
        if r == 1:
            dist.send(torch.full((8,), 5.0), dst=0)
            big = torch.zeros(1 << 20)
            dist.recv(big, src=0)
            assert_tensor(big, torch.full((1 << 20,), 3.0), "isend of 4 MiB")
    dist.barrier()


def _order_sensitive(rank: int, numel: int) -> Any:
    """float32 values over 12 orders of magnitude, different on every rank: their sum
    depends on the order it is computed in."""
    torch = _torch()
    g = torch.Generator().manual_seed(1000 + rank)
    scale = 10.0 ** torch.randint(-6, 7, (numel,), generator=g).double()
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).float()


def _same_bits_everywhere(result: Any, what: str) -> None:
    """Gather every rank's ``result`` bit pattern and compare them."""
    torch = _torch()
    n = dist.get_world_size()
    bits = result.contiguous().view(torch.int32)
    everyone = torch.empty(n * bits.numel(), dtype=torch.int32)
    dist.all_gather_into_tensor(everyone, bits)
    mine = everyone.view(n, -1)[dist.get_rank()]
    differ = [q for q, theirs in enumerate(everyone.view(n, -1)) if not torch.equal(theirs, mine)]
    assert_true(
        not differ,
        f"{what}: results are not bit-identical on every rank (ranks {differ} differ from this one); "
        "every rank must reduce in the same order",
    )


@body(min_world_size=2, timeout=120, params=[{"numel": 1023}, {"numel": 600_001}], ids=["small", "large"])
def results_bit_identical(numel: int = 1023):
    """all_reduce (SUM, MAX) and reduce + broadcast give bit-identical results on every rank."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    mine = _order_sensitive(r, numel)
    inputs = torch.stack([_order_sensitive(q, numel).double() for q in range(n)])
    t = mine.clone()
    dist.all_reduce(t)
    off = int(((t.double() - inputs.sum(0)).abs() > 1e-5 * inputs.abs().sum(0)).sum())
    assert_true(off == 0, f"all_reduce of order-sensitive values: {off} of {numel} sums are wrong")
    _same_bits_everywhere(t, "all_reduce SUM")
    t = mine.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _same_bits_everywhere(t, "all_reduce MAX")
    t = mine.clone()
    dist.reduce(t, dst=0)
    dist.broadcast(t, src=0)
    _same_bits_everywhere(t, "reduce then broadcast")
    t = mine.clone()
    dist.reduce_scatter_tensor(torch.empty(numel // n), t[: numel // n * n].clone())  # keeps the sequence aligned


@body(min_world_size=2, timeout=60)
def send_buffer_reusable():
    """A send's tensor may be overwritten once send() returns or its Work completed."""
    torch = _torch()
    r = dist.get_rank()
    numel = 1 << 20  # 4 MiB: still in flight when the sender's Work completes too early
    if r == 0:
        t = torch.full((numel,), 7.0)
        w = dist.isend(t, dst=1)
        w.wait()
        t.fill_(-1.0)
        u = torch.full((numel,), 8.0)
        dist.send(u, dst=1)
        u.fill_(-1.0)
    elif r == 1:
        time.sleep(0.5)  # the sender overwrites its buffers before this rank receives
        for expected in (7.0, 8.0):
            got = torch.zeros(numel)
            dist.recv(got, src=0)
            bad = int((got != expected).sum())
            assert_true(
                bad == 0,
                f"{bad} of {numel} received values differ from what was sent ({expected}): the send "
                "completed before its buffer could be reused",
            )
    dist.barrier()


@body(min_world_size=2, timeout=60, requires=("p2p_size_check",), fatal_when_unsupported=True)
def recv_wrong_size_fails():
    """recv into a buffer smaller or larger than the message raises instead of truncating or padding."""
    torch = _torch()
    for numel in (4, 16):  # the message has 8 elements
        _recv_must_refuse(torch.ones(8), torch.zeros(numel), f"recv of an 8-element message into {numel} elements")


@body(min_world_size=2, timeout=60, requires=("p2p_dtype_check",))
def recv_wrong_dtype_fails():
    """recv into a buffer of another dtype with the message's byte size (int32 into float32)
    raises instead of reinterpreting the bytes."""
    torch = _torch()
    _recv_must_refuse(
        torch.ones(8, dtype=torch.int32),
        torch.zeros(8),
        "recv of an int32 message into a float32 buffer of the same byte size",
    )


def _recv_must_refuse(message: Any, buffer: Any, what: str) -> None:
    """Rank 0 sends ``message`` to rank 1, whose recv into ``buffer`` must raise; on a pair
    group of its own (the failure may break it), destroyed afterwards."""
    r = dist.get_rank()
    pair = cached_group([0, 1])
    if r == 0:
        w = dist.isend(message, dst=1, group=pair)
    elif r == 1:
        with raises(Exception, what=what):
            dist.recv(buffer, src=0, group=pair)
    dist.barrier()
    if r == 0:
        try:
            w.wait(timeout=_seconds(5))
        except Exception:
            pass  # the sender may see the receiver's refusal
    _forget(pair, [0, 1])


def _seconds(s: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=s)


def _forget(group: Any, members: list[int]) -> None:
    """Destroy a group made with :func:`cached_group` (on its ``members``) and let the next
    call make a new one."""
    from . import helpers

    # by key: a non-member's handle is one shared object, the same for every group it is not in
    helpers._GROUPS.pop((tuple(sorted(members)), None), None)
    if dist.get_rank() in members:
        dist.destroy_process_group(group)


@body(min_world_size=3, requires=("recv_anysource",), timeout=60)
def any_source_arrival_order():
    """Any-source receives complete in the order the messages arrived, each naming its sender."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        bufs = [torch.zeros(2) for _ in range(n - 1)]
        works = [dist.irecv(b) for b in bufs]  # posted before anything arrives
        for w in works:
            w.wait()
        sources = [_source(w) for w in works]
        assert_true(
            sources == list(range(1, n)),
            f"any-source receives completed with senders {sources}; the messages arrived from "
            f"{list(range(1, n))} in that order (each receive takes the next message to arrive)",
        )
        for k, b in enumerate(bufs):
            assert_tensor(b, torch.full((2,), float(k + 1)), f"any-source receive #{k}")
    else:
        time.sleep(0.4 * r)  # rank 1 first, then 2, ...
        dist.send(torch.full((2,), float(r)), dst=0)
    dist.barrier()


def _source(work: Any) -> Any:
    getter = getattr(work, "source_rank", None) or getattr(work, "_source_rank", None)
    return getter() if getter is not None else None


@body(min_world_size=2, timeout=60)
def is_completed_means_done():
    """Once is_completed() is True the output holds the result (before any wait());
    a Work whose peers finished completes without being waited on. The peers of the
    rank that checks join late, so that an early "completed" cannot go unnoticed."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    numel = 1 << 19
    t = torch.full((numel,), float(r))
    if r != 0:
        time.sleep(LATE)
    w = dist.all_reduce(t, async_op=True)
    deadline = time.monotonic() + COMPLETION_LIMIT
    while not w.is_completed():
        assert_true(
            time.monotonic() < deadline,
            f"an all_reduce never reported completion without wait() ({COMPLETION_LIMIT:g} s)",
        )
        time.sleep(0.001)
    expected = float(n * (n - 1) / 2)
    bad = int((t != expected).sum())
    assert_true(bad == 0, f"is_completed() was True while {bad} of {numel} outputs did not hold the result yet")
    w.wait()
    if r == 1:
        got = torch.zeros(numel)
        w = dist.irecv(got, src=0)
        deadline = time.monotonic() + COMPLETION_LIMIT
        while not w.is_completed():
            assert_true(
                time.monotonic() < deadline,
                f"an irecv never reported completion without wait() ({COMPLETION_LIMIT:g} s)",
            )
            time.sleep(0.001)
        bad = int((got != 4.0).sum())
        assert_true(bad == 0, f"irecv's is_completed() was True while {bad} of {numel} values had not arrived")
    elif r == 0:
        time.sleep(LATE)
        dist.send(torch.full((numel,), 4.0), dst=1)
    dist.barrier()


@body(min_world_size=2, timeout=60)
def pending_fail_at_destroy():
    """A receive still pending when its group is destroyed fails (it does not hang)."""
    torch = _torch()
    r = dist.get_rank()
    pair = cached_group([0, 1])
    w = dist.irecv(torch.zeros(4), src=1, group=pair) if r == 0 else None
    dist.barrier()  # rank 1 never sends
    _forget(pair, [0, 1])
    if w is not None:
        deadline = time.monotonic() + 10
        while not w.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_true(w.is_completed(), "a receive pending when its group was destroyed was still pending 10 s later")
        with raises(Exception, what="wait() on a receive whose group was destroyed before a message came"):
            w.wait()
    dist.barrier()


@body(min_world_size=2, requires=("p2p_tags",), timeout=120)
def concurrent_threads():
    """Threads issuing tagged sends/receives (small, large, batched) and collectives on
    another group at the same time, while the main thread runs collectives on the world."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    pair = cached_group([0, 1])
    errors: list[BaseException] = []

    def guarded(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    def small(tag: int) -> None:
        for k in range(20):
            if r == 0:
                dist.send(torch.full((3,), float(tag * 100 + k)), dst=1, tag=tag)
            else:
                got = torch.zeros(3)
                dist.recv(got, src=0, tag=tag)
                assert_tensor(got, torch.full((3,), float(tag * 100 + k)), f"tag {tag} message {k}")

    def large() -> None:
        for k in range(3):
            if r == 0:
                dist.send(torch.full((1 << 18,), float(k)), dst=1, tag=9)
            else:
                got = torch.zeros(1 << 18)
                dist.recv(got, src=0, tag=9)
                assert_tensor(got, torch.full((1 << 18,), float(k)), f"large tagged message {k}")

    def batched(tag: int) -> None:
        for k in range(5):
            t = torch.full((4,), float(k)) if r == 0 else torch.zeros(4)
            op = dist.P2POp(dist.isend, t, 1, tag=tag) if r == 0 else dist.P2POp(dist.irecv, t, 0, tag=tag)
            for w in dist.batch_isend_irecv([op]):
                w.wait()
            if r == 1:
                assert_tensor(t, torch.full((4,), float(k)), f"batched tag {tag} message {k}")

    def pair_collectives() -> None:
        for k in range(10):
            t = torch.full((5,), float(r + k))
            dist.all_reduce(t, group=pair)
            assert_tensor(t, torch.full((5,), float(1 + 2 * k)), f"all_reduce #{k} on the pair's group")

    threads = []
    if r in (0, 1):
        jobs = [lambda: small(1), lambda: small(2), large, lambda: batched(5), lambda: batched(6), pair_collectives]
        threads = [threading.Thread(target=guarded(job), daemon=True) for job in jobs]
        for th in threads:
            th.start()
    try:
        for k in range(10):
            t = torch.full((7,), float(k))
            dist.all_reduce(t)
            assert_tensor(t, torch.full((7,), float(n * k)), f"world all_reduce #{k} during the threads' traffic")
    except Exception as exc:
        raise AssertionError(f"rank {r}: concurrent operations failed: the main thread's {exc!r}") from exc
    for th in threads:
        th.join(90)
        assert_true(not th.is_alive(), "a thread issuing operations concurrently never finished (hang)")
    if errors:
        raise AssertionError(f"rank {r}: concurrent operations failed: {errors[0]!r}") from errors[0]
    dist.barrier()
