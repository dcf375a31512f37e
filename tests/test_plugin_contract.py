"""The first-party plugins keep to the public plugin contract (``tdist``, ``tdist.plugin``).

The same rule is a ruff lint (TID251, banned-api table in the root pyproject.toml); this
test holds it without ruff and checks that the table names every private module.
"""

from __future__ import annotations

import ast
import pkgutil
import shutil
import subprocess
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
        modules = {alias.asname or alias.name.split(".")[0]
                   for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
                   if alias.name.startswith("tdist")}
        modules |= {alias.asname or alias.name
                    for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0
                    and not node.module for alias in node.names}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in modules:
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


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed")
def test_ruff_enforces_the_rule() -> None:
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    clean = subprocess.run([ruff, "check", "--select", "TID251", "plugins"], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    bad = subprocess.run([ruff, "check", "--select", "TID251", "--stdin-filename", "plugins/tcp/src/tdist_tcp/x.py",
                          "-"], cwd=ROOT, input="from tdist._store.base import Store\n", capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 1 and "TID251" in bad.stdout, bad.stdout + bad.stderr
