"""Bodies the two-process GPU tests run on every rank (through tdist.testing.World).

Each rank first picks its own GPU (rank % device_count): the group's communicator is
created lazily, at the first CUDA operation, on the device of its tensors.
"""

from __future__ import annotations

from typing import Any

import tdist as dist
import torch


def _device() -> torch.device:
    index = dist.get_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _check(condition: bool, what: str, got: Any) -> None:
    if not condition:
        raise AssertionError(f"rank {dist.get_rank()}: {what}: got {got!r}")


def collectives() -> int:
    """Every collective on two ranks, with values that depend on the rank."""
    dev = _device()
    rank, size = dist.get_rank(), dist.get_world_size()
    checks = 0
    t = torch.full((5,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    _check(t.tolist() == [3.0] * 5, "all_reduce SUM", t)
    checks += 1
    for op, want in [
        (dist.ReduceOp.PRODUCT, 2.0),
        (dist.ReduceOp.MIN, 1.0),
        (dist.ReduceOp.MAX, 2.0),
        (dist.ReduceOp.AVG, 1.5),
    ]:
        t = torch.full((3,), float(rank + 1), device=dev)
        dist.all_reduce(t, op=op)
        _check(t.tolist() == [want] * 3, f"all_reduce {op}", t)
        checks += 1
    t = torch.full((3,), float(rank + 1), device=dev)
    dist.all_reduce(t, op=dist.make_premul_sum(2.0))
    _check(t.tolist() == [6.0] * 3, "PREMUL_SUM", t)
    flags = torch.tensor([rank == 0, False], device=dev)
    dist.all_reduce(flags)
    _check(flags.tolist() == [True, False], "bool SUM", flags)
    for dtype in (torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.float64):
        t = torch.full((4,), rank + 1, dtype=dtype, device=dev)
        dist.all_reduce(t)
        _check(t.tolist() == [3] * 4, f"all_reduce {dtype}", t)
        checks += 1
    t = torch.full((4,), float(rank), device=dev)
    dist.broadcast(t, src=1)
    _check(t.tolist() == [1.0] * 4, "broadcast", t)
    t = torch.full((2,), float(rank + 1), device=dev)
    dist.reduce(t, dst=0)
    if rank == 0:
        _check(t.tolist() == [3.0, 3.0], "reduce", t)
    outs = [torch.empty(2, device=dev) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(rank), device=dev))
    _check([o.tolist() for o in outs] == [[0.0, 0.0], [1.0, 1.0]], "all_gather", outs)
    big = torch.empty(4, device=dev)
    dist.all_gather_into_tensor(big, torch.full((2,), float(rank), device=dev))
    _check(big.tolist() == [0.0, 0.0, 1.0, 1.0], "all_gather_into_tensor", big)
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, [torch.full((2,), float(10 * i + rank), device=dev) for i in range(size)])
    _check(out.tolist() == [20.0 * rank + 1] * 2, "reduce_scatter", out)
    dist.reduce_scatter_tensor(out, torch.arange(4, dtype=torch.float32, device=dev))
    _check(out.tolist() == [4.0 * rank, 4.0 * rank + 2], "reduce_scatter_tensor", out)
    outs = [torch.empty(1, device=dev) for _ in range(size)]
    dist.all_to_all(outs, [torch.full((1,), float(10 * rank + j), device=dev) for j in range(size)])
    _check([o.item() for o in outs] == [float(10 * j + rank) for j in range(size)], "all_to_all", outs)
    inp = torch.cat([torch.full((j + 1,), float(10 * rank + j), device=dev) for j in range(size)])
    outp = torch.empty(size * (rank + 1), device=dev)
    dist.all_to_all_single(outp, inp, [rank + 1] * size, [j + 1 for j in range(size)])
    _check(
        outp.tolist() == [float(10 * j + rank) for j in range(size) for _ in range(rank + 1)], "all_to_all_single", outp
    )
    g = [torch.empty(2, device=dev) for _ in range(size)] if rank == 1 else None
    dist.gather(torch.full((2,), float(rank), device=dev), g, dst=1)
    if rank == 1:
        _check([x.tolist() for x in g] == [[0.0, 0.0], [1.0, 1.0]], "gather", g)
    s = torch.empty(2, device=dev)
    dist.scatter(s, [torch.full((2,), float(5 + i), device=dev) for i in range(size)] if rank == 0 else None, src=0)
    _check(s.tolist() == [5.0 + rank] * 2, "scatter", s)
    dist.barrier()
    return checks + 12


def point_to_point() -> int:
    """Blocking send/recv, crossing isend/irecv, batch_isend_irecv, async Work."""
    dev = _device()
    rank = dist.get_rank()
    peer = 1 - rank
    t = torch.full((1000,), float(rank), device=dev)
    if rank == 0:
        dist.send(t, dst=1)
    else:
        src = dist.recv(t, src=0)
        _check(src == 0 and t[0].item() == 0.0, "send/recv", (src, t[0].item()))
    # both ranks send first and receive second: large messages, no deadlock
    mine = torch.full((1 << 20,), float(rank + 1), device=dev)
    got = torch.empty_like(mine)
    s = dist.isend(mine, dst=peer)
    r = dist.irecv(got, src=peer)
    r.wait()
    s.wait()
    _check(got[0].item() == float(peer + 1) and got[-1].item() == float(peer + 1), "isend/irecv", got[0].item())
    ops = [dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    work.wait(timeout=60)
    _check(work.is_completed(), "async all_reduce completed after wait(timeout)", work)
    work.synchronize()
    return 4


def new_group_and_multigpu() -> int:
    """A subgroup, and the multi-GPU collectives with this rank's share of the GPUs."""
    dev = _device()
    rank, size = dist.get_rank(), dist.get_world_size()
    sub = dist.new_group([0, 1])
    t = torch.ones(2, device=dev)
    dist.all_reduce(t, group=sub)
    _check(t.tolist() == [2.0, 2.0], "all_reduce on new_group", t)
    per_rank = max(1, torch.cuda.device_count() // size)
    devices = [rank * per_rank + i for i in range(per_rank)]
    n = len(devices)
    ts = [torch.full((3,), float(rank * n + d + 1), device=f"cuda:{x}") for d, x in enumerate(devices)]
    dist.all_reduce_multigpu(ts)
    total = sum(range(1, size * n + 1))
    _check(all(x.tolist() == [float(total)] * 3 for x in ts), "all_reduce_multigpu", ts)
    ts = [torch.full((1,), float(10 * rank + d), device=f"cuda:{x}") for d, x in enumerate(devices)]
    dist.broadcast_multigpu(ts, src=1, src_tensor=n - 1)
    _check(all(x.item() == float(10 + n - 1) for x in ts), "broadcast_multigpu", ts)
    ins = [torch.tensor([10 * rank + d], device=f"cuda:{x}") for d, x in enumerate(devices)]
    outs = [[torch.empty(1, dtype=torch.int64, device=f"cuda:{x}") for _ in range(size * n)] for x in devices]
    dist.all_gather_multigpu(outs, ins)
    want = [10 * k + j for k in range(size) for j in range(n)]
    _check(all([o.item() for o in lst] == want for lst in outs), "all_gather_multigpu", outs)
    ts = [torch.full((2,), float(rank * n + d + 1), device=f"cuda:{x}") for d, x in enumerate(devices)]
    dist.reduce_multigpu(ts, dst=0, dst_tensor=0)
    if rank == 0:
        _check(ts[0].tolist() == [float(total)] * 2, "reduce_multigpu", ts[0])
    return 5
