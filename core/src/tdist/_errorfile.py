"""Error records: how a worker under ``tdistrun`` tells the launcher why it failed.

``tdistrun`` gives each worker, in ``TDIST_ERROR_FILE``, a path in a directory only the
launcher's user can enter (one file per worker and attempt). ``import tdist`` in a worker
that has the variable installs a ``sys.excepthook`` (calling the one before it) that
writes there, when an exception ends the program, a record of it: the exception's
class and message, whether it is the consequence of another rank's failure
(:func:`tdist._errors.failed_peer`: a peer that died, shut its group down, aborted it or
was interrupted) and which rank, when, and the traceback's last lines. The launcher
then names the rank that failed first on its own (:func:`root_cause`), not merely the
first one it saw exit. The program needs no change; a program that never imports tdist,
or that catches everything and calls ``sys.exit``, writes no record (the launcher then
goes by exit order).

The file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600, once: the process that
installed the hook removes the variable from its environment, so that its children
(which would inherit it) never write in its place.

No torch here: the launcher imports this module too.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ._errors import failed_peer

__all__ = ["ENV", "FORMAT", "install", "make_record", "write_record", "read_record", "Failure", "root_cause"]

#: The variable that names a worker's record file.
ENV = "TDIST_ERROR_FILE"
#: The record's ``format`` field.
FORMAT = "tdist-error-record/1"
#: Traceback lines kept in a record.
TAIL_LINES = 30

_installed: Optional[Callable[..., Any]] = None


def make_record(exc: BaseException) -> dict[str, Any]:
    """The record of ``exc``, which ends this process."""
    peer = failed_peer(exc)
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip("\n").splitlines()
    try:
        rank: Optional[int] = int(os.environ["RANK"])
    except (KeyError, ValueError):
        rank = None
    return {
        "format": FORMAT,
        "rank": rank,
        "pid": os.getpid(),
        "time": time.time(),
        "type": type(exc).__qualname__,
        "message": str(exc),
        "consequence": peer is not None,
        "peer": peer if peer is not None and peer >= 0 else None,
        "traceback": lines[-TAIL_LINES:],
    }


def write_record(exc: BaseException, path: str) -> None:
    """Write the record of ``exc`` to ``path``, which must not exist yet (mode 0600, no link followed)."""
    data = json.dumps(make_record(exc)).encode()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def install(environ: Any = None) -> bool:
    """Install the hook if ``TDIST_ERROR_FILE`` is set (once per process); whether it is installed."""
    global _installed
    if _installed is not None:
        return True
    env = os.environ if environ is None else environ
    path = env.pop(ENV, None)
    if not path:
        return False
    previous = sys.excepthook
    owner = os.getpid()

    def record_then_report(exc_type: Any, exc: Any, tb: Any) -> None:
        if os.getpid() == owner and isinstance(exc, BaseException):  # not a forked child's
            try:
                write_record(exc, path)
            except Exception:  # noqa: BLE001 - never in the way of the traceback
                pass
        previous(exc_type, exc, tb)

    record_then_report.tdist_error_file = path  # type: ignore[attr-defined]
    sys.excepthook = record_then_report
    _installed = record_then_report
    return True


def read_record(path: str) -> Optional[dict[str, Any]]:
    """The record at ``path`` (None: none, or not one of ours)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return None
    if not isinstance(record.get("time"), (int, float)) or not isinstance(record.get("traceback"), list):
        return None
    return record


@dataclass
class Failure:
    """One worker that failed: its global ``rank``, ``local_rank``, ``pid``, ``exitcode``
    (as ``Popen.returncode``: negative for a signal; None while it still ran), ``at`` (when
    it failed: its record's time, else when the launcher saw it exit), its error
    ``record`` (None: it wrote none), ``stopped`` (it exited only after the launcher
    began stopping the workers), and what torch's ``@record`` wrote in its
    ``TORCHELASTIC_ERROR_FILE`` (``detail``: the message, ``callstack``: the traceback)."""

    rank: int
    local_rank: int
    pid: int
    exitcode: Optional[int]
    at: float
    record: Optional[dict[str, Any]] = None
    stopped: bool = False
    detail: Optional[str] = None  # the message of torch's @record error file, if any
    callstack: Optional[list[str]] = None  # and its traceback

    @property
    def peer(self) -> Optional[int]:
        """The rank whose failure caused this one, when the record names it."""
        peer = self.record.get("peer") if self.record else None
        return peer if isinstance(peer, int) else None

    def traceback_tail(self, lines: int) -> list[str]:
        """The last ``lines`` lines of its traceback (the record's, else torch's error file's)."""
        found = self.record.get("traceback") if self.record else self.callstack
        return [str(line) for line in (found or [])][-lines:] if lines > 0 else []

    @property
    def consequence(self) -> bool:
        """Whether it failed because another rank did (as its record says)."""
        return bool(self.record and self.record.get("consequence"))

    @property
    def headline(self) -> str:
        """``"ValueError: boom"`` (the record's first line of message), else the detail, else ""."""
        if self.record is not None:
            message = str(self.record.get("message") or "").strip().splitlines()
            text = f"{self.record.get('type')}: {message[0]}" if message else str(self.record.get("type"))
            return text if len(text) <= 400 else text[:397] + "..."
        return self.detail or ""


def root_cause(failures: Sequence[Failure]) -> Optional[Failure]:
    """The failure the others follow from: the earliest that is not the consequence of
    another rank's failure; when every one is (or says so), the earliest of all."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.consequence, f.at, f.rank))
