"""The repository's distributions agree on license, version and typing, as CONTRIBUTING.md says."""

from __future__ import annotations

import pathlib
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the suite runs on 3.11
    tomllib = pytest.importorskip("tomli")

from packaging.requirements import Requirement

import tdist

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLUGINS = sorted(p.parent for p in (ROOT / "plugins").glob("*/pyproject.toml"))


def _project(path: pathlib.Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())


@pytest.mark.parametrize("path", [ROOT / "core", *PLUGINS], ids=lambda p: p.name)
def test_license_and_typing_marker(path: pathlib.Path) -> None:
    project = _project(path)
    assert project["project"]["license"] == "BSD-3-Clause"  # SPDX (PEP 639)
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    packages = [p for p in (path / "src").iterdir() if (p / "__init__.py").exists()]
    assert packages
    for package in packages:
        assert (package / "py.typed").exists(), f"{package} ships no py.typed"
        assert "py.typed" in project["tool"]["setuptools"]["package-data"][package.name]


@pytest.mark.parametrize("path", PLUGINS, ids=lambda p: p.name)
def test_plugins_require_this_tdist_and_share_its_version(path: pathlib.Path) -> None:
    project = _project(path)["project"]
    (requirement,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "tdist"]
    assert requirement.specifier.contains(tdist.__version__), f"{path.name} excludes tdist {tdist.__version__}"
    assert any(s.operator == "<" for s in requirement.specifier), f"{path.name}: tdist's range has no upper bound"
    assert project["version"] == tdist.__version__


def test_the_core_version_has_one_source() -> None:
    core = _project(ROOT / "core")
    assert "version" not in core["project"] and "version" in core["project"]["dynamic"]
    assert core["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tdist._version.__version__"}
    from importlib.metadata import version

    assert version("tdist") == tdist.__version__
