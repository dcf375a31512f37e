"""Bodies run on every rank of a tdist.testing World (started without a process
group) by tdist-gloo's multi-process tests.

Each body is ``body(**kwargs)`` and learns its rank from the environment the world
set; it initialises tdist with the gloo backend, checks, tears down, and returns
something small.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any


def _init(timeout: float = 30.0, init_method: str = "env://", torch_bridge: bool = True, **options: Any) -> Any:
    import tdist

    tdist.init_process_group(
        "gloo",
        init_method=init_method,
        timeout=timedelta(seconds=timeout),
        pg_options=options or None,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        torch_bridge=torch_bridge,
    )
    return tdist


def _rank_and_size() -> tuple[int, int]:
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _eq(got: Any, want: Any, what: str) -> None:
    import torch

    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype.is_floating_point and got.element_size() == 1:  # float8: compare as float32
        got, want = got.float(), want.float()
    if got.dtype in (getattr(torch, "uint16", None), getattr(torch, "uint32", None), getattr(torch, "uint64", None)):
        signed = {2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
        got, want = got.view(signed), want.view(signed)
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, want {want.tolist()}"


# ------------------------------------------------------------- emulated reductions
def _ints(rank: int, n: int) -> Any:
    import torch

    i = torch.arange(n)
    return torch.where(i % 2 == 0, (i + rank) % 5 + 1, -((i * 3 + rank) % 7) - 1)


def _exact(op: str, xs: list) -> Any:
    import torch

    stack = torch.stack(xs)
    if op == "SUM":
        return stack.sum(0)
    if op == "PRODUCT":
        return stack.prod(0)
    if op == "MIN":
        return stack.min(0).values
    if op == "MAX":
        return stack.max(0).values
    out = stack[0].clone()
    for x in stack[1:]:
        out = {"BAND": out & x, "BOR": out | x, "BXOR": out ^ x}[op]
    return out


def emulated_reductions() -> int:
    """int16/uint16/uint32/uint64 (every operator) and float8 (arithmetic ones) through
    all_reduce, reduce, reduce_scatter and reduce_scatter_tensor, against exact results."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init()
    n = 6
    checked = 0
    int_dtypes = [torch.int16] + [d for d in (getattr(torch, "uint16", None), getattr(torch, "uint32", None)) if d]
    ops = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]
    for dtype in int_dtypes:
        unsigned = not dtype.is_signed
        for op in ops:

            def inp(r: int, count: int = n) -> Any:
                x = _ints(r, count)
                return (x.abs() if unsigned else x).to(torch.int64)

            want = _exact(op, [inp(r) for r in range(world_size)])
            t = inp(rank).to(dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            _eq(t, want.to(dtype), f"all_reduce {op} {dtype}")
            t = inp(rank).to(dtype)
            dist.reduce(t, dst=world_size - 1, op=getattr(dist.ReduceOp, op))
            if rank == world_size - 1:
                _eq(t, want.to(dtype), f"reduce {op} {dtype}")
            whole = [inp(r, n * world_size) for r in range(world_size)]
            want_chunk = _exact(op, [w[rank * n : (rank + 1) * n] for w in whole]).to(dtype)
            out = torch.zeros(n, dtype=dtype)
            mine = whole[rank].to(dtype)
            keep = mine.clone()
            dist.reduce_scatter_tensor(out, mine, op=getattr(dist.ReduceOp, op))
            _eq(out, want_chunk, f"reduce_scatter_tensor {op} {dtype}")
            _eq(mine, keep, f"reduce_scatter_tensor {op} {dtype} left its input alone")
            out = torch.zeros(n, dtype=dtype)
            dist.reduce_scatter(out, list(mine.chunk(world_size)), op=getattr(dist.ReduceOp, op))
            _eq(out, want_chunk, f"reduce_scatter {op} {dtype}")
            _eq(mine, keep, f"reduce_scatter {op} {dtype} left its inputs alone")
            checked += 4
    u64 = getattr(torch, "uint64", None)
    if u64 is not None:
        # bit patterns with the top bit set: an unsigned order differs from int64's
        def big(r: int) -> Any:
            return torch.tensor([1 + r, -1 - r, 2**62 + r, -(2**62) + r, 7 * (r + 1), 0], dtype=torch.int64)

        for op in ops:
            xs = [big(r) for r in range(world_size)]
            if op in ("MIN", "MAX"):  # unsigned order: compare through Python ints
                us = [[v % 2**64 for v in x.tolist()] for x in xs]
                pick = min if op == "MIN" else max
                want = torch.tensor([pick(col) - (2**64 if pick(col) >= 2**63 else 0) for col in zip(*us)])
            elif op == "PRODUCT":
                want = xs[0].clone()
                for x in xs[1:]:
                    want = torch.tensor(
                        [
                            ((a * b) % 2**64) - (2**64 if (a * b) % 2**64 >= 2**63 else 0)
                            for a, b in zip(want.tolist(), x.tolist())
                        ]
                    )
            elif op == "SUM":
                want = torch.tensor(
                    [
                        ((sum(col)) % 2**64) - (2**64 if sum(col) % 2**64 >= 2**63 else 0)
                        for col in zip(*[x.tolist() for x in xs])
                    ]
                )
            else:
                want = _exact(op, xs)
            t = big(rank).view(u64)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            _eq(t.view(torch.int64), want, f"all_reduce {op} uint64")
            checked += 1
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for op in ("SUM", "PRODUCT", "MIN", "MAX", "AVG"):
            xs = [(_ints(r, n) % 3 + 1).to(torch.float32) for r in range(world_size)]
            if op == "AVG":
                want = (torch.stack(xs).sum(0) / world_size).to(dtype)
            else:
                want = _exact(op, xs).to(dtype)
            t = xs[rank].to(dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            _eq(t, want, f"all_reduce {op} {dtype}")
            checked += 1
    dist.destroy_process_group()
    return checked


def premul_avg_complex() -> int:
    """PREMUL_SUM (number, tensor factor) and AVG on every reducing collective; complex
    SUM/AVG; integer PREMUL_SUM with an integer factor; what stays invalid raises first."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init()
    n = 4
    checked = 0
    x = [torch.arange(n * world_size, dtype=torch.float32) + r for r in range(world_size)]
    total = torch.stack(x).sum(0)
    for factor, label in ((0.5, "number"), (torch.tensor([4.0]), "tensor"), (torch.tensor(2.0), "0-dim tensor")):
        f = float(factor) if not isinstance(factor, torch.Tensor) else float(factor.reshape(()))
        op = dist.make_premul_sum(factor)
        t = x[rank].clone()
        dist.all_reduce(t, op=op)
        _eq(t, total * f, f"all_reduce PREMUL_SUM {label}")
        t = x[rank].clone()
        dist.reduce(t, dst=0, op=op)
        if rank == 0:
            _eq(t, total * f, f"reduce PREMUL_SUM {label}")
        out = torch.zeros(n)
        mine = x[rank].clone()
        dist.reduce_scatter_tensor(out, mine, op=op)
        _eq(out, (total * f)[rank * n : (rank + 1) * n], f"reduce_scatter_tensor PREMUL_SUM {label}")
        _eq(mine, x[rank], f"reduce_scatter_tensor PREMUL_SUM {label} left its input alone")
        out = torch.zeros(n)
        dist.reduce_scatter(out, list(mine.chunk(world_size)), op=op)
        _eq(out, (total * f)[rank * n : (rank + 1) * n], f"reduce_scatter PREMUL_SUM {label}")
        checked += 4
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        t = x[rank].to(dtype)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        _eq(t, (total / world_size).to(dtype), f"all_reduce AVG {dtype}")
        checked += 1
    c = [torch.complex(torch.arange(n, dtype=torch.float32) + r, torch.full((n,), float(r))) for r in range(world_size)]
    csum = torch.stack(c).sum(0)
    for op, want in (("SUM", csum), ("AVG", csum / world_size)):
        t = c[rank].clone()
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        _eq(t, want, f"all_reduce {op} complex64")
        out = torch.zeros(n // world_size if n % world_size == 0 else 1, dtype=torch.complex64)
        if n % world_size == 0:
            dist.reduce_scatter_tensor(out, c[rank].clone(), op=getattr(dist.ReduceOp, op))
            k = n // world_size
            _eq(out, want[rank * k : (rank + 1) * k], f"reduce_scatter_tensor {op} complex64")
        checked += 2
    t = c[rank].clone()
    dist.all_reduce(t, op=dist.make_premul_sum(2.0))
    _eq(t, csum * 2, "all_reduce PREMUL_SUM complex64")
    ints = [torch.arange(n, dtype=torch.int32) + r for r in range(world_size)]
    t = ints[rank].clone()
    dist.all_reduce(t, op=dist.make_premul_sum(3))
    _eq(t, (torch.stack(ints).sum(0) * 3).to(torch.int32), "all_reduce PREMUL_SUM(3) int32")
    checked += 2
    # rejected before any communication: the world goes on afterwards
    for what, call in (
        ("BAND float32", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)),
        ("PRODUCT complex64", lambda: dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.PRODUCT)),
        (
            "PREMUL_SUM(0.5) int32",
            lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.make_premul_sum(0.5)),
        ),
    ):
        try:
            call()
        except (ValueError, TypeError, dist.DistError) as exc:
            assert str(exc), what
        else:
            raise AssertionError(f"{what}: no error")
        checked += 1
    t = torch.ones(3)
    dist.all_reduce(t)
    _eq(t, torch.full((3,), float(world_size)), "all_reduce after rejected calls")
    dist.destroy_process_group()
    return checked


def data_movement() -> int:
    """Every data-moving operation on dtypes gloo cannot carry (through their bytes) and on
    native ones with shapes gloo would refuse; all_to_all with different sizes per peer."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init()
    checked = 0
    dtypes = [torch.float32, torch.int16, torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.bool]
    dtypes += [d for d in (getattr(torch, "uint16", None), getattr(torch, "uint64", None)) if d]

    def val(r: int, k: int, dtype: Any, shape: tuple = (2, 3)) -> Any:
        base = torch.arange(6).reshape(2, 3) + 10 * r + 100 * k
        base = base.reshape(shape)
        if dtype.is_complex:
            return torch.complex(base.float(), -base.float()).to(dtype)
        if dtype == torch.bool:
            return base % 3 == 0
        if dtype.is_floating_point and dtype.itemsize == 1:
            return (base % 8).float().to(dtype)
        return base.to(dtype)

    for dtype in dtypes:
        what = str(dtype)
        # broadcast from the last rank
        t = val(rank, 0, dtype)
        dist.broadcast(t, src=world_size - 1)
        _eq(t, val(world_size - 1, 0, dtype), f"broadcast {what}")
        # all_gather into differently shaped outputs (same number of elements)
        outs = [torch.empty(3, 2, dtype=dtype) for _ in range(world_size)]
        dist.all_gather(outs, val(rank, 0, dtype))
        for r, o in enumerate(outs):
            _eq(o, val(r, 0, dtype, (3, 2)), f"all_gather {what} [{r}]")
        big = torch.empty(world_size * 6, dtype=dtype)
        dist.all_gather_into_tensor(big, val(rank, 0, dtype))
        _eq(big, torch.cat([val(r, 0, dtype).reshape(-1) for r in range(world_size)]), f"all_gather_into_tensor {what}")
        stacked = torch.empty(world_size, 2, 3, dtype=dtype)
        dist.all_gather_into_tensor(stacked, val(rank, 0, dtype))
        _eq(stacked, torch.stack([val(r, 0, dtype) for r in range(world_size)]), f"all_gather_into_tensor stack {what}")
        # gather / scatter
        gl = [torch.empty(2, 3, dtype=dtype) for _ in range(world_size)] if rank == 0 else None
        dist.gather(val(rank, 1, dtype), gl, dst=0)
        if rank == 0:
            for r, o in enumerate(gl):
                _eq(o, val(r, 1, dtype), f"gather {what} [{r}]")
        out = torch.empty(2, 3, dtype=dtype)
        sl = [val(0, 2 + k, dtype) for k in range(world_size)] if rank == 0 else None
        dist.scatter(out, sl, src=0)
        _eq(out, val(0, 2 + rank, dtype), f"scatter {what}")
        # all_to_all with a different size per (sender, receiver) pair
        ins = [torch.cat([val(rank, j, dtype).reshape(-1)] * (j + 1)) for j in range(world_size)]
        outs = [torch.empty(6 * (rank + 1), dtype=dtype) for _ in range(world_size)]
        dist.all_to_all(outs, ins)
        for j, o in enumerate(outs):
            _eq(o, torch.cat([val(j, rank, dtype).reshape(-1)] * (rank + 1)), f"all_to_all {what} from {j}")
        # all_to_all_single, uneven splits, rows of (3,)
        in_splits = [j + 1 for j in range(world_size)]
        out_splits = [rank + 1] * world_size
        src = torch.cat([val(rank, j, dtype)[:1].expand(j + 1, 3) for j in range(world_size)])
        dst_t = torch.empty(sum(out_splits), 3, dtype=dtype)
        dist.all_to_all_single(dst_t, src, out_splits, in_splits)
        _eq(
            dst_t,
            torch.cat([val(j, rank, dtype)[:1].expand(rank + 1, 3) for j in range(world_size)]),
            f"all_to_all_single {what}",
        )
        # point-to-point in a ring
        if world_size > 1:
            nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
            got = torch.empty(2, 3, dtype=dtype)
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, val(rank, 5, dtype), nxt), dist.P2POp(dist.irecv, got, prv)]
            )
            for w in works:
                w.wait()
            _eq(got, val(prv, 5, dtype), f"send/recv {what}")
        checked += 1
    dist.destroy_process_group()
    return checked


# ------------------------------------------------------------------ work objects
def work_semantics() -> dict:
    """recv from any source, source_rank, is_completed polling on gloo's p2p works,
    wait(timeout) that expires and then completes, futures, callbacks, tags."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init()
    out: dict = {}
    # any-source receive on rank 0 from every other rank
    if rank == 0:
        senders = set()
        for _ in range(world_size - 1):
            t = torch.zeros(3)
            src = dist.recv(t)
            assert torch.equal(t, torch.full((3,), float(src))), (src, t)
            senders.add(src)
        out["senders"] = sorted(senders)
        w = dist.irecv(torch.zeros(1))
        dist.barrier()
        w.wait()
        out["irecv_any_source_rank"] = w.source_rank()
    else:
        dist.send(torch.full((3,), float(rank)), dst=0)
        dist.barrier()
        if rank == world_size - 1:
            dist.send(torch.ones(1), dst=0)
    # polling a pending irecv until the sender sends, late
    dist.barrier()
    if rank == 0:
        t = torch.zeros(2)
        w = dist.irecv(t, src=1, tag=5)
        assert not w.is_completed()
        polls = 0
        deadline = time.monotonic() + 20
        while not w.is_completed():
            polls += 1
            assert time.monotonic() < deadline, "irecv never reported completion"
            time.sleep(0.01)
        assert torch.equal(t, torch.full((2,), 5.0)), t
        assert w.is_success() and w.exception() is None
        assert w.source_rank() == 1
        out["polls"] = polls
    elif rank == 1:
        time.sleep(0.3)
        dist.send(torch.full((2,), 5.0), dst=0, tag=5)
    # wait(timeout) that expires, then the same work completes
    dist.barrier()
    if rank == 0:
        t = torch.zeros(2)
        w = dist.irecv(t, src=1, tag=6)
        t0 = time.monotonic()
        try:
            w.wait(timeout=timedelta(seconds=0.3))
        except dist.DistBackendTimeoutError as exc:
            assert isinstance(exc, TimeoutError) and "0.3" in str(exc), exc
            out["timed_out_after"] = round(time.monotonic() - t0, 2)
        else:
            raise AssertionError("wait(timeout) did not time out")
        assert w.wait() is True
        assert torch.equal(t, torch.full((2,), 6.0))
    elif rank == 1:
        time.sleep(1.0)
        dist.send(torch.full((2,), 6.0), dst=0, tag=6)
    # async collectives: result, future, callbacks, is_completed
    t = torch.ones(4)
    w = dist.all_reduce(t, async_op=True)
    seen = []
    w.add_done_callback(lambda work: seen.append(work.is_success()))
    fut = w.get_future()
    value = fut.wait()
    assert w.wait() and w.is_completed() and w.is_success()
    assert torch.equal(value[0], torch.full((4,), float(world_size))), value
    assert torch.equal(w.result()[0], t)
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [True], seen
    # gloo's reduce_scatter works report completion only inside wait(): polling still ends
    for call in (
        lambda dst: dist.reduce_scatter_tensor(dst, torch.ones(2 * world_size), async_op=True),
        lambda dst: dist.reduce_scatter(dst, [torch.ones(2)] * world_size, async_op=True),
        lambda dst: dist.all_reduce(dst, async_op=True),
    ):
        result = torch.ones(2)
        w = call(result)
        deadline = time.monotonic() + 20
        while not w.is_completed():
            assert time.monotonic() < deadline, "async collective never reported completion"
            time.sleep(0.005)
        assert w.is_success()
        assert result.tolist() == [float(world_size)] * 2, result
    # an emulated operation's future carries the final (post-processed) result
    t = torch.ones(3, dtype=torch.int16)
    w = dist.all_reduce(t, async_op=True)
    value = w.get_future().wait()
    assert torch.equal(value[0], torch.full((3,), world_size, dtype=torch.int16)), value
    # tags: a receive for tag 3 matches the tag-3 message though tag 7 was sent first
    if world_size > 1:
        if rank == 0:
            wa = dist.isend(torch.full((4,), 7.0), dst=1, tag=7)
            wb = dist.isend(torch.full((2,), 3.0), dst=1, tag=3)
            wa.wait()
            wb.wait()
        elif rank == 1:
            b = torch.zeros(2)
            dist.recv(b, src=0, tag=3)
            a = torch.zeros(4)
            dist.recv(a, src=0, tag=7)
            assert b.tolist() == [3.0] * 2 and a.tolist() == [7.0] * 4
        try:
            dist.send(torch.ones(1), dst=(rank + 1) % world_size, tag=-1)
        except ValueError as exc:
            assert "tag" in str(exc) and "gloo" in str(exc)
        else:
            raise AssertionError("negative tag accepted")
    dist.barrier()
    dist.destroy_process_group()
    return out


# ------------------------------------------------------------------ failures
def op_timeout() -> str:
    """Rank 1 never joins an all_reduce: rank 0's gloo gives up after the group's
    timeout with DistBackendTimeoutError carrying gloo's message."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init(timeout=2.0)
    if rank == 0:
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(2))
        except dist.DistBackendTimeoutError as exc:
            elapsed = time.monotonic() - t0
            assert isinstance(exc, TimeoutError) and isinstance(exc, dist.DistBackendError)
            assert "gloo" in str(exc) and "all_reduce" in str(exc), str(exc)
            assert exc.__cause__ is not None and str(exc.__cause__) in str(exc)
            assert elapsed < 15, elapsed
            return str(exc)
        raise AssertionError("all_reduce completed without rank 1")
    time.sleep(6.0)
    return ""


def peer_dies() -> str:
    """Rank 1 exits mid-job: rank 0's next collective fails with DistBackendError."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init(timeout=20.0)
    dist.all_reduce(torch.ones(2))
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    try:
        dist.all_reduce(torch.ones(2))
    except dist.DistBackendError as exc:
        assert "gloo" in str(exc), str(exc)
        return type(exc).__name__ + ": " + str(exc)
    raise AssertionError("all_reduce completed without rank 1")


# ------------------------------------------------------------ torch side by side
def side_by_side(torch_port: int) -> list:
    """tdist (gloo) and torch.distributed (its own gloo group) in one process, interleaved;
    tdist.new_group builds a second ProcessGroupGloo over a PrefixStore."""
    rank, world_size = _rank_and_size()
    import torch
    import torch.distributed as td

    dist = _init(torch_bridge=False)  # two worlds: tdist's is not made torch's default group
    td.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{torch_port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=30),
    )
    a, b = torch.full((3,), float(rank)), torch.full((3,), float(rank + 1))
    want_a = float(sum(range(world_size)))
    want_b = float(sum(range(1, world_size + 1)))
    for _ in range(3):
        wa = dist.all_reduce(a, async_op=True)
        wb = td.all_reduce(b, async_op=True)
        wa.wait()
        wb.wait()
        assert a.tolist() == [want_a] * 3 and b.tolist() == [want_b] * 3, (a, b)
        a.fill_(float(rank))
        b.fill_(float(rank + 1))
    assert dist.get_backend() == "gloo" and td.get_backend() == "gloo"
    sub = dist.new_group(list(range(0, world_size, 2)))
    result = []
    if sub is not dist.GroupMember.NON_GROUP_MEMBER:
        t = torch.ones(2)
        dist.all_reduce(t, group=sub)
        result = t.tolist()
        outs = [torch.zeros(1) for _ in range(dist.get_world_size(sub))]
        dist.all_gather(outs, torch.tensor([float(rank)]), group=sub)
        assert [o.item() for o in outs] == [float(r) for r in range(0, world_size, 2)]
    td.barrier()
    td.destroy_process_group()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world_size
    dist.destroy_process_group()
    return result


def init_methods(init_method: str) -> float:
    """gloo rendezvouses through whatever store tdist's init method made."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init(init_method=init_method)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    g = dist.new_group()
    dist.all_reduce(t, group=g)
    dist.destroy_process_group()
    return t[0].item()


def interface_option() -> float:
    """pg_options={"gloo_interface": "lo"} (and GLOO_SOCKET_IFNAME) pick the device."""
    rank, world_size = _rank_and_size()
    import torch

    dist = _init(gloo_interface="lo", gloo_threads=1)
    t = torch.ones(2)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t[0].item()
