"""tdist-debug's entry point. With ``TDIST_DEBUG_RECORDER`` unset this module implements
no hook at all, so the core skips the work hooks entirely (installing tdist-debug costs
nothing); set, it starts the recorder and exposes its hooks."""

from __future__ import annotations

from .settings import Settings, enabled_by_env

TDIST_HOOKSPEC_VERSION = "1.1"

if enabled_by_env():
    from .hooks import (  # noqa: F401  (pluggy finds the hooks on this module)
        tdist_group_created,
        tdist_group_destroyed,
        tdist_work_completed,
        tdist_work_failed,
        tdist_work_issued,
    )
    from .recorder import start

    start(Settings.from_env())
