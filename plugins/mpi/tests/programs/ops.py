"""Every operation of the mpi backend, checked on every rank. Run: mpirun -n N python ops.py

Any failure raises, uncaught: the backend's abort hook ends the whole job with a
non-zero exit, and the test shows the traceback. Each rank prints "ALL OK" at the end.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from datetime import timedelta

import torch

import tdist as dist
from tdist import ReduceOp

dist.init_process_group("mpi", timeout=timedelta(seconds=60))
rank, n = dist.get_rank(), dist.get_world_size()
assert dist.get_backend() == "mpi", dist.get_backend()
if rank == 0:
    from tdist_mpi._runtime import runtime

    print(f"thread level {runtime().thread_level_name}", flush=True)

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
DTYPES = FLOATS + INTS + (torch.bool, torch.complex64)


def check(name):
    def wrap(fn):
        @functools.wraps(fn)
        def run():
            fn()
            dist.barrier()
            if rank == 0:
                print(f"ok {name}", flush=True)

        CHECKS.append(run)
        return run

    return wrap


CHECKS: list = []


def rank_input(r: int, dtype: torch.dtype, numel: int = 5) -> torch.Tensor:
    i = torch.arange(numel)
    if dtype == torch.bool:
        return ((i + r) % 3 == 0) | ((i * r) % 4 == 1)
    mag = (i + r) % 3 + 1
    if dtype == torch.complex64:
        return torch.complex(mag.float(), (mag - 2).float())
    if dtype in (torch.int32, torch.int64, torch.uint8):
        return torch.where(i % 2 == 0, mag, (i * 5 + r * 3) % 16 + 1).to(dtype)
    return mag.to(dtype)


def expected(op: ReduceOp, dtype: torch.dtype, numel: int = 5, factor: float = 2.0) -> torch.Tensor:
    inputs = [rank_input(r, dtype, numel) for r in range(n)]
    if dtype == torch.bool:
        s = torch.stack(inputs)
        table = {
            ReduceOp.SUM: s.any(0),
            ReduceOp.MAX: s.any(0),
            ReduceOp.BOR: s.any(0),
            ReduceOp.PRODUCT: s.all(0),
            ReduceOp.MIN: s.all(0),
            ReduceOp.BAND: s.all(0),
            ReduceOp.BXOR: s.long().sum(0) % 2 == 1,
        }
        return table[op]
    wide = torch.complex128 if dtype.is_complex else (torch.float64 if dtype.is_floating_point else torch.int64)
    s = torch.stack([x.to(wide) for x in inputs])
    if op == ReduceOp.SUM:
        out = s.sum(0)
    elif op == ReduceOp.PRODUCT:
        out = s.prod(0)
    elif op == ReduceOp.MIN:
        out = s.min(0).values
    elif op == ReduceOp.MAX:
        out = s.max(0).values
    elif op == ReduceOp.AVG:
        out = s.sum(0) / n
    elif op == ReduceOp.PREMUL_SUM:
        out = (s * factor).sum(0)
    else:
        fn = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
        out = functools.reduce(fn, list(s))
    return out.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype in (torch.float16, torch.bfloat16):
        ok = torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2)
    elif a.is_floating_point() or a.is_complex():
        ok = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    else:
        ok = torch.equal(a, b)
    assert ok, f"rank {rank}: {what}: got {a.tolist()}, expected {b.tolist()}"


def valid(op: ReduceOp, dtype: torch.dtype) -> bool:
    """The core's rule (tdist.reduction.check_reduction), which runs before the backend's."""
    from tdist.reduction import check_reduction

    try:
        check_reduction(as_op(op, dtype) if op == ReduceOp.PREMUL_SUM else dist.Reduction(op), dtype)
    except (TypeError, ValueError):
        return False
    return True


def as_op(op: ReduceOp, dtype: torch.dtype = torch.float32):
    if op == ReduceOp.PREMUL_SUM:  # an integer factor for integer tensors
        return dist.make_premul_sum(2.0 if dtype.is_floating_point or dtype.is_complex else 2)
    return op


@check("all_reduce: every ReduceOp x dtype; invalid pairs raise before communicating")
def _():
    for dtype in DTYPES:
        for op in ReduceOp:
            if n > 2 and op in (ReduceOp.PRODUCT, ReduceOp.PREMUL_SUM) and dtype in (torch.int8, torch.uint8):
                continue  # keep products in range
            t = rank_input(rank, dtype)
            if not valid(op, dtype):
                try:
                    dist.all_reduce(t, op=as_op(op, dtype))
                except TypeError:
                    continue
                raise AssertionError(f"all_reduce {op.name} on {dtype} did not raise")
            dist.all_reduce(t, op=as_op(op, dtype))
            same(t, expected(op, dtype), f"all_reduce {op.name} {dtype}")
    x = torch.ones(3)
    dist.all_reduce(x)  # still in step after the refused ones
    same(x, torch.full((3,), float(n)), "all_reduce after refusals")


@check("reduce / reduce_scatter / reduce_scatter_tensor with SUM, MAX, AVG, PREMUL_SUM")
def _():
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            if not valid(op, dtype):
                continue
            dst = n - 1
            t = rank_input(rank, dtype)
            before = t.clone()
            dist.reduce(t, dst=dst, op=as_op(op, dtype))
            if rank == dst:
                same(t, expected(op, dtype), f"reduce {op.name} {dtype}")
            elif op == ReduceOp.PREMUL_SUM:
                same(t, before, "reduce leaves a non-root's PREMUL_SUM input alone")
            full = rank_input(rank, dtype, 2 * n)
            out = torch.empty(2, dtype=dtype)
            dist.reduce_scatter_tensor(out, full, op=as_op(op, dtype))
            same(out, expected(op, dtype, 2 * n)[2 * rank : 2 * rank + 2], f"reduce_scatter_tensor {op.name} {dtype}")
            same(full, rank_input(rank, dtype, 2 * n), "reduce_scatter_tensor leaves its input alone")
            out2 = torch.empty(2, dtype=dtype)
            dist.reduce_scatter(out2, list(full.chunk(n)), op=as_op(op, dtype))
            same(out2, out, f"reduce_scatter {op.name} {dtype}")


@check("broadcast / all_gather / all_gather_into_tensor / gather / scatter, many dtypes")
def _():
    for dtype in DTYPES:
        src = n - 1
        t = rank_input(rank, dtype, 7).reshape(7) if rank == src else torch.zeros(7, dtype=dtype)
        dist.broadcast(t, src=src)
        same(t, rank_input(src, dtype, 7), f"broadcast {dtype}")
        mine = rank_input(rank, dtype, 3)
        outs = [torch.zeros(3, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, mine)
        for r in range(n):
            same(outs[r], rank_input(r, dtype, 3), f"all_gather {dtype} from {r}")
        flat = torch.zeros(3 * n, dtype=dtype)
        dist.all_gather_into_tensor(flat, mine)
        same(flat, torch.cat([rank_input(r, dtype, 3) for r in range(n)]), f"all_gather_into_tensor {dtype}")
        dst = n // 2
        glist = [torch.zeros(3, dtype=dtype) for _ in range(n)] if rank == dst else None
        dist.gather(mine, glist, dst=dst)
        if rank == dst:
            for r in range(n):
                same(glist[r], rank_input(r, dtype, 3), f"gather {dtype}")
        slist = [rank_input(r, dtype, 3) for r in range(n)] if rank == 0 else None
        got = torch.zeros(3, dtype=dtype)
        dist.scatter(got, slist, src=0)
        same(got, rank_input(rank, dtype, 3), f"scatter {dtype}")
    # zero-dim and empty tensors
    s = torch.tensor(float(rank))
    dist.all_reduce(s)
    same(s, torch.tensor(float(n * (n - 1) // 2)), "0-dim all_reduce")
    e = torch.zeros(0)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)


@check("all_to_all (uneven sizes) and all_to_all_single (even and uneven splits)")
def _():
    # rank i sends j+1 elements to rank j, valued 100*i + j
    inputs = [torch.full((j + 1,), 100.0 * rank + j) for j in range(n)]
    outputs = [torch.zeros(rank + 1) for _ in range(n)]
    dist.all_to_all(outputs, inputs)
    for j in range(n):
        same(outputs[j], torch.full((rank + 1,), 100.0 * j + rank), "all_to_all")
    inp = torch.arange(2 * n, dtype=torch.int64) + 1000 * rank
    out = torch.zeros(2 * n, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2) + 1000 * j for j in range(n)])
    same(out, want, "all_to_all_single even")
    in_splits = [j + 1 for j in range(n)]
    out_splits = [rank + 1] * n
    inp = torch.cat([torch.full((j + 1, 2), float(10 * rank + j)) for j in range(n)])
    out = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    want = torch.cat([torch.full((rank + 1, 2), float(10 * j + rank)) for j in range(n)])
    same(out, want, "all_to_all_single uneven")


@check("send/recv, recv(src=None) returns the sender, non-overtaking order, isend/irecv Work")
def _():
    if n < 2:
        return
    # ring with tags
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    buf = torch.zeros(4)
    if rank % 2 == 0:
        dist.send(torch.full((4,), float(rank)), dst=nxt, tag=5)
        dist.recv(buf, src=prv, tag=5)
    else:
        dist.recv(buf, src=prv, tag=5)
        dist.send(torch.full((4,), float(rank)), dst=nxt, tag=5)
    same(buf, torch.full((4,), float(prv)), "ring send/recv")
    # any source: every other rank sends 3 messages in order to rank 0
    k = 3
    if rank == 0:
        seen = {r: [] for r in range(1, n)}
        t = torch.zeros(2, dtype=torch.int64)
        for _ in range(k * (n - 1)):
            src = dist.recv(t, src=None, tag=21)
            assert src == int(t[0]), (
                f"recv(src=None) returned {src} for a message from {int(t[0])} {t.view(torch.uint8).tolist()}"
            )
            seen[src].append(int(t[1]))
        for r, seq in seen.items():
            assert seq == list(range(k)), f"messages from {r} overtook each other: {seq}"
    else:
        for i in range(k):
            dist.send(torch.tensor([rank, i]), dst=0, tag=21)
    # isend/irecv: post the receive first; source_rank(); is_completed
    if rank == 0:
        works = [dist.irecv(torch.zeros(3), src=r, tag=9) for r in range(1, n)]
        for r, w in zip(range(1, n), works):
            assert w.wait() is True
            assert w.is_completed() and w.source_rank() == r, (w.is_completed(), w.source_rank())
    else:
        w = dist.isend(torch.ones(3) * rank, dst=0, tag=9)
        w.wait()
        assert w.is_completed()
    # bf16 / bool / complex travel intact
    for dtype in (torch.bfloat16, torch.bool, torch.complex64, torch.float16):
        if rank == 0:
            dist.send(rank_input(0, dtype, 6), dst=1, tag=23)
        elif rank == 1:
            got = torch.zeros(6, dtype=dtype)
            dist.recv(got, src=0, tag=23)
            same(got, rank_input(0, dtype, 6), f"send/recv {dtype}")
    # batch_isend_irecv ring
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(rank)), nxt, tag=22),
        dist.P2POp(dist.irecv, buf2 := torch.zeros(2), prv, tag=22),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    same(buf2, torch.full((2,), float(prv)), "batch_isend_irecv")


@check("Work.wait(timeout) raises DistBackendTimeoutError; the request still completes later")
def _():
    if n < 2:
        return
    if rank == 0:
        t = torch.zeros(2)
        w = dist.irecv(t, src=1, tag=77)
        start = time.monotonic()
        try:
            w.wait(timeout=0.3)
        except dist.DistBackendTimeoutError as exc:
            assert isinstance(exc, TimeoutError)
            assert time.monotonic() - start < 5
        else:
            raise AssertionError("wait(timeout=0.3) on an unmatched irecv returned")
        assert not w.is_completed()
        dist.send(torch.ones(1), dst=1, tag=78)  # now let rank 1 send
        assert w.wait(timeout=30) is True
        same(t, torch.full((2,), 7.0), "late irecv")
    elif rank == 1:
        dist.recv(torch.zeros(1), src=0, tag=78)
        dist.send(torch.full((2,), 7.0), dst=0, tag=77)


@check("an MPI error (message truncated) becomes a DistBackendError with MPI's error string")
def _():
    if n < 2:
        return
    if rank == 0:
        dist.send(torch.ones(8), dst=1, tag=11)
    elif rank == 1:
        try:
            dist.recv(torch.zeros(4), src=0, tag=11)
        except dist.DistBackendError as exc:
            assert "MPI" in str(exc) and "trunc" in str(exc).lower(), str(exc)
        else:
            raise AssertionError("receiving 8 floats into 4 did not raise")


@check("async_op=True collectives: Work, is_completed, wait, get_future")
def _():
    ts = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    b = torch.full((5,), float(rank))
    wb = dist.broadcast(b, src=0, async_op=True)
    for i, (t, w) in enumerate(zip(ts, works)):
        assert w.wait() is True and w.is_completed() and w.is_success()
        same(t, torch.full((1000,), float(sum(r + i for r in range(n)))), f"async all_reduce {i}")
    wb.wait()
    same(b, torch.zeros(5), "async broadcast")
    fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
    res = fut.wait()
    same(res[0], torch.full((2,), float(n)), "get_future")
    done = []
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.add_done_callback(lambda work: done.append(work))
    w.wait()
    deadline = time.monotonic() + 5
    while not done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert done, "done-callback never ran"
    wbar = dist.barrier(async_op=True)
    wbar.wait()


@check("new_group: sub-communicators; non-members; group_src/dst")
def _():
    evens = [r for r in range(n) if r % 2 == 0]
    g_even = dist.new_group(evens)
    g_last = dist.new_group(sorted({0, n - 1}))
    g_all = dist.new_group()
    if rank in evens:
        t = torch.ones(2) * rank
        dist.all_reduce(t, group=g_even)
        same(t, torch.full((2,), float(sum(evens))), "all_reduce in evens")
        b = torch.full((1,), float(rank))
        dist.broadcast(b, group=g_even, group_src=len(evens) - 1)
        same(b, torch.full((1,), float(evens[-1])), "broadcast group_src")
        assert dist.get_world_size(g_even) == len(evens)
    else:
        assert g_even == dist.GroupMember.NON_GROUP_MEMBER
    if rank in (0, n - 1) and n > 1:
        t = torch.full((3,), float(rank))
        dist.all_reduce(t, op=ReduceOp.MAX, group=g_last)
        same(t, torch.full((3,), float(n - 1)), "all_reduce in [0, n-1]")
        if rank == 0:
            dist.send(torch.ones(2), dst=n - 1, group=g_last)
        else:
            got = torch.zeros(2)
            src = dist.recv(got, src=None, group=g_last)
            assert src == 0, src
    t = torch.ones(1)
    dist.all_reduce(t, group=g_all)
    same(t, torch.full((1,), float(n)), "all_reduce in new_group()")
    for g in (g_even, g_last, g_all):
        if g != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(g)


@check("threads: concurrent collectives on two groups (MPI_THREAD_MULTIPLE or serialised)")
def _():
    g1, g2 = dist.new_group(), dist.new_group()
    errors: list = []

    def loop(g, value):
        try:
            for _ in range(30):
                t = torch.full((64,), value)
                dist.all_reduce(t, group=g)
                same(t, torch.full((64,), value * n), "threaded all_reduce")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=loop, args=(g, v)) for g, v in ((g1, 1.0), (g2, 2.0))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors


@check("requires_grad and non-contiguous tensors")
def _():
    t = torch.ones(4, requires_grad=True)
    dist.all_reduce(t)
    same(t.detach(), torch.full((4,), float(n)), "requires_grad all_reduce")
    m = torch.ones(4, 6)[:, ::2]
    assert not m.is_contiguous()
    dist.all_reduce(m)
    same(m.contiguous(), torch.full((4, 3), float(n)), "non-contiguous all_reduce")


only = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else range(len(CHECKS))
for i in only:
    CHECKS[i]()
dist.destroy_process_group()
# a second init in the same process (MPI stays initialised)
dist.init_process_group("mpi")
t = torch.ones(1)
dist.all_reduce(t)
same(t, torch.full((1,), float(n)), "all_reduce after re-init")
dist.destroy_process_group()
print(f"ALL OK rank {rank}", flush=True)
sys.exit(0)
