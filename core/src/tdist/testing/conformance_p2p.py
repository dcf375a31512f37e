"""Conformance bodies: rank/size/backend queries and point-to-point communication.

Every body runs on every rank of the world and asserts values computed from
the rank and world size (see :func:`tdist.testing.helpers.value`).
"""

from __future__ import annotations

import os

from ._registry import body
from .helpers import (
    assert_equal,
    assert_tensor,
    assert_true,
    backend_name,
    dist,
    expected_world_size,
    value,
)

__all__ = [
    "queries",
    "send_recv_blocking",
    "send_recv_dtypes",
    "isend_irecv_all_pairs",
    "recv_any_source",
    "message_order",
    "p2p_tags",
    "p2p_large",
    "batch_isend_irecv_ring",
    "p2p_noncontiguous",
]


def _torch():
    import torch

    return torch


def _pairs(n: int) -> list[tuple[int, int]]:
    """Every (i, j) with i < j, in the same order on every rank (safe with synchronous sends)."""
    return [(i, j) for i in range(n) for j in range(i + 1, n)]


def _check_queries_result(results: list, world_size: int, **_: object) -> None:
    assert results == list(range(world_size)), f"ranks reported {results}, expected {list(range(world_size))}"


@body(check=_check_queries_result)
def queries():
    """is_initialized, get_rank/get_world_size/get_backend, group.WORLD rank translation."""
    n = expected_world_size()
    r = dist.get_rank()
    assert_true(dist.is_available(), "is_available() is False")
    assert_true(dist.is_initialized(), "is_initialized() is False after init_process_group")
    assert_equal(dist.get_world_size(), n, "get_world_size()")
    assert_equal(r, int(os.environ["RANK"]), "get_rank() (vs the rank this worker was started as)")
    world = dist.group.WORLD
    assert_true(world is not None, "group.WORLD is None after init_process_group")
    assert_equal(str(dist.get_backend()).lower(), backend_name().lower(), "get_backend()")
    assert_equal(str(dist.get_backend(world)).lower(), backend_name().lower(), "get_backend(group.WORLD)")
    assert_equal(dist.get_rank(world), r, "get_rank(group.WORLD)")
    assert_equal(dist.get_rank(group=None), r, "get_rank(group=None)")
    assert_equal(dist.get_world_size(world), n, "get_world_size(group.WORLD)")
    assert_equal(list(dist.get_process_group_ranks(world)), list(range(n)), "get_process_group_ranks(WORLD)")
    for i in range(n):
        assert_equal(dist.get_global_rank(world, i), i, f"get_global_rank(WORLD, {i})")
        assert_equal(dist.get_group_rank(world, i), i, f"get_group_rank(WORLD, {i})")
    return r


@body(min_world_size=2)
def send_recv_blocking():
    """Blocking send/recv between every pair, both directions; recv returns the sender."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    for i, j in _pairs(n):
        if r == i:
            dist.send(value(i, 5, salt=j), dst=j)
            t = torch.zeros(5)
            got = dist.recv(t, src=j)
            assert_tensor(t, value(j, 5, salt=i), f"recv from {j}")
            assert_true(got == j, f"recv(src={j}) returned {got!r}, expected {j}")
        elif r == j:
            t = torch.zeros(5)
            got = dist.recv(tensor=t, src=i)
            assert_tensor(t, value(i, 5, salt=j), f"recv from {i}")
            assert_true(got == i, f"recv(src={i}) returned {got!r}, expected {i}")
            dist.send(tensor=value(j, 5, salt=i), dst=i)


_P2P_CASES = [
    ("float32", (7,)),
    ("float64", (2, 3)),
    ("int32", (4,)),
    ("int64", (3, 1, 2)),
    ("float16", (5,)),
    ("bfloat16", (5,)),
    ("bool", (6,)),
    ("complex64", (3,)),
    ("uint8", (9,)),
    ("float32", ()),  # 0-dim
    ("float32", (0,)),  # empty
    ("int64", (1023,)),
]


@body(min_world_size=2)
def send_recv_dtypes():
    """Every dtype, 0-dim and empty tensors and odd sizes travel intact between ranks 0 and 1."""
    torch = _torch()
    r = dist.get_rank()
    for k, (dtype, shape) in enumerate(_P2P_CASES):
        if dtype == "complex64":
            src = torch.complex(value(0, *shape, salt=k), -value(0, *shape, salt=k + 1))
        else:
            src = value(0, *shape, dtype=dtype, salt=k)
        if r == 0:
            dist.send(src, dst=1)
        elif r == 1:
            t = torch.zeros_like(src)
            dist.recv(t, src=0)
            assert_tensor(t, src, f"{dtype}{list(shape)} from rank 0")


@body(min_world_size=2)
def isend_irecv_all_pairs():
    """isend/irecv with every peer at once; Work.wait then is_completed()."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    inbox = {p: torch.zeros(4, 3) for p in range(n) if p != r}
    works = []
    for p in range(n):
        if p == r:
            continue
        works.append(dist.irecv(inbox[p], src=p))
        works.append(dist.isend(value(r, 4, 3, salt=p), dst=p))
    for w in works:
        assert_true(w is not None, "isend/irecv returned None instead of a Work")
        w.wait()
        assert_true(w.is_completed(), "is_completed() is False after wait()")
    for p, t in inbox.items():
        assert_tensor(t, value(p, 4, 3, salt=r), f"irecv from {p}")


@body(min_world_size=2, requires=("recv_anysource",))
def recv_any_source():
    """recv(src=None) receives from any rank and returns the sender, for every peer."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    if r == 0:
        seen = []
        for _ in range(n - 1):
            t = torch.zeros(3)
            sender = dist.recv(t)
            assert_true(isinstance(sender, int) and 1 <= sender < n, f"recv(src=None) returned {sender!r}")
            assert_tensor(t, value(sender, 3), f"message said to come from {sender}")
            seen.append(sender)
        assert_true(sorted(seen) == list(range(1, n)), f"senders {seen}, expected each of 1..{n - 1} once")
    else:
        dist.send(value(r, 3), dst=0)
    dist.barrier()
    # irecv without a source, too (after the barrier, so only rank n-1's message is in flight)
    if r == 0:
        t = torch.zeros(3)
        w = dist.irecv(t)
        w.wait()
        assert_tensor(t, value(n - 1, 3, salt=9), "irecv(src=None)")
    elif r == n - 1:
        dist.send(value(r, 3, salt=9), dst=0)
    dist.barrier()


@body(min_world_size=2)
def message_order():
    """50 messages between a pair arrive in the order sent (non-overtaking), with
    varying sizes, isend+wait-at-end on the sender, recv/irecv mixed on the receiver."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    count = 50
    sizes = [1 + (k * 7) % 13 for k in range(count)]
    if r % 2 == 0 and r + 1 < n:
        peer = r + 1
        works = [dist.isend(torch.full((sizes[k],), float(k)), dst=peer) for k in range(count)]
        for w in works:
            w.wait()
    elif r % 2 == 1:
        peer = r - 1
        bufs = [torch.full((sizes[k],), -1.0) for k in range(count)]
        pending = []
        for k in range(count):
            if k % 2 == 0:
                dist.recv(bufs[k], src=peer)
            else:
                pending.append(dist.irecv(bufs[k], src=peer))
        for w in pending:
            w.wait()
        for k in range(count):
            assert_tensor(bufs[k], torch.full((sizes[k],), float(k)), f"message #{k} from {peer}")


@body(min_world_size=2, requires=("p2p_tags",))
def p2p_tags():
    """A recv for tag B completes with the tag-B message even though tag A was sent first."""
    torch = _torch()
    r = dist.get_rank()
    if r == 0:
        wa = dist.isend(torch.full((4,), 7.0), dst=1, tag=7)
        wb = dist.isend(torch.full((2,), 3.0), dst=1, tag=3)
        wa.wait()
        wb.wait()
        dist.send(torch.full((3,), 11.0), dst=1, tag=11)
    elif r == 1:
        b = torch.zeros(2)
        dist.recv(b, src=0, tag=3)
        assert_tensor(b, torch.full((2,), 3.0), "tag 3")
        a = torch.zeros(4)
        dist.recv(a, src=0, tag=7)
        assert_tensor(a, torch.full((4,), 7.0), "tag 7")
        c = torch.zeros(3)
        w = dist.irecv(c, src=0, tag=11)
        w.wait()
        assert_tensor(c, torch.full((3,), 11.0), "tag 11 via irecv")
    dist.barrier()


@body(min_world_size=2, timeout=120)
def p2p_large():
    """4 Mi float32 elements each way between ranks 0 and 1, exchanged with isend/irecv."""
    torch = _torch()
    r = dist.get_rank()
    numel = 4 * 1024 * 1024
    if r in (0, 1):
        peer = 1 - r
        mine = torch.arange(numel, dtype=torch.float32) * (r + 1)
        got = torch.zeros(numel)
        wr = dist.irecv(got, src=peer)
        ws = dist.isend(mine, dst=peer)
        ws.wait()
        wr.wait()
        expected = torch.arange(numel, dtype=torch.float32) * (peer + 1)
        assert_tensor(got, expected, f"4 Mi elements from {peer}")


@body(min_world_size=2)
def batch_isend_irecv_ring():
    """batch_isend_irecv with P2POp: a ring, send right and receive from the left."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    right, left = (r + 1) % n, (r - 1) % n
    send_t = value(r, 6)
    recv_t = torch.zeros(6)
    ops = [dist.P2POp(dist.isend, send_t, right), dist.P2POp(dist.irecv, recv_t, left)]
    reqs = dist.batch_isend_irecv(ops)
    assert_true(len(reqs) >= 1, "batch_isend_irecv returned no requests")
    for req in reqs:
        req.wait()
    assert_tensor(recv_t, value(left, 6), f"ring message from {left}")
    # a second round in the other direction, with two messages per peer
    a, b = torch.zeros(2), torch.zeros(5)
    ops = [
        dist.P2POp(dist.irecv, a, right),
        dist.P2POp(dist.irecv, b, right),
        dist.P2POp(dist.isend, value(r, 2, salt=1), left),
        dist.P2POp(dist.isend, value(r, 5, salt=2), left),
    ]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert_tensor(a, value(right, 2, salt=1), f"first message from {right}")
    assert_tensor(b, value(right, 5, salt=2), f"second message from {right}")


@body(
    min_world_size=2,
    reference_xfail="torch gloo rejects non-contiguous tensors in send/recv",
)
def p2p_noncontiguous():
    """Sending a strided view sends the view's elements; receiving into one fills only the view."""
    torch = _torch()
    r = dist.get_rank()
    if r == 0:
        base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
        dist.send(base[:, ::2], dst=1)
        dist.send(base.t(), dst=1)
    elif r == 1:
        target = torch.full((4, 6), -1.0)
        dist.recv(target[:, 1::2], src=0)
        expected = torch.full((4, 6), -1.0)
        expected[:, 1::2] = torch.arange(24, dtype=torch.float32).reshape(4, 6)[:, ::2]
        assert_tensor(target, expected, "recv into a strided view")
        tt = torch.zeros(4, 6).t()
        dist.recv(tt, src=0)
        assert_tensor(tt, torch.arange(24, dtype=torch.float32).reshape(4, 6).t(), "recv of a transposed view")
