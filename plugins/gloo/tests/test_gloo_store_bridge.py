"""StoreBridge: a tdist Store behind torch.distributed.Store, called from Python and from
torch's C++ (torch.distributed.PrefixStore and ProcessGroupGloo's rendezvous)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as td

import tdist
from tdist_gloo.store_bridge import StoreBridge


class RecordingStore(tdist.HashStore):
    """A HashStore that records which methods were called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __getattribute__(self, name):
        attr = super().__getattribute__(name)
        if name in ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys"):
            super().__getattribute__("calls").append(name)
        return attr


def test_is_a_torch_store():
    bridge = StoreBridge(tdist.HashStore())
    assert isinstance(bridge, td.Store)
    assert "HashStore" in repr(bridge)


def test_python_calls_forward():
    store = tdist.HashStore()
    bridge = StoreBridge(store)
    bridge.set("a", b"1")
    bridge.set("s", "text")
    assert store.get("a") == b"1" and bridge.get("s") == b"text"
    assert bridge.add("n", 5) == 5 and bridge.add("n", -2) == 3
    assert bridge.compare_set("a", b"1", b"2") == b"2"
    assert bridge.compare_set("a", b"nope", b"3") == b"2"
    assert bridge.compare_set("fresh", b"", b"v") == b"v"
    assert bridge.check(["a", "n"]) and not bridge.check(["a", "missing"])
    bridge.wait(["a"])
    bridge.wait(["a"], timedelta(seconds=1))
    assert bridge.num_keys() == store.num_keys()
    assert bridge.delete_key("a") and not bridge.delete_key("a")
    bridge.multi_set(["x", "y"], [b"1", b"2"])
    assert bridge.multi_get(["x", "y"]) == [b"1", b"2"]
    bridge.append("log", b"ab")
    bridge.append("log", b"cd")
    assert store.get("log") == b"abcd"


def test_wait_timeout_is_tdists():
    bridge = StoreBridge(tdist.HashStore(timeout=timedelta(seconds=5)))
    with pytest.raises(tdist.DistStoreTimeoutError):
        bridge.wait(["never"], timedelta(milliseconds=100))


def test_timeout_mirrors_the_tdist_store():
    store = tdist.HashStore(timeout=timedelta(seconds=7))
    bridge = StoreBridge(store)
    assert bridge.timeout == timedelta(seconds=7)
    bridge.set_timeout(timedelta(seconds=3))
    assert store.timeout == timedelta(seconds=3)


def test_torch_cpp_calls_reach_the_tdist_store():
    """torch's C++ PrefixStore calls the bridge through pybind11 trampolines (the bridge
    must stay referenced from Python: the trampolines look its methods up on the instance)."""
    store = tdist.HashStore()
    bridge = StoreBridge(store)
    prefixed = td.PrefixStore("p", bridge)
    prefixed.set("k", "v")
    assert store.get("p/k") == b"v"
    assert prefixed.get("k") == b"v"
    assert prefixed.add("c", 3) == 3 and store.get("p/c") == b"3"
    assert prefixed.compare_set("k", "v", "w") == b"w"
    assert prefixed.check(["k"]) and not prefixed.check(["zz"])
    prefixed.wait(["k"])
    prefixed.wait(["k"], timedelta(seconds=1))
    prefixed.multi_set(["m1", "m2"], ["1", "2"])
    assert prefixed.multi_get(["m1", "m2"]) == [b"1", b"2"]
    prefixed.append("log", "ab")
    prefixed.append("log", "cd")
    assert store.get("p/log") == b"abcd"
    # torch's trampoline has no getNumKeys/deleteKey: C++ callers cannot reach those two
    # on any Python store; Python callers of the bridge do (test_python_calls_forward).


def test_process_group_gloo_rendezvous_through_bridge():
    """ProcessGroupGloo (world of one) built on the bridge: it calls set/wait/get."""
    store = RecordingStore()
    options = td.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=30)
    options._devices = [td.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = td.ProcessGroupGloo(StoreBridge(tdist.PrefixStore("g", store)), 0, 1, options)
    t = torch.ones(3)
    pg.allreduce([t]).wait()
    assert t.tolist() == [1.0, 1.0, 1.0]
    assert {"set", "get"} <= set(store.calls)
