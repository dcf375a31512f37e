"""Real GPU tests of the nccl backend: CUDA tensors, CuPy, NCCL. Marked ``gpu``; they
skip (with the reason) where torch sees no CUDA device or CuPy/NCCL is missing.

- world size 1, in this process: every operation on CUDA tensors, Work semantics,
  refusals, and the multi-GPU collectives over all ``torch.cuda.device_count()`` GPUs;
- world size 2 (two processes through tdist.testing.World) when there are 2+ GPUs.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

import pytest
import tdist as dist
import tdist_nccl
import torch


def _skip_reason() -> Optional[str]:
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch"
    if importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install tdist-nccl[cuda12])"
    reason = tdist_nccl.unavailable_reason()
    if reason is not None:
        return reason
    try:
        from tdist_nccl.comm import load_nccl

        load_nccl()
    except dist.DistBackendError as exc:
        return str(exc)
    return None


SKIP = _skip_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(SKIP is not None, reason=f"GPU test: {SKIP}")]


@pytest.fixture
def world1():
    """tdist initialised with the nccl backend, world size 1, on cuda:0."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield torch.device("cuda", 0)
    finally:
        dist.destroy_process_group()


FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


@pytest.mark.parametrize("dtype", FLOATS + INTS, ids=str)
@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "AVG"])
def test_all_reduce_every_dtype_and_op(world1, dtype, op):
    t = torch.arange(1, 7, device=world1).to(dtype)
    reduce_op = getattr(dist.ReduceOp, op)
    dist.all_reduce(t, op=reduce_op)
    assert t.cpu().tolist() == torch.arange(1, 7).to(dtype).tolist()


def test_all_reduce_bool_complex_and_premul(world1):
    flags = torch.tensor([True, False], device=world1)
    dist.all_reduce(flags)
    assert flags.tolist() == [True, False]
    dist.all_reduce(flags, op=dist.ReduceOp.PRODUCT)
    assert flags.tolist() == [True, False]
    z = torch.tensor([1 + 2j], dtype=torch.complex64, device=world1)
    dist.all_reduce(z)
    assert z.item() == 1 + 2j
    t = torch.full((3,), 2.0, device=world1)
    dist.all_reduce(t, op=dist.make_premul_sum(torch.tensor([3.0], device=world1)))
    assert t.tolist() == [6.0] * 3


def test_every_other_operation(world1):
    dev = world1
    t = torch.arange(6, dtype=torch.float32, device=dev)
    dist.broadcast(t, src=0)
    assert t.tolist() == list(range(6))
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    assert t.tolist() == list(range(6))
    outs = [torch.empty(6, device=dev)]
    dist.all_gather(outs, t)
    assert torch.equal(outs[0], t)
    big = torch.empty(6, device=dev)
    dist.all_gather_into_tensor(big, t)
    assert torch.equal(big, t)
    out = torch.empty(6, device=dev)
    dist.reduce_scatter(out, [t * 2])
    assert torch.equal(out, t * 2)
    dist.reduce_scatter_tensor(out, t * 3)
    assert torch.equal(out, t * 3)
    a2a = [torch.empty(6, device=dev)]
    dist.all_to_all(a2a, [t + 1])
    assert torch.equal(a2a[0], t + 1)
    single = torch.empty(6, device=dev)
    dist.all_to_all_single(single, t + 2)
    assert torch.equal(single, t + 2)
    g = [torch.empty(6, device=dev)]
    dist.gather(t, g, dst=0)
    assert torch.equal(g[0], t)
    s = torch.empty(6, device=dev)
    dist.scatter(s, [t + 4], src=0)
    assert torch.equal(s, t + 4)
    dist.barrier()
    nc = torch.zeros(4, 4, device=dev)[:, 1]
    nc.fill_(2.0)
    dist.all_reduce(nc)
    assert nc.tolist() == [2.0] * 4


def test_async_work_completes_on_the_gpu(world1):
    t = torch.ones(1 << 20, device=world1)
    work = dist.all_reduce(t, async_op=True)
    assert isinstance(work, dist.Work)
    work.wait()  # orders the current stream after the all_reduce
    work.synchronize()  # blocks the host
    assert work.is_completed() and work.is_success()
    work = dist.broadcast(t, src=0, async_op=True)
    assert work.wait(timeout=60) and work.is_completed()
    assert work.get_future().wait() == [t]


def test_refusals_before_communicating(world1):
    t = torch.ones(2, dtype=torch.int32, device=world1)
    with pytest.raises(TypeError, match="bitwise"):
        dist.all_reduce(t, op=dist.ReduceOp.BAND)
    with pytest.raises(dist.DistError, match="recv_anysource"):
        dist.recv(t)
    with pytest.raises(dist.DistError, match="cpu"):
        dist.all_reduce(torch.ones(2))
    dist.all_reduce(t)  # the group still works
    assert t.tolist() == [1, 1]


def test_multigpu_collectives_on_every_local_gpu(world1):
    n = torch.cuda.device_count()
    ts = [torch.full((3,), float(d + 1), device=f"cuda:{d}") for d in range(n)]
    dist.all_reduce_multigpu(ts)
    total = float(sum(range(1, n + 1)))
    assert all(t.tolist() == [total] * 3 for t in ts)
    ts = [torch.full((2,), float(d), device=f"cuda:{d}") for d in range(n)]
    dist.broadcast_multigpu(ts, src=0, src_tensor=n - 1)
    assert all(t.tolist() == [float(n - 1)] * 2 for t in ts)
    ts = [torch.full((2,), float(d + 1), device=f"cuda:{d}") for d in range(n)]
    dist.reduce_multigpu(ts, dst=0, dst_tensor=n - 1)
    assert ts[n - 1].tolist() == [total] * 2
    ins = [torch.tensor([d], device=f"cuda:{d}") for d in range(n)]
    outs = [[torch.empty(1, dtype=torch.int64, device=f"cuda:{i}") for _ in range(n)] for i in range(n)]
    dist.all_gather_multigpu(outs, ins)
    assert all([o.item() for o in lst] == list(range(n)) for lst in outs)
    ts = [torch.full((2,), float(d + 1), device=f"cuda:{d}") for d in range(n)]
    dist.all_reduce_multigpu(ts, op=dist.ReduceOp.AVG)
    assert all(t.tolist() == [total / n] * 2 for t in ts)


needs_two = pytest.mark.skipif(SKIP is None and torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def world2():
    from tdist.testing import World

    with World("nccl", 2, pg_timeout=120.0, start_timeout=180.0) as world:
        yield world


@needs_two
@pytest.mark.timeout(600)
@pytest.mark.parametrize("body", ["collectives", "point_to_point", "new_group_and_multigpu"])
def test_world_of_two(world2, body):
    import nccl_gpu_bodies

    results = world2.run(getattr(nccl_gpu_bodies, body), timeout=300)
    assert len(set(results)) == 1 and results[0] > 0
