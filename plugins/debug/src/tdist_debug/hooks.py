"""The recorder's hook implementations (registered only while the recorder is on)."""

from __future__ import annotations

from typing import Any

from tdist import hookimpl

from .recorder import current

TDIST_HOOKSPEC_VERSION = "1.1"


@hookimpl
def tdist_work_issued(info: Any) -> None:
    current().issued(info)  # type: ignore[union-attr]


@hookimpl
def tdist_work_completed(info: Any, duration: float) -> None:
    current().completed(info, duration)  # type: ignore[union-attr]


@hookimpl
def tdist_work_failed(info: Any, error: BaseException, duration: float) -> None:
    current().failed(info, error, duration)  # type: ignore[union-attr]


@hookimpl
def tdist_group_created(name: str, ranks: list, rank: int, backend: str) -> None:
    current().group_created(name, ranks, rank, backend)  # type: ignore[union-attr]


@hookimpl
def tdist_group_destroyed(name: str) -> None:
    current().group_destroyed(name)  # type: ignore[union-attr]
