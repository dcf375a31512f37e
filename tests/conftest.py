"""Cross-package tests. The tdist conformance kit's pytest plugin provides the
--tdist-* options and the tdist_world / tdist_scenario fixtures; it is loaded
through the ``pytest11`` entry point once ``tdist`` is pip-installed, and from
here otherwise (e.g. with PYTHONPATH=core/src)."""

import importlib.metadata
from datetime import timedelta

import pytest


def _plugin_registered() -> bool:
    try:
        eps = importlib.metadata.entry_points(group="pytest11")
    except Exception:
        return False
    return any(ep.value == "tdist.testing.pytest_plugin" for ep in eps)


if not _plugin_registered():
    pytest_plugins = ["tdist.testing.pytest_plugin"]


@pytest.fixture
def world1():
    """A default group of one rank (tcp over a HashStore) for single-process API tests."""
    import tdist as dist

    dist.init_process_group("tcp", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    yield
    dist.destroy_process_group()
