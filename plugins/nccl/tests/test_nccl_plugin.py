"""Registration and availability of the nccl backend (CPU-only: runs everywhere)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
from datetime import timedelta

import pytest
import tdist
import tdist_nccl
import torch
from tdist._plugins import BackendRegistry
from tdist_nccl import plugin
from tdist_nccl.backend import create_backend
from tdist_nccl.comm import load_nccl


def _register() -> tdist.BackendSpec:
    registry = BackendRegistry()
    plugin.tdist_register_backends(registry=registry)
    spec = registry.get("nccl")
    assert spec is not None
    return spec


def _no_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cupy" else real(name, *a))


def _cupy_found(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    fake = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: fake if name == "cupy" else real(name, *a))


def test_entry_point_and_hook_version():
    eps = [ep for ep in importlib.metadata.entry_points(group="tdist") if ep.name == "nccl"]
    assert [ep.value for ep in eps] == ["tdist_nccl.plugin"]
    assert eps[0].dist is not None and eps[0].dist.name == "tdist-nccl"
    assert plugin.TDIST_HOOKSPEC_VERSION == "1.0"


def test_operations_table_cuda_only_without_any_source():
    spec = _register()
    assert spec.name == "nccl"
    assert set(spec.operations) == {"cuda"}
    assert spec.operations["cuda"] == frozenset(tdist.OPERATIONS)
    assert not spec.supports(tdist.ANY_SOURCE_OP, "cuda")
    assert not spec.supports("all_reduce", "cpu")
    assert set(spec.extra["unsupported"]) == {
        "p2p_tags",
        "dtype.int16",
        "reduce_op.BAND",
        "reduce_op.BOR",
        "reduce_op.BXOR",
        "shrink_group",
    }
    assert spec.extra["options"] == ("device_id",)


def test_unavailable_without_cupy(monkeypatch):
    _no_cupy(monkeypatch)
    reason = tdist_nccl.unavailable_reason()
    assert reason == "cupy is not installed: pip install tdist-nccl[cuda12] (or tdist-nccl[cuda13] for CUDA 13)"
    assert _register().available == reason


def test_unavailable_without_gpu(monkeypatch):
    _cupy_found(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tdist_nccl.unavailable_reason() == "no CUDA device visible (torch.cuda.is_available() is False)"


def test_unavailable_with_cpu_only_torch(monkeypatch):
    _cupy_found(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert "this torch build has no CUDA support" in tdist_nccl.unavailable_reason()


def test_available_with_cupy_and_gpu(monkeypatch):
    _cupy_found(monkeypatch)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert tdist_nccl.unavailable_reason() is None
    assert _register().available is None
    assert plugin.tdist_default_backend(device="cuda") == "nccl"
    assert plugin.tdist_default_backend(device="cpu") is None


def test_registered_through_tdist_with_its_reason():
    spec = tdist.get_backend_spec("nccl")
    assert spec.distribution == "tdist-nccl"
    assert spec.available == tdist_nccl.unavailable_reason()
    assert tdist.is_backend_available("nccl") == (spec.available is None)


def test_init_process_group_explains_why_unavailable():
    reason = tdist_nccl.unavailable_reason()
    if reason is None:
        pytest.skip("nccl is available on this machine")
    with pytest.raises(tdist.DistError) as info:
        tdist.init_process_group("nccl", store=tdist.HashStore(), rank=0, world_size=1)
    assert str(info.value) == f"backend 'nccl' is installed but unavailable: {reason}"
    assert not tdist.is_initialized()


def test_factory_without_cupy_says_how_to_install(monkeypatch):
    for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl"):  # importing them raises ImportError,
        monkeypatch.setitem(sys.modules, name, None)  # even where the real CuPy is installed
    with pytest.raises(tdist.DistBackendError, match=r"pip install tdist-nccl\[cuda12\]"):
        create_backend(store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=5), options={})


def test_cupy_without_nccl_library_is_explained(monkeypatch):
    import types

    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = False  # what cupy.cuda.nccl sets when libnccl cannot be loaded
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl
    cupy = types.ModuleType("cupy")
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    with pytest.raises(tdist.DistBackendError, match="cannot load the NCCL library"):
        load_nccl()


def test_plugin_import_is_light():
    """Importing the plugin imports neither torch nor CuPy nor the backend; without CuPy,
    the availability check does not import torch either."""
    code = (
        "import sys, importlib.util\n"
        "import tdist_nccl, tdist_nccl.plugin\n"
        "print([m for m in ('torch', 'cupy', 'tdist_nccl.backend', 'tdist_nccl.comm') if m in sys.modules])\n"
        "if importlib.util.find_spec('cupy') is None:\n"
        "    tdist_nccl.unavailable_reason()\n"
        "    print('torch' in sys.modules)\n"
        "else:\n"
        "    print(False)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split("\n")[:2] == ["[]", "False"]
