"""tdist-debug's entry point. With ``TDIST_DEBUG_RECORDER`` unset this module implements
no hook at all, so the core skips the work hooks entirely (installing tdist-debug costs
nothing); set, loading it starts the recorder and exposes the recorder's hooks."""

from __future__ import annotations

from .settings import Settings, enabled_by_env

TDIST_HOOKSPEC_VERSION = "1.1"

if enabled_by_env():
    from .hooks import recorder_plugin
    from .recorder import start

    _hooks = recorder_plugin(start(Settings.from_env()))
    tdist_work_issued = _hooks.tdist_work_issued
    tdist_work_completed = _hooks.tdist_work_completed
    tdist_work_failed = _hooks.tdist_work_failed
    tdist_group_created = _hooks.tdist_group_created
    tdist_group_destroyed = _hooks.tdist_group_destroyed
