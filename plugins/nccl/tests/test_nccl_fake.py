"""NcclBackend's logic driven by a FAKE ``cupy.cuda.nccl`` and FAKE CUDA streams/events.

*** FAKES, NOT NCCL: see nccl_fakes.py. These tests only exist because no GPU (and no
CuPy) is available where this project's CI runs. They check the call sequences the
backend issues (group calls, peers, NCCL ranks, roots, counts, type/op codes) and the
host-side bookkeeping (pointer offsets, staging, AVG/PREMUL_SUM handling, Work
semantics), with "device memory" being CPU tensors read and written by the fake. They
prove nothing about real NCCL, CUDA streams or CuPy: test_nccl_gpu.py does that. ***

Every test runs three times: against the surface of CuPy >= 14 (unique ids are bytes),
of CuPy < 14 (tuples of chars), and -- where CuPy and libnccl are installed, as
``make test`` does -- with each call also checked by the real ``cupy.cuda.nccl``
binding's argument conversion (see ``RealBinding``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import tdist
import torch
from nccl_fakes import CONSTANTS, FakeCuda, FakeNccl, RealBinding, fake_cupy, on, run_ranks
from tdist import ReduceOp, Reduction, make_premul_sum
from tdist_nccl.backend import NcclBackend, create_backend


def _real_binding() -> RealBinding:
    """The installed ``cupy.cuda.nccl``; skips where CuPy/libnccl is missing or a GPU is
    present (there the real constructor would really connect: the gpu tests run instead)."""
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns when libnccl cannot be loaded
            from cupy.cuda import nccl
    except Exception as exc:  # noqa: BLE001 - any import failure means "not here"
        pytest.skip(f"CuPy is not installed ({type(exc).__name__}: {exc})")
    if not getattr(nccl, "available", False):
        pytest.skip("CuPy is installed but cannot load libnccl (pip install nvidia-nccl-cu12)")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: test_nccl_gpu.py exercises the real binding")
    return RealBinding(nccl)


@pytest.fixture(autouse=True, params=["cupy14", "cupy13", "real-binding"])
def cupy_surface(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a FakeNccl() mimics in this run (see the module docstring)."""
    if request.param == "real-binding":
        binding = _real_binding()
        defaults = {"unique_id": type(binding.module.get_unique_id()), "binding": binding}
    else:
        defaults = {"unique_id": bytes if request.param == "cupy14" else tuple, "binding": None}
    monkeypatch.setattr(FakeNccl, "defaults", defaults)


U8 = CONSTANTS["NCCL_UINT8"]
F32 = CONSTANTS["NCCL_FLOAT32"]
R = Reduction


def make_world(n: int, nccl: FakeNccl, cuda: Any = None, **kw: Any) -> list[NcclBackend]:
    store = tdist.HashStore()
    return [
        NcclBackend(
            store=store, rank=r, size=n, timeout=timedelta(seconds=20), nccl=nccl, cuda=cuda or FakeCuda(), **kw
        )
        for r in range(n)
    ]


def calls(nccl: FakeNccl, thread: str, *names: str) -> list[tuple]:
    """One thread's log entries, optionally only those named ``names``."""
    return [e for e in nccl.by_thread[thread] if not names or e[0] in names]


# ------------------------------------------------------------------ the factory
def test_factory_loads_nccl_from_cupy_and_creates_the_communicator_lazily(monkeypatch):
    """The fake module is injected as ``cupy.cuda.nccl`` in sys.modules."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with fake_cupy(FakeNccl(version=22304)) as nccl:
        b = create_backend(
            store=tdist.HashStore(),
            rank=0,
            world_size=2,
            timeout=timedelta(seconds=5),
            options={"unrelated": 1},
            global_ranks=[3, 5],
        )
    assert isinstance(b, NcclBackend) and b.nccl is nccl and b.version == 22304
    assert (b.rank, b.size, b.global_ranks) == (0, 2, [3, 5])
    assert b.comm is None and nccl.log == []  # no communicator until the first operation
    b.shutdown()


# ------------------------------------------------------------------ refusals
def test_bitwise_ops_refused_before_any_communication():
    nccl = FakeNccl()
    (b,) = make_world(1, nccl)
    t = torch.ones(4, dtype=torch.int32)
    for op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        with pytest.raises(TypeError, match="NCCL has no bitwise reductions"):
            b.all_reduce(t, R(op))
        with pytest.raises(TypeError, match="NCCL has no bitwise reductions"):
            b.reduce(t, 0, R(op))
        with pytest.raises(TypeError, match="NCCL has no bitwise reductions"):
            b.reduce_scatter(t[:2], [t[:2], t[2:]], R(op))
    assert nccl.log == [] and nccl.created == []  # not even a communicator was made
    assert t.tolist() == [1, 1, 1, 1]


def test_recv_from_any_source_refused_before_any_communication():
    nccl = FakeNccl()
    b = make_world(2, nccl)[1]
    with pytest.raises(ValueError, match="cannot receive from any source"):
        b.recv(torch.zeros(3), None, 0)
    b.flush()
    assert nccl.log == []


def test_core_refuses_any_source_from_the_spec():
    """The core checks the spec before calling the backend: no 'recv_anysource' on cuda."""
    from tdist._groups import ProcessGroup
    from tdist._plugins import BackendRegistry
    from tdist_nccl import plugin

    registry = BackendRegistry()
    plugin.tdist_register_backends(registry=registry)
    spec = registry.get("nccl")
    b = make_world(2, FakeNccl())[0]
    pg = ProcessGroup("pg0", [0, 1], 0, {"cuda": b}, {"cuda": spec}, tdist.HashStore(), timedelta(seconds=5), "nccl")
    with pytest.raises(tdist.DistError, match="recv_anysource: not supported by backend 'nccl' on cuda tensors"):
        pg.backend_for("cuda", tdist.ANY_SOURCE_OP)
    assert pg.backend_for("cuda", "recv") is b


def test_tensor_on_another_device_than_the_communicator():
    nccl = FakeNccl()
    (b,) = make_world(1, nccl)
    b.all_reduce(on(0, torch.ones(2)), R(ReduceOp.SUM)).wait()
    before = len(nccl.log)
    with pytest.raises(ValueError, match="communicator is on cuda:0, the tensor on cuda:1"):
        b.broadcast(on(1, torch.ones(2)), 0)
    assert len(nccl.log) == before


# ------------------------------------------------------------------ world size 1: every op
def test_world_size_one_every_operation():
    nccl = FakeNccl()
    (b,) = make_world(1, nccl)
    t = torch.arange(6, dtype=torch.float32)
    b.broadcast(t, 0).wait()
    assert t.tolist() == list(range(6))
    for op, expected in [
        (ReduceOp.SUM, 3.0),
        (ReduceOp.PRODUCT, 3.0),
        (ReduceOp.MIN, 3.0),
        (ReduceOp.MAX, 3.0),
        (ReduceOp.AVG, 3.0),
    ]:
        x = torch.full((3,), 3.0)
        b.all_reduce(x, R(op)).wait()
        assert x.tolist() == [expected] * 3, op
    x = torch.full((3,), 3.0)
    b.all_reduce(x, make_premul_sum(2.0)).wait()
    assert x.tolist() == [6.0] * 3
    out = [torch.empty(2, 3)]
    b.all_gather(out, t.view(2, 3)).wait()
    assert torch.equal(out[0], t.view(2, 3))
    big = torch.empty(6)
    b.all_gather_into_tensor(big, t).wait()
    assert torch.equal(big, t)
    rs = torch.empty(6)
    b.reduce_scatter(rs, [t], R(ReduceOp.SUM)).wait()
    assert torch.equal(rs, t)
    b.reduce_scatter_tensor(rs, t * 2, R(ReduceOp.MAX)).wait()
    assert torch.equal(rs, t * 2)
    a2a = [torch.empty(6)]
    b.all_to_all(a2a, [t]).wait()
    assert torch.equal(a2a[0], t)
    single = torch.empty(6)
    b.all_to_all_single(single, t, [6], [6]).wait()
    assert torch.equal(single, t)
    g = [torch.empty(6)]
    b.gather(t, g, 0).wait()
    assert torch.equal(g[0], t)
    s = torch.empty(6)
    b.scatter(s, [t + 1], 0).wait()
    assert torch.equal(s, t + 1)
    b.barrier().wait()
    assert not any(e[0] in ("send", "recv") for e in nccl.log)  # no self send/recv at world size 1


# ------------------------------------------------------------------ world size 3: data and sequences
def test_collectives_world_of_three():
    nccl = FakeNccl()
    world = make_world(3, nccl)

    def body(r: int) -> dict:
        b = world[r]
        out: dict = {}
        t = torch.full((4,), float(r + 1))
        b.broadcast(t, 2).wait()
        out["broadcast"] = t.tolist()
        for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG):
            x = torch.full((2,), float(r + 1))
            b.all_reduce(x, R(op)).wait()
            out[op.name] = x.tolist()
        x = torch.full((2,), float(r + 1))
        b.all_reduce(x, make_premul_sum(torch.tensor([0.5]))).wait()
        out["premul"] = x.tolist()
        x = torch.full((2,), float(r + 1))
        b.reduce(x, 1, R(ReduceOp.SUM)).wait()
        out["reduce"] = x.tolist()
        flags = torch.tensor([r == 0, True, False])
        b.all_reduce(flags, R(ReduceOp.SUM)).wait()
        out["bool_sum"] = flags.tolist()
        flags = torch.tensor([r == 0, True, False])
        b.all_reduce(flags, R(ReduceOp.PRODUCT)).wait()
        out["bool_prod"] = flags.tolist()
        z = torch.full((2,), complex(r, 1), dtype=torch.complex64)
        b.all_reduce(z, R(ReduceOp.SUM)).wait()
        out["complex"] = z.tolist()
        gathered = [torch.empty(2, dtype=torch.int64) for _ in range(3)]
        b.all_gather(gathered, torch.tensor([r, 10 * r])).wait()
        out["all_gather"] = [g.tolist() for g in gathered]
        big = torch.empty(6, dtype=torch.int64)
        b.all_gather_into_tensor(big, torch.tensor([r, -r])).wait()
        out["all_gather_into_tensor"] = big.tolist()
        rs = torch.empty(2)
        b.reduce_scatter(rs, [torch.full((2,), float(10 * i + r)) for i in range(3)], R(ReduceOp.SUM)).wait()
        out["reduce_scatter"] = rs.tolist()
        src = torch.arange(6, dtype=torch.float32) + r
        rst = torch.empty(2)
        b.reduce_scatter_tensor(rst, src, make_premul_sum(2)).wait()
        out["reduce_scatter_tensor"] = rst.tolist()
        out["rst_input_untouched"] = torch.equal(src, torch.arange(6, dtype=torch.float32) + r)
        ins = [torch.tensor([100 * r + j]) for j in range(3)]
        outs = [torch.empty(1, dtype=torch.int64) for _ in range(3)]
        b.all_to_all(outs, ins).wait()
        out["all_to_all"] = [o.item() for o in outs]
        # uneven all_to_all_single: rank r sends (j + 1) rows to rank j
        rows = [j + 1 for j in range(3)]
        inp = torch.cat([torch.full((j + 1, 2), 10 * r + j) for j in range(3)])
        outp = torch.empty(3 * (r + 1), 2, dtype=torch.int64)
        b.all_to_all_single(outp, inp.long(), [r + 1] * 3, rows).wait()
        out["all_to_all_single"] = outp[:, 0].tolist()
        g = [torch.empty(2) for _ in range(3)] if r == 0 else None
        b.gather(torch.full((2,), float(r)), g, 0).wait()
        out["gather"] = [x.tolist() for x in g] if g else None
        s = torch.empty(2)
        b.scatter(s, [torch.full((2,), float(7 + i)) for i in range(3)] if r == 1 else None, 1).wait()
        out["scatter"] = s.tolist()
        b.barrier().wait()
        return out

    res = run_ranks(3, body)
    for r, out in enumerate(res):
        assert out["broadcast"] == [3.0] * 4
        assert out["SUM"] == [6.0, 6.0] and out["PRODUCT"] == [6.0, 6.0]
        assert out["MIN"] == [1.0, 1.0] and out["MAX"] == [3.0, 3.0] and out["AVG"] == [2.0, 2.0]
        assert out["premul"] == [3.0, 3.0]
        assert out["bool_sum"] == [True, True, False] and out["bool_prod"] == [False, True, False]
        assert out["complex"] == [complex(3, 3)] * 2
        assert out["all_gather"] == [[0, 0], [1, 10], [2, 20]]
        assert out["all_gather_into_tensor"] == [0, 0, 1, -1, 2, -2]
        assert out["reduce_scatter"] == [30.0 * r + 3] * 2
        full = sum(2 * (torch.arange(6, dtype=torch.float32) + k) for k in range(3))
        assert out["reduce_scatter_tensor"] == full[2 * r : 2 * r + 2].tolist() and out["rst_input_untouched"]
        assert out["all_to_all"] == [100 * j + r for j in range(3)]
        assert out["all_to_all_single"] == [10 * j + r for j in range(3) for _ in range(r + 1)]
        assert out["scatter"] == [7.0 + r] * 2
    assert res[1]["reduce"] == [6.0, 6.0]
    assert res[0]["gather"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_one_communicator_per_group_unique_id_from_rank_zero():
    nccl = FakeNccl()
    world = make_world(3, nccl)
    run_ranks(3, lambda r: [world[r].all_reduce(torch.ones(1), R(ReduceOp.SUM)).wait() for _ in range(3)])
    assert len(nccl.created) == 3
    assert {c.uid for c in nccl.created} == {nccl.created[0].uid}
    assert sorted(c.rank for c in nccl.created) == [0, 1, 2] and {c.ndev for c in nccl.created} == {3}


def test_all_to_all_call_sequence():
    nccl = FakeNccl()
    world = make_world(3, nccl)

    def body(r: int) -> None:
        ins = [torch.zeros(2) for _ in range(3)]
        outs = [torch.empty(2) for _ in range(3)]
        world[r].all_to_all(outs, ins).wait()

    run_ranks(3, body)
    seq = [e[:3] for e in calls(nccl, "rank0", "groupStart", "groupEnd", "send", "recv")]
    assert seq == [("groupStart",), ("send", 0, 1), ("recv", 0, 1), ("send", 0, 2), ("recv", 0, 2), ("groupEnd",)]
    sends = calls(nccl, "rank2", "send")
    assert [(e[2], e[3], e[4]) for e in sends] == [(0, 8, U8), (1, 8, U8)]  # 2 float32 = 8 bytes


def test_gather_and_scatter_are_grouped_send_recv():
    nccl = FakeNccl()
    world = make_world(3, nccl)

    def body(r: int) -> None:
        b = world[r]
        b.gather(torch.ones(1), [torch.empty(1) for _ in range(3)] if r == 2 else None, 2).wait()
        b.scatter(torch.empty(1), [torch.ones(1) for _ in range(3)] if r == 0 else None, 0).wait()

    run_ranks(3, body)
    root = [e[:3] for e in calls(nccl, "rank2", "groupStart", "groupEnd", "send", "recv")]
    assert root[:4] == [("groupStart",), ("recv", 2, 0), ("recv", 2, 1), ("groupEnd",)]
    leaf = [e[:3] for e in calls(nccl, "rank1", "groupStart", "groupEnd", "send", "recv")]
    assert leaf == [("groupStart",), ("send", 1, 2), ("groupEnd",), ("groupStart",), ("recv", 1, 0), ("groupEnd",)]


def test_avg_on_old_nccl_is_sum_then_divide():
    nccl = FakeNccl(version=20907)
    world = make_world(2, nccl)

    def body(r: int) -> list:
        x = torch.full((2,), float(2 * r + 1))
        world[r].all_reduce(x, R(ReduceOp.AVG)).wait()
        return x.tolist()

    assert run_ranks(2, body) == [[2.0, 2.0]] * 2
    ops = {e[4] for e in nccl.log if e[0] == "allReduce"}
    assert ops == {CONSTANTS["NCCL_SUM"]}


def test_non_contiguous_tensors_are_staged():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> list:
        base = torch.zeros(3, 4)
        col = base[:, 1]  # not contiguous
        col.fill_(r + 1)
        world[r].all_reduce(col, R(ReduceOp.SUM)).wait()
        return base.tolist()

    for got in run_ranks(2, body):
        assert got == [[0.0, 3.0, 0.0, 0.0]] * 3


# ------------------------------------------------------------------ point-to-point batching
def test_p2p_is_queued_until_waited_then_issued_in_one_group():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> list:
        b = world[r]
        peer = 1 - r
        got = torch.empty(3)
        # both ranks send first, then receive: fine, because both go out in one group
        s = b.send(torch.full((3,), float(r + 5)), peer, 0)
        q = b.recv(got, peer, 0)
        assert calls(nccl, f"rank{r}", "send", "recv") == []  # nothing issued yet
        q.wait()
        assert s.is_completed() and q.source_rank() == peer
        return got.tolist()

    assert run_ranks(2, body) == [[6.0] * 3, [5.0] * 3]
    seq = [e[0] for e in calls(nccl, "rank0", "groupStart", "groupEnd", "send", "recv")]
    assert seq == ["groupStart", "send", "recv", "groupEnd"]


def test_p2p_flushed_before_the_next_collective():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> float:
        b = world[r]
        got = torch.zeros(1)
        work = b.send(torch.ones(1), 1, 0) if r == 0 else b.recv(got, 0, 0)
        b.all_reduce(torch.ones(1), R(ReduceOp.SUM)).wait()  # issues the queued op first
        assert work.is_completed()
        return got.item()

    assert run_ranks(2, body) == [0.0, 1.0]
    assert [e[0] for e in calls(nccl, "rank1", "recv", "allReduce")] == ["recv", "allReduce"]


def test_shutdown_issues_queued_p2p_and_destroys():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> float:
        got = torch.zeros(1)
        if r == 0:
            world[0].send(torch.full((1,), 4.0), 1, 0)
        else:
            world[1].recv(got, 0, 0)
        world[r].shutdown()
        return got.item()

    assert run_ranks(2, body) == [0.0, 4.0]
    assert all(c.destroyed for c in nccl.created)
    with pytest.raises(tdist.DistBackendError, match="destroyed"):
        world[0].all_reduce(torch.ones(1), R(ReduceOp.SUM))


# ------------------------------------------------------------------ Work semantics
def test_work_wait_orders_the_stream_without_blocking_the_host():
    cuda = FakeCuda(events_done=False)
    (b,) = make_world(1, FakeNccl(), cuda)
    work = b.all_reduce(torch.ones(2), R(ReduceOp.SUM))
    assert isinstance(work, tdist.Work)
    assert not work.is_completed()
    assert work.wait() is True
    assert ("stream_wait", 0) in cuda.log and ("synchronize", 0) not in cuda.log
    with pytest.raises(tdist.DistBackendTimeoutError, match="within 0.05 s"):
        work.wait(timeout=0.05)


def test_work_completes_on_its_event():
    cuda = FakeCuda(events_done=True)
    (b,) = make_world(1, FakeNccl(), cuda)
    t = torch.ones(2)
    work = b.all_reduce(t, R(ReduceOp.SUM))
    assert work.is_completed() and work.is_success()
    work.synchronize()
    assert ("synchronize", 0) in cuda.log
    assert work.result() == [t]
    assert work.get_future().wait() == [t]


def test_barrier_blocks_the_host():
    cuda = FakeCuda()
    (b,) = make_world(1, FakeNccl(), cuda)
    b.barrier().wait()
    assert ("synchronize", 0) in cuda.log


def test_done_callbacks_run_from_a_watcher():
    import threading

    (b,) = make_world(1, FakeNccl(), FakeCuda())
    fired = threading.Event()
    work = b.all_reduce(torch.ones(1), R(ReduceOp.SUM))
    work.add_done_callback(lambda w: fired.set())
    assert fired.wait(5)


# ------------------------------------------------------------------ multi-GPU
def test_multigpu_clique_rank_numbering_and_group_init():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> None:
        tensors = [on(0, torch.ones(2)), on(1, torch.ones(2))]
        world[r].all_reduce_multigpu(tensors, R(ReduceOp.SUM)).wait()

    run_ranks(2, body)
    for r in range(2):
        inits = calls(nccl, f"rank{r}", "init", "groupStart", "groupEnd")
        # rank r's device d is NCCL rank r * 2 + d of a clique of 4, created inside one group
        assert inits == [
            ("groupStart",),
            ("init", 2 * r, 4, 0, True),
            ("init", 2 * r + 1, 4, 1, True),
            ("groupEnd",),
            ("groupStart",),
            ("groupEnd",),
        ]
    assert len({c.uid for c in nccl.created}) == 1


def test_multigpu_collectives_world_of_two_with_two_devices():
    nccl = FakeNccl()
    world = make_world(2, nccl)

    def body(r: int) -> dict:
        b = world[r]
        out: dict = {}
        ts = [on(d, torch.full((2,), float(2 * r + d + 1))) for d in range(2)]  # 1, 2 | 3, 4
        b.all_reduce_multigpu(ts, R(ReduceOp.SUM)).wait()
        out["all_reduce"] = [t.tolist() for t in ts]
        ts = [on(d, torch.full((2,), float(2 * r + d + 1))) for d in range(2)]
        b.all_reduce_multigpu(ts, R(ReduceOp.AVG)).wait()
        out["avg"] = [t.tolist() for t in ts]
        ts = [on(d, torch.full((2,), float(2 * r + d + 1))) for d in range(2)]
        b.reduce_multigpu(ts, 0, R(ReduceOp.MAX), 1).wait()
        out["reduce"] = [t.tolist() for t in ts]
        ts = [on(d, torch.full((1,), float(10 * r + d))) for d in range(2)]
        b.broadcast_multigpu(ts, 1, 1).wait()
        out["broadcast"] = [t.item() for t in ts]
        ins = [on(d, torch.tensor([10 * r + d])) for d in range(2)]
        outs = [[on(i, torch.empty(1, dtype=torch.int64)) for _ in range(4)] for i in range(2)]
        b.all_gather_multigpu(outs, ins).wait()
        out["all_gather"] = [[t.item() for t in lst] for lst in outs]
        return out

    res = run_ranks(2, body)
    for out in res:
        assert out["all_reduce"] == [[10.0, 10.0]] * 2
        assert out["avg"] == [[2.5, 2.5]] * 2
        assert out["broadcast"] == [11.0, 11.0]  # rank 1's tensor 1
        # output_tensor_lists[i][k * 2 + j] is input j of rank k
        assert out["all_gather"] == [[0, 1, 10, 11]] * 2
    assert res[0]["reduce"][1] == [4.0, 4.0]
    # ("reduce", nccl_rank, count, type, op, root, stream): NCCL root = root * n_local + dst_tensor
    assert {e[5] for e in nccl.log if e[0] == "reduce"} == {0 * 2 + 1}
    assert {e[4] for e in nccl.log if e[0] == "broadcast"} == {1 * 2 + 1}
    # each device's call goes to that device's stream
    assert {(e[1] % 2, e[-1]) for e in nccl.log if e[0] == "allReduce"} == {(0, 1000), (1, 1001)}


def test_multigpu_single_process_uses_init_all():
    nccl = FakeNccl()
    (b,) = make_world(1, nccl)
    ts = [on(d, torch.full((1,), float(d + 1))) for d in range(3)]
    b.all_reduce_multigpu(ts, make_premul_sum(2.0)).wait()
    assert [t.item() for t in ts] == [12.0] * 3
    assert ("initAll", (0, 1, 2)) in nccl.log


def test_multigpu_refuses_repeated_devices_and_changed_devices():
    nccl = FakeNccl()
    (b,) = make_world(1, nccl)
    with pytest.raises(ValueError, match="different GPU"):
        b.all_reduce_multigpu([on(0, torch.ones(1)), on(0, torch.ones(1))], R(ReduceOp.SUM))
    b.all_reduce_multigpu([on(0, torch.ones(1)), on(1, torch.ones(1))], R(ReduceOp.SUM)).wait()
    with pytest.raises(ValueError, match="same devices"):
        b.all_reduce_multigpu([on(1, torch.ones(1)), on(0, torch.ones(1))], R(ReduceOp.SUM))
    with pytest.raises(TypeError, match="bitwise"):
        b.all_reduce_multigpu(
            [on(0, torch.ones(1, dtype=torch.int32)), on(1, torch.ones(1, dtype=torch.int32))], R(ReduceOp.BOR)
        )


# ------------------------------------------------------------------ through the core (world size 1)
class _FakeNcclPlugin:
    """A test-only plugin registering NcclBackend on the fakes under another name, serving
    CPU tensors (fake "device" memory), so the core's dispatch can be exercised here."""

    TDIST_HOOKSPEC_VERSION = "1.0"

    def __init__(self, nccl: FakeNccl) -> None:
        self.nccl = nccl

    @tdist.hookimpl
    def tdist_register_backends(self, registry: Any) -> None:
        from tdist_nccl import OPERATIONS

        def factory(*, store: Any, rank: int, world_size: int, timeout: Any, options: Any, global_ranks: Any) -> Any:
            return NcclBackend(
                store=store,
                rank=rank,
                size=world_size,
                timeout=timeout,
                nccl=self.nccl,
                cuda=FakeCuda(),
                global_ranks=global_ranks,
            )

        registry.add(tdist.BackendSpec(name="fakenccl", factory=factory, operations={"cpu": OPERATIONS["cuda"]}))


@pytest.fixture
def fake_nccl_group():
    from tdist._plugins import plugins, reset_plugins

    nccl = FakeNccl()
    plugins().register(_FakeNcclPlugin(nccl), "fakenccl")
    try:
        tdist.init_process_group("fakenccl", store=tdist.HashStore(), rank=0, world_size=1)
        yield nccl
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
        reset_plugins()


def test_core_dispatch_reaches_native_multigpu_methods(fake_nccl_group):
    nccl = fake_nccl_group
    ts = [on(0, torch.ones(2)), on(1, torch.full((2,), 2.0))]
    tdist.all_reduce_multigpu(ts, op=ReduceOp.SUM)
    assert [t.tolist() for t in ts] == [[3.0, 3.0]] * 2
    assert ("initAll", (0, 1)) in nccl.log
    outs = [[on(0, torch.empty(2))] * 1 + [on(0, torch.empty(2))], [on(1, torch.empty(2)), on(1, torch.empty(2))]]
    tdist.all_gather_multigpu(outs, ts)
    tdist.broadcast_multigpu(ts, src=0, src_tensor=1)
    tdist.reduce_multigpu(ts, dst=0, dst_tensor=0)
    assert sum(1 for e in nccl.log if e[0] in ("allGather", "broadcast", "reduce")) == 6


def test_core_refuses_bitwise_and_any_source_without_calling_nccl(fake_nccl_group):
    nccl = fake_nccl_group
    with pytest.raises(TypeError, match="bitwise"):
        tdist.all_reduce(torch.ones(2, dtype=torch.int64), op=ReduceOp.BAND)
    with pytest.raises(tdist.DistError, match="recv_anysource"):
        tdist.recv(torch.zeros(1))
    assert not any(e[0] in ("allReduce", "recv") for e in nccl.log)
    work = tdist.all_reduce(torch.ones(2), async_op=True)
    assert work.wait() and work.is_completed()
