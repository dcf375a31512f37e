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


def _makefile_variable(name: str) -> str:
    for line in (ROOT / "Makefile").read_text().splitlines():
        if line.startswith(f"{name} ") and ":=" in line:
            return line.split(":=", 1)[1].strip()
    raise AssertionError(f"the Makefile sets no {name}")


@pytest.mark.parametrize("path", [ROOT / "core", *PLUGINS], ids=lambda p: p.name)
def test_every_distribution_declares_the_tested_torch_range(path: pathlib.Path) -> None:
    """torch is required within tdist._version.TORCH_REQUIREMENT, with an upper bound (the
    next minor nobody has tested is excluded); core declares it in its ``torch`` extra."""
    from tdist._version import TORCH_REQUIREMENT

    project = _project(path)["project"]
    requirements = [*project.get("dependencies", []), *project.get("optional-dependencies", {}).get("torch", [])]
    (torch_requirement,) = [Requirement(r) for r in requirements if Requirement(r).name == "torch"]
    assert str(torch_requirement.specifier) == str(Requirement("torch" + TORCH_REQUIREMENT).specifier)


def test_the_makefile_tests_both_ends_of_the_torch_range() -> None:
    """TORCH_OLDEST is the range's first release, TORCH_NEWEST a release of the last minor it admits."""
    from packaging.version import Version

    from tdist._version import TORCH_REQUIREMENT

    specifier = Requirement("torch" + TORCH_REQUIREMENT).specifier
    oldest, newest = Version(_makefile_variable("TORCH_OLDEST")), Version(_makefile_variable("TORCH_NEWEST"))
    (lower,) = [Version(s.version) for s in specifier if s.operator == ">="]
    (upper,) = [Version(s.version) for s in specifier if s.operator == "<"]
    assert oldest in specifier and newest in specifier
    assert oldest.release[:2] == lower.release[:2], f"TORCH_OLDEST {oldest} is not the range's first minor {lower}"
    assert (newest.major, newest.minor + 1) == upper.release[:2], (
        f"TORCH_NEWEST {newest} is not the minor below {upper}"
    )
