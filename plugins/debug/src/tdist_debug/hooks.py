"""The recorder's hook implementations, as a plugin object for the running recorder
(registered only while the recorder is on)."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any

from tdist import hookimpl

if TYPE_CHECKING:  # typing only: recorder.enable imports this module
    from .recorder import Recorder

__all__ = ["recorder_plugin"]


def recorder_plugin(recorder: Recorder) -> types.SimpleNamespace:
    """The hooks that feed ``recorder``; the per-operation ones are its fast closures
    unless it also traces every operation."""
    if recorder.settings.trace:
        issued, completed = recorder.issued, recorder.completed
    else:
        issued, completed = recorder.fast_hooks()

    def tdist_work_issued(info: Any) -> None:
        issued(info)

    def tdist_work_completed(info: Any, duration: float) -> None:
        completed(info, duration)

    def tdist_work_failed(info: Any, error: BaseException, duration: float) -> None:
        recorder.failed(info, error, duration)

    def tdist_group_created(name: str, ranks: list, rank: int, backend: str) -> None:
        recorder.group_created(name, ranks, rank, backend)

    def tdist_group_destroyed(name: str) -> None:
        recorder.group_destroyed(name)

    hooks = {name: hookimpl(function) for name, function in locals().items() if name.startswith("tdist_")}
    return types.SimpleNamespace(TDIST_HOOKSPEC_VERSION="1.1", **hooks)
