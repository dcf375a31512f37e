"""The plugin's registration: entry point, hook contract, operations table, availability."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

import tdist
from tdist._plugins import BackendRegistry

import tdist_gloo
from tdist_gloo import plugin


def _register() -> tdist.BackendSpec:
    registry = BackendRegistry()
    plugin.tdist_register_backends(registry=registry)
    spec = registry.get("gloo")
    assert spec is not None
    return spec


def test_entry_point_and_hook_version():
    eps = [ep for ep in importlib.metadata.entry_points(group="tdist") if ep.name == "gloo"]
    assert [ep.value for ep in eps] == ["tdist_gloo.plugin"]
    assert plugin.TDIST_HOOKSPEC_VERSION == "1.0"


def test_registered_through_tdist():
    spec = tdist.get_backend_spec("gloo")
    assert spec.name == "gloo" and spec.available is None
    assert tdist.is_backend_available("gloo")
    assert spec.distribution == "tdist-gloo"


def test_operations_table():
    spec = _register()
    assert set(spec.operations) == {"cpu", "cuda"}
    assert spec.operations["cpu"] == frozenset(tdist.OPERATIONS) | {tdist.ANY_SOURCE_OP}
    cuda = spec.operations["cuda"]
    assert cuda < spec.operations["cpu"]
    # gloo's send/recv take host pointers: no CUDA point-to-point
    assert not {"send", "recv", tdist.ANY_SOURCE_OP} & cuda
    assert {"broadcast", "all_reduce", "reduce", "all_gather", "gather", "scatter", "all_to_all_single"} <= cuda
    unknown = (spec.operations["cpu"] | cuda) - set(tdist.OPERATIONS) - {tdist.ANY_SOURCE_OP}
    assert not unknown


def test_plugin_import_does_not_import_torch_or_backend():
    code = (
        "import sys, tdist_gloo.plugin; "
        "print([m for m in ('torch', 'tdist_gloo.backend', 'tdist_gloo.store_bridge') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_unavailable_when_torch_has_no_gloo(monkeypatch):
    import torch.distributed as td

    monkeypatch.setattr(td, "is_gloo_available", lambda: False)
    spec = _register()
    assert spec.available is not None and "gloo" in spec.available
    assert "is_gloo_available" in spec.available


def test_unavailable_when_torch_distributed_missing(monkeypatch):
    import torch.distributed as td

    monkeypatch.setattr(td, "is_available", lambda: False)
    assert "torch.distributed" in (_register().available or "")


def test_unavailable_when_torch_missing(monkeypatch):
    real = tdist_gloo.importlib.util.find_spec
    monkeypatch.setattr(
        tdist_gloo.importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a)
    )
    reason = _register().available
    assert reason is not None and "torch is not installed" in reason


def test_unavailable_backend_refused_with_reason(monkeypatch):
    import torch.distributed as td

    from tdist._plugins import reset_plugins

    monkeypatch.setattr(td, "is_gloo_available", lambda: False)
    reset_plugins()
    try:
        assert not tdist.is_backend_available("gloo")
        with pytest.raises(tdist.DistError, match="without gloo"):
            tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    finally:
        monkeypatch.undo()
        reset_plugins()
    assert tdist.is_backend_available("gloo")
