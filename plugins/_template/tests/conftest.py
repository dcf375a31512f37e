"""Test configuration of the plugin template.

The conformance kit's pytest plugin (``--tdist-backend``, ``--tdist-world-sizes``,
the ``tdist_world`` fixture) comes with ``tdist`` through the ``pytest11`` entry
point. Here the backend under test defaults to this plugin's, and everything is
skipped, saying why, until the plugin is installed (``pip install -e .``): the
core finds backends through installed entry points only.
"""

import importlib.metadata
from pathlib import Path

import pytest

DISTRIBUTION = "tdist-template"
BACKEND = "store"


def _installed() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def pytest_configure(config):
    # The session's default (an explicit --tdist-backend wins).
    if hasattr(config.option, "tdist_backends") and not config.option.tdist_backends:
        config.option.tdist_backends = [BACKEND]


def pytest_collection_modifyitems(config, items):
    if not _installed():
        here = Path(__file__).parent
        skip = pytest.mark.skip(reason=f"{DISTRIBUTION} is not installed: pip install -e <this folder> first")
        for item in items:
            if here in Path(item.path).parents:  # only this folder's tests
                item.add_marker(skip)
