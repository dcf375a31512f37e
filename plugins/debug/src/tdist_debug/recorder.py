"""The flight recorder: the last N operations of this rank, in a ring buffer.

Recording an operation costs a list store and a dict insert (the core builds the
:class:`tdist.WorkInfo` only while some plugin observes work). A dump writes the
ring, oldest first, with this rank's groups, to ``<dump dir>/rank<R>.json``
(replaced atomically); with tracing on, every operation also goes to
``trace-rank<R>.json`` in Chrome's trace-event format (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import socket
import threading
import time
from typing import Any, Optional

from .settings import Settings

__all__ = ["Recorder", "current", "enable", "start", "DUMP_FORMAT"]

#: The ``format`` field of every dump (the analyser checks it).
DUMP_FORMAT = "tdist-debug/1"
_TIMEOUT_WORDS = ("timeout", "timed out", "did not complete within")


class _Entry:
    """One recorded operation; ``duration`` and ``error`` are set when it ends."""

    __slots__ = ("index", "info", "duration", "error")

    def __init__(self, index: int, info: Any) -> None:
        self.index = index
        self.info = info
        self.duration: Optional[float] = None
        self.error: Optional[str] = None

    def state(self) -> str:
        if self.error is not None:
            return "failed"
        return "pending" if self.duration is None else "completed"

    def as_dict(self, now: float) -> dict[str, Any]:
        info = self.info
        return {
            "op": info.op, "group": info.group, "seq": info.seq, "group_ranks": list(info.group_ranks),
            "shapes": [list(s) for s in info.shapes], "dtype": info.dtype, "nbytes": info.nbytes,
            "backend": info.backend, "reduce_op": info.reduce_op, "root": info.root, "peer": info.peer,
            "tag": info.tag, "issued_time": info.issued_time, "state": self.state(),
            "duration": self.duration if self.duration is not None else (
                None if self.error is not None else now - info.issued_time),
            "error": self.error,
        }


class Recorder:
    """The last ``settings.capacity`` operations of this process, and its groups."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ring: list[Optional[_Entry]] = [None] * settings.capacity
        self._count = itertools.count()
        self._pending: dict[int, _Entry] = {}
        self._trace: Optional[list[_Entry]] = [] if settings.trace else None
        self.groups: dict[str, dict[str, Any]] = {}
        self.rank: Optional[int] = None
        self._dump_lock = threading.Lock()

    # ------------------------------------------------------------ recording
    def issued(self, info: Any) -> None:
        index = next(self._count)
        entry = _Entry(index, info)
        self._ring[index % self.settings.capacity] = entry
        self._pending[id(info)] = entry
        if self._trace is not None:
            self._trace.append(entry)

    def completed(self, info: Any, duration: float) -> None:
        entry = self._pending.pop(id(info), None)
        if entry is not None:
            entry.duration = duration

    def failed(self, info: Any, error: BaseException, duration: float = 0.0) -> None:
        """Record the failure; an operation that was issued (``seq`` > 0) also dumps."""
        entry = self._pending.pop(id(info), None)
        if entry is None:  # rejected before it was issued: recorded, not dumped
            index = next(self._count)
            entry = _Entry(index, info)
            self._ring[index % self.settings.capacity] = entry
        entry.duration, entry.error = duration, f"{type(error).__name__}: {error}"
        if self.rank is None and info.rank >= 0:
            self.rank = info.rank
        if info.seq > 0:
            text = str(error).lower()
            kind = "timed out" if any(w in text for w in _TIMEOUT_WORDS) else "failed"
            self.dump(f"{info.op} #{info.seq} of group {info.group} {kind}: {entry.error}")

    def group_created(self, name: str, ranks: list[int], rank: int, backend: str) -> None:
        self.groups[name] = {"ranks": list(ranks), "backend": backend, "destroyed": False}
        self.rank = rank

    def group_destroyed(self, name: str) -> None:
        if name in self.groups:
            self.groups[name]["destroyed"] = True

    # ------------------------------------------------------------ output
    def entries(self) -> list[_Entry]:
        """The recorded operations, oldest first."""
        return sorted((e for e in list(self._ring) if e is not None), key=lambda e: e.index)

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        return int(os.environ.get("RANK", "-1") or -1)

    def _path(self, stem: str) -> str:
        rank = self._rank()
        name = f"{stem}{rank}" if rank >= 0 else f"{stem}-pid{os.getpid()}"
        return os.path.join(self.settings.dump_dir, name + ".json")

    def dump(self, reason: str) -> str:
        """Write this rank's dump (and trace, with tracing on); return the dump's path."""
        with self._dump_lock:
            now = time.time()
            data = {
                "format": DUMP_FORMAT, "rank": self._rank(), "pid": os.getpid(), "host": socket.gethostname(),
                "time": now, "reason": reason, "capacity": self.settings.capacity, "groups": self.groups,
                "entries": [e.as_dict(now) for e in self.entries()],
            }
            path = self._path("rank")
            _write_json(path, data)
            if self._trace is not None:
                _write_json(self._path("trace-rank"), trace_events(self._rank(), [e.as_dict(now) for e in self._trace]))
            return path


def trace_events(rank: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace events (one complete event per operation, one thread per group)."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    for e in entries:
        events.append({
            "name": f"{e['op']} #{e['seq']}", "cat": e["backend"], "ph": "X", "pid": rank, "tid": e["group"],
            "ts": e["issued_time"] * 1e6, "dur": max((e["duration"] or 0.0) * 1e6, 0.0),
            "args": {k: e[k] for k in ("state", "shapes", "dtype", "nbytes", "reduce_op", "root", "peer", "tag",
                                       "error")},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _write_json(path: str, data: Any) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(data, f)
    os.replace(temporary, path)


_recorder: Optional[Recorder] = None


def current() -> Optional[Recorder]:
    """The running recorder, or None when it is off."""
    return _recorder


def start(settings: Settings) -> Recorder:
    """Start recording with ``settings`` (once per process): SIGUSR1 dumps; with
    ``at_exit``, exit and SIGTERM dump too (handlers only replace default ones)."""
    global _recorder
    if _recorder is not None:
        return _recorder
    _recorder = recorder = Recorder(settings)
    if threading.current_thread() is threading.main_thread():
        _install(signal.SIGUSR1, lambda: recorder.dump("SIGUSR1"), then_default=False)
        if settings.at_exit:
            _install(signal.SIGTERM, lambda: recorder.dump("SIGTERM"), then_default=True)
    if settings.at_exit:
        atexit.register(recorder.dump, "exit")
    return recorder


def _install(signum: signal.Signals, action: Any, then_default: bool) -> None:
    if signal.getsignal(signum) not in (signal.SIG_DFL, None):
        return  # the program handles it: leave it alone

    def handler(_signum: int, _frame: Any) -> None:
        try:
            action()
        finally:
            if then_default:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

    signal.signal(signum, handler)


def enable(capacity: int = 2000, dump_dir: str = "tdist-debug", at_exit: bool = False, trace: bool = False) -> Recorder:
    """Turn the recorder on in this process (as ``TDIST_DEBUG_RECORDER`` does at start)."""
    from tdist._plugins import plugins

    from . import hooks

    recorder = start(Settings(capacity, dump_dir, at_exit, trace))
    plugins().register(hooks, "tdist-debug-recorder")
    return recorder
