"""Plugin loading: isolation of broken plugins, disabling, the versioned contract."""

from __future__ import annotations

from datetime import timedelta
import subprocess
import sys
import types

import pytest

import tdist
from tdist._plugins import Plugins


class FakeEntryPoint:
    def __init__(self, name: str, target: object, dist: str = "fake-dist", version: str = "1.2.3") -> None:
        self.name = name
        self._target = target
        self.dist = types.SimpleNamespace(name=dist, version=version)

    def load(self) -> object:
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def make_backend_plugin(name: str, version: str = "1.0") -> types.ModuleType:
    module = types.ModuleType(f"plugin_{name}")
    module.TDIST_HOOKSPEC_VERSION = version

    @tdist.hookimpl
    def tdist_register_backends(registry):
        registry.add(
            tdist.BackendSpec(name=name, factory=lambda **kw: None, operations={"cpu": frozenset({"barrier"})})
        )

    module.tdist_register_backends = tdist_register_backends
    return module


def test_broken_plugin_is_isolated_and_reported():
    good = make_backend_plugin("good")
    broken = FakeEntryPoint("broken", ImportError("No module named 'cupy'"))
    loaded = Plugins([broken, FakeEntryPoint("good", good)])
    assert loaded.backends.names() == ["good"]
    record = next(r for r in loaded.records if r.name == "broken")
    assert not record.loaded and "No module named 'cupy'" in record.error
    assert "could not be loaded" in loaded.missing_backend_message("broken")


def test_disabled_plugins_env(monkeypatch):
    monkeypatch.setenv("TDIST_DISABLED_PLUGINS", "good, other")
    loaded = Plugins([FakeEntryPoint("good", make_backend_plugin("good"))])
    assert loaded.backends.names() == []
    assert "TDIST_DISABLED_PLUGINS" in loaded.records[0].error


@pytest.mark.parametrize("version", ["2.0", "1.9", None, "x"])
def test_incompatible_contract_version_is_refused(version):
    plugin = make_backend_plugin("future", version)
    if version is None:
        del plugin.TDIST_HOOKSPEC_VERSION
    loaded = Plugins([FakeEntryPoint("future", plugin)])
    assert loaded.backends.names() == []
    assert "1.0" in loaded.records[0].error  # says which versions fit


def test_duplicate_backend_name_reported():
    loaded = Plugins(
        [FakeEntryPoint("a", make_backend_plugin("same")), FakeEntryPoint("b", make_backend_plugin("same"))]
    )
    assert loaded.backends.names() == ["same"]
    assert "registered twice" in loaded.records[1].error


def test_missing_backend_message_names_installed_and_package():
    loaded = Plugins([FakeEntryPoint("good", make_backend_plugin("good"))])
    message = loaded.missing_backend_message("nccl")
    assert "installed: good" in message and "pip install tdist-nccl" in message


def test_import_tdist_loads_no_backend_dependency():
    code = (
        "import sys, tdist; bad = [m for m in sys.modules if m.split('.')[0] in "
        "('mpi4py', 'cupy', 'tdist_tcp', 'tdist_gloo', 'tdist_mpi', 'tdist_nccl')]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_builtin_rendezvous_registered_through_entry_points():
    assert {"env", "tcp", "file"} <= set(tdist._plugins.plugins().rendezvous.schemes())


def test_info_lists_backends_and_table():
    out = subprocess.run([sys.executable, "-m", "tdist", "info"], capture_output=True, text=True, check=True).stdout
    assert "tcp" in out and "all_reduce" in out and "env://" in out


def test_work_hooks_observe_issue_and_completion():
    import types
    from datetime import timedelta

    import torch

    from tdist._plugins import plugins, reset_plugins

    seen: list = []
    observer = types.ModuleType("observer")
    observer.TDIST_HOOKSPEC_VERSION = "1.0"

    @tdist.hookimpl
    def tdist_work_issued(info):
        seen.append(("issued", info.op, info.shapes, info.nbytes))

    @tdist.hookimpl
    def tdist_work_completed(info, duration):
        seen.append(("completed", info.op, duration >= 0))

    observer.tdist_work_issued = tdist_work_issued
    observer.tdist_work_completed = tdist_work_completed
    reset_plugins()
    try:
        plugins().register(observer, "observer")
        tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
        try:
            tdist.all_reduce(torch.ones(2, 3))
        finally:
            tdist.destroy_process_group()
    finally:
        reset_plugins()
    assert seen == [("issued", "all_reduce", [(2, 3)], 24), ("completed", "all_reduce", True)]


def test_misspelled_hook_refuses_the_plugin_and_names_the_hook():
    plugin = make_backend_plugin("typo")

    @tdist.hookimpl
    def tdist_work_complete(info, duration):  # the contract's hook is tdist_work_completed
        pass

    plugin.tdist_work_complete = tdist_work_complete
    loaded = Plugins([FakeEntryPoint("typo", plugin), FakeEntryPoint("good", make_backend_plugin("good"))])
    record = next(r for r in loaded.records if r.name == "typo")
    assert not record.loaded
    assert "'tdist_work_complete'" in record.error and "did you mean 'tdist_work_completed'" in record.error
    assert loaded.backends.names() == ["good"]
    with pytest.raises(tdist.DistError, match="tdist_work_complete"):
        Plugins([]).register(plugin, "typo")


def test_failing_registration_leaves_nothing_of_the_plugin_behind():
    plugin = types.ModuleType("half")
    plugin.TDIST_HOOKSPEC_VERSION = "1.0"

    @tdist.hookimpl
    def tdist_register_backends(registry):
        registry.add(tdist.BackendSpec(name="half", factory=lambda **kw: None, operations={"cpu": frozenset()}))

    @tdist.hookimpl
    def tdist_register_rendezvous(registry):
        registry.add("half", lambda *a, **kw: None)
        raise RuntimeError("boom after registering")

    @tdist.hookimpl
    def tdist_work_issued(info):
        pass

    plugin.tdist_register_backends = tdist_register_backends
    plugin.tdist_register_rendezvous = tdist_register_rendezvous
    plugin.tdist_work_issued = tdist_work_issued
    loaded = Plugins([FakeEntryPoint("half", plugin), FakeEntryPoint("good", make_backend_plugin("good"))])
    assert "boom after registering" in loaded.records[0].error
    assert loaded.backends.names() == ["good"] and "half" not in loaded.rendezvous.schemes()
    assert not loaded.observes_work
    with pytest.raises(tdist.DistError, match="boom after registering"):
        Plugins([]).register(plugin, "half")


def test_a_work_completes_exactly_once():
    work = tdist.Work("all_reduce")
    work.set_result(["first"])
    with pytest.raises(tdist.DistError, match="all_reduce: set_result\\(\\) on a Work that already succeeded"):
        work.set_result(["second"])
    with pytest.raises(tdist.DistError, match="set_exception\\(\\) on a Work that already succeeded"):
        work.set_exception(tdist.DistBackendError("late"))
    assert work.result() == ["first"] and work.is_success()
    failed = tdist.Work("recv")
    failed.set_exception(tdist.DistBackendError("peer died"))
    with pytest.raises(tdist.DistError, match="already failed with DistBackendError"):
        failed.set_result([])


def test_source_rank_of_a_work_completed_without_one_says_so():
    work = tdist.Work.completed("recv", ["tensor"])
    with pytest.raises(
        tdist.DistBackendError, match=r"recv: source_rank\(\) is only defined for receives.*source_rank="
    ):
        work.source_rank()
    assert tdist.Work.completed("recv", ["tensor"], source_rank=1).source_rank() == 1


def _record_work_seq() -> list:
    """(op, seq) of every operation this rank issues after registering an observer:
    a send/recv between ranks 0 and 1 only, then collectives, then one the other way."""
    import torch

    from tdist._plugins import plugins

    seen: list = []
    observer = types.ModuleType("seq_observer")
    observer.TDIST_HOOKSPEC_VERSION = "1.0"
    observer.tdist_work_issued = tdist.hookimpl(lambda info: seen.append((info.op, info.seq)))
    plugins().register(observer, "seq_observer")
    rank, t = tdist.get_rank(), torch.ones(1)
    if rank < 2:
        tdist.send(t, 1) if rank == 0 else tdist.recv(t, 0)
    tdist.all_reduce(t)
    tdist.barrier()
    if rank < 2:
        tdist.isend(t, 0).wait() if rank == 1 else tdist.irecv(t, 1).wait()
    tdist.broadcast(t, 0)
    return seen


@pytest.mark.timeout(120)
def test_collective_seq_is_the_same_on_every_rank_and_p2p_has_its_own():
    from tdist.testing import World

    with World.spawn("tcp", 3, pg_timeout=30) as world:
        seen = world.run(_record_work_seq, timeout=60)
    collectives = [("all_reduce", 1), ("barrier", 2), ("broadcast", 3)]
    assert seen[0] == [("send", 1), *collectives[:2], ("recv", 2), collectives[2]], seen
    assert seen[1] == [("recv", 1), *collectives[:2], ("send", 2), collectives[2]], seen
    assert seen[2] == collectives, seen


def _observe_contract_1_1() -> dict:
    """What a 1.1 observer and a 1.0 observer (old hook signatures) see on a 2-rank world."""
    import torch

    from tdist._plugins import plugins

    new: dict = {"issued": [], "failed": [], "groups": []}
    old: list = []
    observer = types.ModuleType("observer_1_1")
    observer.TDIST_HOOKSPEC_VERSION = "1.1"
    observer.tdist_work_issued = tdist.hookimpl(
        lambda info: new["issued"].append(
            (info.op, info.rank, info.group_ranks, info.reduce_op, info.root, info.peer, info.tag, info.dtype)
        )
    )
    observer.tdist_work_failed = tdist.hookimpl(
        lambda info, error, duration: new["failed"].append(
            (info.op, info.seq, info.group, type(error).__name__, duration)
        )
    )
    observer.tdist_group_created = tdist.hookimpl(
        lambda name, ranks, rank, backend: new["groups"].append(("created", name, ranks, rank, backend))
    )
    observer.tdist_group_destroyed = tdist.hookimpl(
        lambda name, ranks: new["groups"].append(("destroyed", name, ranks))
    )
    legacy = types.ModuleType("observer_1_0")
    legacy.TDIST_HOOKSPEC_VERSION = "1.0"
    legacy.tdist_work_failed = tdist.hookimpl(lambda info, error: old.append((info.op, str(error)[:20])))
    plugins().register(observer, "observer_1_1")
    plugins().register(legacy, "observer_1_0")
    rank, t = tdist.get_rank(), torch.ones(2, dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    tdist.broadcast(t, src=1)
    tdist.send(t, 1, tag=7) if rank == 0 else tdist.recv(t, 0, tag=7)
    tdist.monitored_barrier(timeout=timedelta(seconds=20))  # runs in the core, through the store
    with pytest.raises(ValueError):
        tdist.broadcast(t, src=5)  # rejected before any communication
    pair = tdist.new_group([0, 1])
    tdist.destroy_process_group(pair)
    return {**new, "old": old}


@pytest.mark.timeout(120)
def test_contract_1_1_workinfo_fields_group_hooks_and_rejected_ops_with_old_observers_still_called():
    from tdist.testing import World

    with World.spawn("tcp", 2, pg_timeout=30) as world:
        seen = world.run(_observe_contract_1_1, timeout=60)
    for rank in (0, 1):
        issued = seen[rank]["issued"]
        assert issued[0] == ("all_reduce", rank, (0, 1), "MAX", None, None, None, "torch.float64"), issued
        assert issued[1] == ("broadcast", rank, (0, 1), None, 1, None, None, "torch.float64"), issued
        assert issued[2] == ("send" if rank == 0 else "recv", rank, (0, 1), None, None, 1 - rank, 7, "torch.float64")
        assert issued[3] == ("monitored_barrier", rank, (0, 1), None, None, None, None, ""), issued
        assert seen[rank]["failed"] == [("broadcast", 0, "pg0", "ValueError", 0.0)], seen[rank]
        assert seen[rank]["old"] == [("broadcast", str(seen[rank]["old"][0][1]))] and len(seen[rank]["old"]) == 1
        assert seen[rank]["groups"] == [("created", "pg1", [0, 1], rank, "tcp"), ("destroyed", "pg1", [0, 1])]


def _observe_through_torch() -> list:
    """Issue operations through torch.distributed's API (tdist's group is torch's default
    group): the work hooks get their reduction, root, peer and tag as through tdist's."""
    import torch
    import torch.distributed as torch_dist

    from tdist._plugins import plugins

    seen: list = []
    observer = types.ModuleType("bridge_observer")
    observer.TDIST_HOOKSPEC_VERSION = "1.1"
    observer.tdist_work_issued = tdist.hookimpl(
        lambda info: seen.append((info.op, info.reduce_op, info.root, info.peer, info.tag))
    )
    plugins().register(observer, "bridge_observer")
    rank, t = tdist.get_rank(), torch.ones(2)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    torch_dist.broadcast(t, src=1)
    torch_dist.reduce(t, dst=1, op=torch_dist.ReduceOp.MIN)
    torch_dist.send(t, 1, tag=3) if rank == 0 else torch_dist.recv(t, 0, tag=3)
    return seen


@pytest.mark.timeout(120)
def test_operations_through_torchs_api_are_described_to_the_hooks():
    from tdist.testing import World

    with World.spawn("tcp", 2, pg_timeout=30) as world:
        seen = world.run(_observe_through_torch, timeout=60)
    for rank in (0, 1):
        assert seen[rank] == [
            ("all_reduce", "MAX", None, None, None),
            ("broadcast", None, 1, None, None),
            ("reduce", "MIN", 1, None, None),
            ("send" if rank == 0 else "recv", None, None, 1 - rank, 3),
        ], seen[rank]
