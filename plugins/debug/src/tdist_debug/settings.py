"""The environment variables that configure the recorder (read once, when it starts)."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Settings", "RECORDER_ENV", "DUMP_DIR_ENV", "AT_EXIT_ENV", "TRACE_ENV", "DEFAULT_CAPACITY", "enabled_by_env"]

#: Turns the recorder on: how many operations each rank keeps (``1`` or more).
RECORDER_ENV = "TDIST_DEBUG_RECORDER"
#: Where dumps and traces are written (default ``tdist-debug`` in the working directory).
DUMP_DIR_ENV = "TDIST_DEBUG_DUMP_DIR"
#: ``1``: dump at exit too (and when SIGTERM ends the process).
AT_EXIT_ENV = "TDIST_DEBUG_DUMP_AT_EXIT"
#: ``1``: also keep every operation and write ``trace-rank<R>.json`` (Chrome trace events).
TRACE_ENV = "TDIST_DEBUG_TRACE"
DEFAULT_CAPACITY = 2000


@dataclass
class Settings:
    capacity: int = DEFAULT_CAPACITY
    dump_dir: str = "tdist-debug"
    at_exit: bool = False
    trace: bool = False

    @classmethod
    def from_env(cls) -> "Settings":
        """The settings the environment asks for; ValueError for a malformed capacity."""
        raw = os.environ.get(RECORDER_ENV, "").strip()
        try:
            capacity = int(raw) if raw else DEFAULT_CAPACITY
        except ValueError:
            raise ValueError(f"{RECORDER_ENV}={raw!r}: expected the number of operations to keep, e.g. 2000") from None
        if capacity < 1:
            raise ValueError(f"{RECORDER_ENV}={raw!r}: keep at least 1 operation")
        return cls(capacity, os.environ.get(DUMP_DIR_ENV) or "tdist-debug", _flag(AT_EXIT_ENV), _flag(TRACE_ENV))


def enabled_by_env() -> bool:
    """Whether ``TDIST_DEBUG_RECORDER`` asks for the recorder (unset, empty or 0: no)."""
    return os.environ.get(RECORDER_ENV, "").strip() not in ("", "0")


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
