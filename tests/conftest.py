"""Cross-package tests. The tdist conformance kit's pytest plugin provides the
--tdist-* options and the tdist_world / tdist_scenario fixtures; it is loaded
through the ``pytest11`` entry point once ``tdist`` is pip-installed, and from
here otherwise (e.g. with PYTHONPATH=core/src)."""

import importlib.metadata


def _plugin_registered() -> bool:
    try:
        eps = importlib.metadata.entry_points(group="pytest11")
    except Exception:
        return False
    return any(ep.value == "tdist.testing.pytest_plugin" for ep in eps)


if not _plugin_registered():
    pytest_plugins = ["tdist.testing.pytest_plugin"]
