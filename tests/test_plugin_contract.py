"""The first-party plugins keep to the public plugin contract (``tdist``, ``tdist.plugin``).

The same rule is a ruff lint (TID251, banned-api table in the root pyproject.toml); this
test holds it without ruff and checks that the table names every private module.
"""

from __future__ import annotations

import ast
import pkgutil
import re
import shutil
import subprocess
import types
import sys
from pathlib import Path

import pytest

import tdist
import tdist.plugin

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - CI runs 3.11
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = sorted(ROOT.glob("plugins/*/src/**/*.py"))


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_plugins_import_only_the_public_contract() -> None:
    assert PLUGIN_SOURCES, "no plugin sources found"
    private = [
        f"{path.relative_to(ROOT)}:{line}: {name}"
        for path in PLUGIN_SOURCES
        for line, name in _imported_modules(ast.parse(path.read_text(), str(path)))
        if name.startswith("tdist._")
    ]
    assert not private, "plugins must import tdist / tdist.plugin only:\n" + "\n".join(private)


def test_plugins_do_not_assign_other_modules_globals() -> None:
    """``from . import x`` (or ``import tdist...``) then ``x.NAME = ...``: one module of tdist or of a
    plugin rewriting another's global (interpreter hooks such as ``sys.excepthook`` are not meant)."""
    offenders = []
    for path in PLUGIN_SOURCES:
        tree = ast.parse(path.read_text(), str(path))
        modules = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("tdist")
        }
        modules |= {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level > 0 and not node.module
            for alias in node.names
        }
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in modules
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target.value.id}.{target.attr} = ...")
    assert not offenders, "\n".join(offenders)


def _banned_table() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["ruff"]["lint"]["flake8-tidy-imports"]["banned-api"]


def test_lint_table_bans_every_private_module() -> None:
    private = {f"tdist.{m.name}" for m in pkgutil.iter_modules(tdist.__path__) if m.name.startswith("_")}
    private.discard("tdist.__main__")
    missing = sorted(private - set(_banned_table()))
    assert not missing, f"add these to [tool.ruff.lint.flake8-tidy-imports.banned-api]: {missing}"


def test_public_contract_exports_resolve() -> None:
    for name in tdist.plugin.__all__:
        assert getattr(tdist.plugin, name) is not None, name
    assert tdist.plugin.Work is tdist.Work and tdist.plugin.Backend is tdist.Backend


@pytest.mark.skipif(
    shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(), reason="ruff is not installed"
)
def test_ruff_enforces_the_rule() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    clean = subprocess.run(
        [ruff, "check", "--select", "TID251", "plugins"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert clean.returncode == 0, clean.stdout + clean.stderr
    bad = subprocess.run(
        [ruff, "check", "--select", "TID251", "--stdin-filename", "plugins/tcp/src/tdist_tcp/x.py", "-"],
        cwd=ROOT,
        input="from tdist._store.base import Store\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "TID251" in bad.stdout, bad.stdout + bad.stderr


_LAZY_PROBE = """
import json, sys
from datetime import timedelta
import torch
import tdist
tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))
tdist.all_reduce(torch.ones(2))
tdist.destroy_process_group()
def loaded():
    mods = [m for m in ("mpi4py", "mpi4py.MPI", "tdist_mpi._runtime", "tdist_gloo.backend", "tdist_nccl.backend",
                        "cupy") if m in sys.modules]
    return mods + (["libmpi"] if "libmpi" in open("/proc/self/maps").read() else [])
after_tcp = loaded()
tdist.is_backend_available("mpi")
print(json.dumps([after_tcp, loaded()]))
"""


@pytest.mark.timeout(120)
def test_a_tcp_group_probes_no_other_backend():
    """Availability is probed lazily: a tcp group loads neither libmpi nor gloo's or nccl's backend."""
    import json

    out = subprocess.run([sys.executable, "-c", _LAZY_PROBE], capture_output=True, text=True, timeout=100, check=True)
    after_tcp, after_asking = json.loads(out.stdout.strip().splitlines()[-1])
    assert after_tcp == [], after_tcp
    assert "tdist_mpi._runtime" in after_asking  # asking about mpi does probe it


def _plugin(name: str, **spec: object) -> types.ModuleType:
    module = types.ModuleType(f"plugin_{name}")
    module.TDIST_HOOKSPEC_VERSION = "1.0"  # type: ignore[attr-defined]
    spec = {"operations": {"cpu": frozenset({"barrier"})}, **spec}
    module.tdist_register_backends = tdist.hookimpl(  # type: ignore[attr-defined]
        lambda registry: registry.add(tdist.BackendSpec(name=name, factory=lambda **kw: None, **spec))
    )
    return module


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"operations": {"cpu": frozenset({"all_reduse"})}}, "'all_reduse' \\(did you mean 'all_reduce'\\?\\)"),
        ({"extra": {"unsupported": {"multi_gpu": "why"}}}, "'multi_gpu' \\(did you mean 'multigpu'\\?\\)"),
        ({"extra": {"unsupported": {"reduce_op.AVERAGE": "why"}}}, "'reduce_op.AVERAGE'"),
        ({"launcher": "srun"}, "launcher 'srun' is not one of"),
    ],
)
def test_capability_keys_are_checked_at_registration(spec: dict, message: str) -> None:
    from tdist._plugins import Plugins

    plugins = Plugins([])
    with pytest.raises(tdist.DistError, match=f"refused: tdist_register_backends failed: ValueError: .*{message}"):
        plugins.register(_plugin("typo", **spec), "typo")
    assert plugins.backends.names() == []


def test_valid_declarations_register_and_a_deferred_spec_is_made_once() -> None:
    from tdist._plugins import Plugins

    made: list[str] = []
    deferred = types.ModuleType("plugin_deferred")
    deferred.TDIST_HOOKSPEC_VERSION = "1.0"  # type: ignore[attr-defined]

    def make() -> tdist.BackendSpec:
        made.append("probe")
        return tdist.BackendSpec(
            name="later",
            factory=lambda **kw: None,
            operations={"cpu": frozenset({"barrier"})},
            extra={"unsupported": {"reduce_op.AVG": "x", "dtype.bfloat16": "y"}},
        )

    deferred.tdist_register_backends = tdist.hookimpl(  # type: ignore[attr-defined]
        lambda registry: registry.add_deferred("later", make)
    )
    plugins = Plugins([])
    plugins.register(deferred, "deferred")
    plugins.register(_plugin("now", launcher="mpirun"), "now")
    assert made == [] and plugins.backends.names() == ["later", "now"]
    assert plugins.backends.get("later").distribution == "deferred"
    assert plugins.backends.get("later") is plugins.backends.get("LATER") and made == ["probe"]
    assert plugins.backends.get("now").launcher == "mpirun"


def test_disabled_plugin_is_blocked_in_the_plugin_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist._plugins import Plugins

    class EntryPoint:
        name, dist = "off", None

        def load(self) -> object:
            raise AssertionError("a disabled plugin is never imported")

    monkeypatch.setenv("TDIST_DISABLED_PLUGINS", "off")
    plugins = Plugins([EntryPoint()])
    assert plugins.records[0].error == "disabled by TDIST_DISABLED_PLUGINS"
    with pytest.raises(tdist.DistError, match="refused: disabled by TDIST_DISABLED_PLUGINS"):
        plugins.register(_plugin("off"), "off")


def test_the_kit_starts_mpi_worlds_as_the_spec_says() -> None:
    from tdist.testing.pytest_plugin import spec_launcher

    assert tdist.get_backend_spec("mpi").launcher == "mpirun" and spec_launcher("mpi") == "mpirun"
    assert spec_launcher("tcp") is None and spec_launcher("gloo") is None


def test_one_flag_parser_for_every_boolean_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from tdist.plugin import flag
    from tdist_gloo.plugin import _unsupported_features

    assert [flag("T", value=v) for v in ("1", "Yes", " on ", "y", True)] == [True] * 5
    assert [flag("T", True, value=v) for v in ("0", "False", "off", "n", False)] == [False] * 5
    monkeypatch.delenv("T", raising=False)
    assert flag("T") is False and flag("T", True) is True
    with pytest.raises(ValueError, match="T='enabled': expected 1/true/yes/on or 0/false/no/off"):
        flag("T", value="enabled")
    # gloo's spec (what the kit expects) and its backend read TDIST_GLOO_CHECK_COLLECTIVES alike
    monkeypatch.setenv("TDIST_GLOO_CHECK_COLLECTIVES", "on")
    assert "collective_mismatch" not in _unsupported_features()
    monkeypatch.setenv("TDIST_GLOO_CHECK_COLLECTIVES", "enabled")
    with pytest.raises(ValueError, match="TDIST_GLOO_CHECK_COLLECTIVES='enabled'"):
        _unsupported_features()


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"factory": lambda store, rank: None}, "does not accept the keyword(s) world_size, timeout, options"),
        ({"factory": lambda *, device, **kw: None}, "factory requires device, which the core never passes"),
        ({"available": False}, "available must be None (usable) or the reason it is not, a string; got False"),
        ({"available": ""}, "available must be None"),
    ],
)
def test_a_spec_whose_factory_or_availability_breaks_the_contract_is_refused(fields, problem):
    spec = {"name": "bad", "factory": lambda **kw: None, "operations": {"cpu": frozenset({"barrier"})}, **fields}
    with pytest.raises(ValueError, match=re.escape(problem)):
        tdist.BackendSpec(**spec)


def test_documented_factory_signatures_are_accepted():
    def keywords(*, store, rank, world_size, timeout, options, global_ranks, secret):  # noqa: ANN001, ANN202
        return None

    tdist.BackendSpec(name="ok", factory=keywords, operations={"cpu": frozenset()})


def test_backend_error_maps_a_librarys_exception():
    from tdist.plugin import DistBackendError, DistBackendTimeoutError, backend_error

    original = RuntimeError("[gloo] Timed out waiting 2000ms for recv operation")
    error = backend_error("gloo", "all_reduce", original)
    assert type(error) is DistBackendTimeoutError and error.__cause__ is original
    assert str(error) == "all_reduce: backend 'gloo' failed: [gloo] Timed out waiting 2000ms for recv operation"
    assert isinstance(backend_error("x", "op", TimeoutError()), DistBackendTimeoutError)
    other = backend_error("mpi", "send", ValueError("bad rank"), "MPI_ERR_RANK (MPI error class 6)")
    assert (
        type(other) is DistBackendError and str(other) == "send: backend 'mpi' failed: MPI_ERR_RANK (MPI error class 6)"
    )
    mine, interrupt = tdist.DistStateError("mine"), KeyboardInterrupt()
    assert backend_error("x", "op", mine) is mine and backend_error("x", "op", interrupt) is interrupt
