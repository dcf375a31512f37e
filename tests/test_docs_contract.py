"""The plugin author's guide (docs/pages/plugins/) stays in step with the code:
every hook spec appears with its exact signature, every abstract method of Backend,
every public method of Store (and every Backend method a plugin may override) is documented with its
signature, the Work contract names every public method, the versioned-contract text
matches what the core does, and the support table is generated, not written by hand.

Needs no documentation tool; the strict build itself runs when mkdocs is installed
(``make docs`` installs it)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import tdist
from tdist import hookspecs
from tdist._plugins import _version_error

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = DOCS / "pages"
GUIDE = PAGES / "plugins"


def _plain(text: str) -> str:
    """Signatures without quotes: ``from __future__ import annotations`` turns every
    annotation into a string, which ``inspect.signature`` shows quoted."""
    return re.sub(r"[\"']", "", text)


def _guide() -> str:
    return _plain("\n".join(p.read_text() for p in sorted(GUIDE.glob("*.md"))))


def _signature(fn) -> str:
    return _plain(str(inspect.signature(fn)))


def _hook_specs() -> dict:
    specs = {
        name: fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("tdist_") and callable(fn) and hasattr(fn, f"{hookspecs.PROJECT_NAME}_spec")
    }
    assert specs, "no hook spec found in tdist.hookspecs"
    return specs


@pytest.mark.parametrize("name", sorted(_hook_specs()))
def test_hook_spec_documented_with_its_signature(name):
    expected = f"def {name}{_signature(_hook_specs()[name])}"
    assert expected in _guide(), f"the author's guide (docs/pages/plugins/) does not show `{expected}`"


def test_guide_documents_no_hook_that_does_not_exist():
    documented = set(re.findall(r"^def (tdist_\w+)\(", (GUIDE / "hooks.md").read_text(), re.M))
    assert documented == set(_hook_specs()), f"hooks.md documents {sorted(documented)}"


def _public_methods(cls: type) -> list[str]:
    return sorted(n for n, v in vars(cls).items() if callable(v) and (not n.startswith("_") or n == "__init__"))


@pytest.mark.parametrize(
    "cls, name",
    [(tdist.Backend, n) for n in sorted(tdist.Backend.__abstractmethods__)]
    + [(tdist.Store, n) for n in _public_methods(tdist.Store)],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_abstract_method_documented_with_its_signature(cls, name):
    expected = f"def {name}{_signature(getattr(cls, name))}"
    assert expected in _guide(), f"{cls.__name__}.{name}: the author's guide does not show `{expected}`"


@pytest.mark.parametrize("name", _public_methods(tdist.Backend))
def test_every_backend_method_documented(name):
    expected = f"def {name}{_signature(getattr(tdist.Backend, name))}"
    assert expected in _plain((GUIDE / "backend.md").read_text()), f"backend.md does not show `{expected}`"


@pytest.mark.parametrize("name", [n for n in _public_methods(tdist.Work) if n != "__init__"])
def test_work_contract_names_every_method(name):
    assert re.search(rf"(?<!\w){name}\(", (GUIDE / "work.md").read_text()), f"work.md does not describe Work.{name}"


def test_versioned_contract_text_matches_the_core():
    text = (GUIDE / "index.md").read_text()
    assert "TDIST_HOOKSPEC_VERSION" in text
    assert f"currently `{tdist.HOOKSPEC_VERSION}`" in text
    flat = " ".join(text.split())
    assert "major versions are equal and the plugin's minor version is not greater than the core's" in flat
    refusal = _version_error(types.SimpleNamespace(TDIST_HOOKSPEC_VERSION="2.0"))
    assert refusal and refusal in text, f"index.md should show the core's refusal message: {refusal!r}"
    major, minor = tdist.HOOKSPEC_VERSION
    assert _version_error(types.SimpleNamespace(TDIST_HOOKSPEC_VERSION=f"{major}.{minor}")) is None


def _load_hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("tdist_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_support_table_is_generated_from_the_installed_backends():
    from tdist._info import support_table
    from tdist._plugins import plugins

    source = (PAGES / "backends.md").read_text()
    assert "<!-- tdist:support-table -->" in source and "<!-- tdist:backend-notes -->" in source
    assert not re.search(r"^\|\s*all_reduce\s*\|", source, re.M), "backends.md must not hold a hand-written table"
    page = _load_hooks().on_page_markdown(source, None, None, None)
    specs = plugins().backends.specs()
    devices = sorted({d for s in specs for d in s.devices}, key=lambda d: (d != "cpu", d))
    assert support_table(specs, devices=devices) in page
    for spec in specs:  # the per-backend notes come from each spec
        assert f"### `{spec.name}`" in page
        if spec.description:
            assert spec.description.replace("|", "\\|") in page
    assert "<!-- tdist:" not in page


def test_docs_build_strict(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed (make docs installs the documentation tools)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(DOCS / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert (tmp_path / "site" / "plugins" / "hooks" / "index.html").is_file()
