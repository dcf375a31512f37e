"""Single-process tests of the gloo backend: error mapping, reduction plans, device
choice, and every operation in a world of one."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch

import tdist
import tdist.plugin
from tdist_gloo import devices, plans, work


@pytest.fixture
def world():
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield tdist
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()


# ------------------------------------------------------------------- errors
def test_map_error_timeout():
    original = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    err = work.map_error(original, "all_reduce")
    assert isinstance(err, tdist.DistBackendTimeoutError) and isinstance(err, TimeoutError)
    assert "all_reduce" in str(err) and "gloo" in str(err) and str(original) in str(err)
    assert err.__cause__ is original


def test_map_error_other_failures():
    closed = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    err = work.map_error(closed, "broadcast")
    assert type(err) is tdist.DistBackendError and str(closed) in str(err)
    dist_backend = torch.distributed.DistBackendError("NCCL-ish failure")
    assert type(work.map_error(dist_backend, "x")) is tdist.DistBackendError
    assert isinstance(work.map_error(TimeoutError("late"), "x"), tdist.DistBackendTimeoutError)
    mine = tdist.DistStoreTimeoutError("already tdist's")
    assert work.map_error(mine, "x") is mine
    interrupt = KeyboardInterrupt()
    assert work.map_error(interrupt, "x") is interrupt


def test_failing_gloo_call_is_mapped(world):
    backend = tdist.group.WORLD.backends["cpu"]

    class Broken:
        def allreduce(self, *args):
            raise RuntimeError("gloo exploded")

    real = backend._pg
    backend._pg = Broken()
    try:
        with pytest.raises(tdist.DistBackendError, match="gloo exploded"):
            tdist.all_reduce(torch.ones(2))
    finally:
        backend._pg = real
    t = torch.ones(2)
    tdist.all_reduce(t)


# -------------------------------------------------------------- reductions
@pytest.mark.parametrize(
    "op, dtype, kind",
    [
        ("SUM", torch.float32, plans.NATIVE),
        ("AVG", torch.bfloat16, plans.NATIVE),
        ("BXOR", torch.bool, plans.NATIVE),
        ("PRODUCT", torch.int16, plans.WIDEN),
        ("MIN", torch.uint32, plans.WIDEN),
        ("MAX", torch.uint64, plans.U64),
        ("SUM", torch.float8_e5m2, plans.WIDEN),
        ("SUM", torch.complex64, plans.REAL),
        ("AVG", torch.complex128, plans.REAL),
    ],
)
def test_plans(op, dtype, kind):
    plan = plans.make_plan(getattr(tdist.ReduceOp, op), dtype, "all_reduce", None)
    assert plan.kind == kind
    assert plan.flip == (dtype == torch.uint64 and op in ("MIN", "MAX"))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint64])
def test_integer_avg_is_a_sum_then_a_division(dtype):
    """gloo has no integer AVG: it sums, and the result is divided (truncated) afterwards."""
    plan = plans.make_plan(tdist.ReduceOp.AVG, dtype, "all_reduce", None)
    assert plan.divide and plan.torch_op == plans.make_plan(tdist.ReduceOp.SUM, dtype, "all_reduce", None).torch_op


@pytest.mark.parametrize(
    "op, dtype, factor",
    [
        ("BAND", torch.float32, None),
        ("BOR", torch.float8_e4m3fn, None),
        ("PRODUCT", torch.complex64, None),
        ("MAX", torch.complex64, None),
        ("AVG", torch.bool, None),
        ("PREMUL_SUM", torch.int64, 0.5),
        ("PREMUL_SUM", torch.bool, 2),
        ("SUM", torch.qint8, None),
    ],
)
def test_invalid_plans_name_operation_and_backend(op, dtype, factor):
    with pytest.raises(TypeError) as caught:
        plans.make_plan(getattr(tdist.ReduceOp, op), dtype, "reduce", factor)
    message = str(caught.value)
    assert "reduce" in message and "gloo" in message and op in message


def test_invalid_reduction_raises_before_communicating(world):
    backend = tdist.group.WORLD.backends["cpu"]
    calls = []
    real = backend._pg

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    backend._pg = Spy()
    try:
        with pytest.raises(TypeError, match="gloo"):
            backend.all_reduce(torch.ones(2, dtype=torch.complex64), tdist.Reduction(tdist.ReduceOp.MIN))
        with pytest.raises(TypeError, match="gloo"):
            backend.reduce_scatter_tensor(torch.ones(1), torch.ones(1), tdist.Reduction(tdist.ReduceOp.BAND))
    finally:
        backend._pg = real
    assert calls == []


# ---------------------------------------------------------- network device
def test_local_address_for_stores(tmp_path):
    assert tdist.plugin.local_address_for(tdist.HashStore()) == "127.0.0.1"
    assert (
        tdist.plugin.local_address_for(tdist.PrefixStore("a", tdist.PrefixStore("b", tdist.HashStore()))) == "127.0.0.1"
    )
    store = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    try:
        assert tdist.plugin.local_address_for(tdist.PrefixStore("pg0", store)) == "127.0.0.1"
    finally:
        store.close()
    file_store = tdist.FileStore(str(tmp_path / "store"), 1)
    assert tdist.plugin.local_address_for(file_store) is None


def test_route_to():
    from tdist.plugin import route_address

    assert route_address("localhost") in ("127.0.0.1", "::1")
    assert route_address("127.0.0.5") == "127.0.0.1"
    assert route_address("no-such-host.invalid") is None
    try:
        outward = route_address("192.0.2.55")  # TEST-NET-1: only routing is consulted, nothing is sent
    except Exception:  # pragma: no cover - no route at all on this machine
        outward = None
    if outward is not None:
        socket.inet_aton(outward)


def test_make_devices_options(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert len(devices.make_devices(tdist.HashStore(), {})) == 1
    assert len(devices.make_devices(tdist.HashStore(), {"gloo_interface": "lo"})) == 1
    assert len(devices.make_devices(tdist.HashStore(), {"gloo_interface": "lo,lo"})) == 2
    assert len(devices.make_devices(tdist.HashStore(), {"gloo_hostname": "127.0.0.1"})) == 1
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert len(devices.make_devices(tdist.HashStore(), {})) == 1
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "no-such-interface0")
    with pytest.raises(RuntimeError):
        devices.make_devices(tdist.HashStore(), {})


# ------------------------------------------------------------ world of one
def test_every_operation_in_a_world_of_one(world):
    dist = world
    t = torch.arange(4.0)
    dist.broadcast(t, src=0)
    dist.all_reduce(t)
    assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    dist.reduce(t, dst=0, op=dist.ReduceOp.MAX)
    outs = [torch.zeros(4)]
    dist.all_gather(outs, t)
    assert torch.equal(outs[0], t)
    big = torch.zeros(4)
    dist.all_gather_into_tensor(big, t)
    assert torch.equal(big, t)
    dist.gather(t, [torch.zeros(4)], dst=0)
    out = torch.zeros(4)
    dist.scatter(out, [t], src=0)
    assert torch.equal(out, t)
    out = torch.zeros(4)
    dist.reduce_scatter(out, [t])
    assert torch.equal(out, t)
    out = torch.zeros(4)
    dist.reduce_scatter_tensor(out, t)
    assert torch.equal(out, t)
    outs = [torch.zeros(4)]
    dist.all_to_all(outs, [t])
    assert torch.equal(outs[0], t)
    out = torch.zeros(4)
    dist.all_to_all_single(out, t)
    assert torch.equal(out, t)
    dist.barrier()
    w = dist.all_reduce(t, async_op=True)
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert w.result()[0] is t
    with pytest.raises(tdist.DistBackendError, match="only defined for receives"):
        w.source_rank()
    u = torch.tensor([3, 1], dtype=torch.int16)
    dist.all_reduce(u, op=dist.ReduceOp.PRODUCT)
    assert u.tolist() == [3, 1]
    e = torch.zeros(0)
    dist.all_reduce(e)
    dist.broadcast(e, src=0)
    assert repr(tdist.group.WORLD.backends["cpu"]).startswith("<GlooBackend")


def test_subgroups_get_their_own_process_group(world):
    dist = world
    g = dist.new_group([0])
    backend = g.backends["cpu"]
    assert backend.process_group is not tdist.group.WORLD.backends["cpu"].process_group
    t = torch.ones(2)
    dist.all_reduce(t, group=g)
    assert t.tolist() == [1.0, 1.0]
    dist.destroy_process_group(g)


def test_shutdown_is_idempotent(world):
    backend = tdist.group.WORLD.backends["cpu"]
    tdist.destroy_process_group()
    backend.shutdown()


def test_a_failed_operation_releases_the_group(world):
    """After gloo fails an operation the torch group is released (closing its connections,
    so peers fail at once), and every later call says why instead of hanging."""
    backend = tdist.group.WORLD.backends["cpu"]
    released = backend._pg
    backend._broken(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert backend._pg is not released
    with pytest.raises(tdist.DistBackendError, match=r"unusable after an earlier failure .*Connection closed by peer"):
        tdist.all_reduce(torch.ones(2))
    backend._broken(RuntimeError("a second failure"))  # idempotent
    tdist.destroy_process_group()  # shutting a broken group down raises nothing
