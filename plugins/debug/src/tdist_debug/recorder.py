"""The flight recorder: the last N operations of this rank, in a ring buffer.

Recording an operation costs a tuple of its description, a few stores into
preallocated arrays and a dict insert (the core builds the :class:`tdist.WorkInfo`
only while some plugin observes work); nothing recorded is tracked by the garbage
collector, so a full ring does not slow collections down. A dump writes the
ring, oldest first, with this rank's groups, to ``<dump dir>/rank<R>.json``
(replaced atomically, mode 0600, only in a directory no other user can plant files
in: :mod:`tdist_debug.dumpfiles`); with tracing on, every operation also goes to
``trace-rank<R>.json`` in Chrome's trace-event format (chrome://tracing, Perfetto).
"""

from __future__ import annotations

import array
import atexit
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

from .dumpfiles import DumpDirRefused, write_json
from .settings import Settings, enabled_by_env

__all__ = ["Recorder", "current", "enable", "start", "DUMP_FORMAT"]

#: The ``format`` field of every dump (the analyser checks it).
DUMP_FORMAT = "tdist-debug/1"
_TIMEOUT_WORDS = ("timeout", "timed out", "did not complete within")
#: The fields of a record, in order. A record is a flat tuple of plain values (the group's
#: ranks are one shared tuple per group) followed by the dimensions of the operation's
#: one shape, or by one JSON string when it has several: the garbage collector stops
#: tracking such a tuple at its first collection, so a full ring costs no collection time.
FIELDS = (
    "op",
    "group",
    "seq",
    "group_ranks",
    "dtype",
    "nbytes",
    "backend",
    "reduce_op",
    "root",
    "peer",
    "tag",
    "issued_time",
)
_PENDING = -1.0


def _record(info: Any, shared: dict) -> tuple:
    ranks = info.group_ranks
    head = (
        info.op,
        info.group,
        info.seq,
        shared.setdefault(ranks, ranks),
        info.dtype,
        info.nbytes,
        info.backend,
        info.reduce_op,
        info.root,
        info.peer,
        info.tag,
        info.issued_time,
    )
    shapes = info.shapes
    if len(shapes) == 1:
        return head + tuple(shapes[0])
    return head + (json.dumps([list(s) for s in shapes]),)


def _as_dict(record: tuple, duration: float, error: Optional[str], now: float) -> dict[str, Any]:
    width = len(FIELDS)
    entry = dict(zip(FIELDS, record[:width]))
    entry["group_ranks"] = list(entry["group_ranks"])
    rest = record[width:]
    if rest and isinstance(rest[0], str):
        entry["shapes"] = json.loads(rest[0])
    else:
        entry["shapes"] = [list(rest)] if entry["dtype"] else []
    entry["state"] = "failed" if error is not None else ("pending" if duration == _PENDING else "completed")
    entry["duration"] = now - entry["issued_time"] if entry["state"] == "pending" else duration
    entry["error"] = error
    return entry


class Recorder:
    """The last ``settings.capacity`` operations of this process, and its groups.

    Slot ``i % capacity`` of the ring holds operation ``i``: its record, its duration
    (-1 while pending) and, for a failure, its error in ``_errors``.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._capacity = capacity = settings.capacity
        self._records: list[Optional[tuple]] = [None] * capacity
        self._durations = array.array("d", [_PENDING]) * capacity
        self._indices = array.array("q", [-1]) * capacity
        self._errors: dict[int, str] = {}
        self._shared: dict[tuple, tuple] = {}
        self._count = itertools.count()
        self._pending: dict[int, int] = {}
        self._trace: Optional[list[tuple[int, tuple]]] = [] if settings.trace else None
        self._trace_ends: dict[int, tuple[float, Optional[str]]] = {}
        self.groups: dict[str, dict[str, Any]] = {}
        self.rank: Optional[int] = None
        self._dump_lock = threading.Lock()
        self._refused = False

    # ------------------------------------------------------------ recording
    def _add(self, info: Any) -> int:
        index = next(self._count)
        slot = index % self._capacity
        record = _record(info, self._shared)
        self._records[slot] = record
        self._durations[slot] = _PENDING
        self._indices[slot] = index
        if self._trace is not None:
            self._trace.append((index, record))
        return index

    def _end(self, index: int, duration: float, error: Optional[str] = None) -> None:
        slot = index % self._capacity
        if self._indices[slot] == index:
            self._durations[slot] = duration
            if error is not None:
                self._errors[index] = error
                if len(self._errors) > self._capacity:  # forget errors whose slots were reused
                    oldest = self._indices[(slot + 1) % self._capacity]
                    self._errors = {i: e for i, e in self._errors.items() if i >= oldest}
        if self._trace is not None:
            self._trace_ends[index] = (duration, error)

    def issued(self, info: Any) -> None:
        self._pending[id(info)] = self._add(info)

    def completed(self, info: Any, duration: float) -> None:
        index = self._pending.pop(id(info), None)
        if index is not None:
            self._end(index, duration)

    def fast_hooks(self) -> tuple[Any, Any]:
        """(issued, completed) doing what :meth:`issued` and :meth:`completed` do, with
        the ring in closure variables: the per-operation path, without tracing."""
        count, capacity, records, durations, indices = (
            self._count,
            self._capacity,
            self._records,
            self._durations,
            self._indices,
        )
        pending, pop, shared = self._pending, self._pending.pop, self._shared

        def issued(info: Any) -> None:
            index = next(count)
            slot = index % capacity
            records[slot] = _record(info, shared)
            durations[slot] = _PENDING
            indices[slot] = index
            pending[id(info)] = index

        def completed(info: Any, duration: float) -> None:
            index = pop(id(info), None)
            if index is not None and indices[index % capacity] == index:
                durations[index % capacity] = duration

        return issued, completed

    def failed(self, info: Any, error: BaseException, duration: float = 0.0) -> None:
        """Record the failure; an operation that was issued (``seq`` > 0) also dumps."""
        index = self._pending.pop(id(info), None)
        if index is None:  # rejected before it was issued: recorded, not dumped
            index = self._add(info)
        text = f"{type(error).__name__}: {error}"
        self._end(index, duration, text)
        if self.rank is None and info.rank >= 0:
            self.rank = info.rank
        if info.seq > 0:
            kind = "timed out" if any(w in text.lower() for w in _TIMEOUT_WORDS) else "failed"
            self.dump(f"{info.op} #{info.seq} of group {info.group} {kind}: {text}")

    def group_created(self, name: str, ranks: list[int], rank: int, backend: str) -> None:
        self.groups[name] = {"ranks": list(ranks), "backend": backend, "destroyed": False}
        self.rank = rank

    def group_destroyed(self, name: str) -> None:
        if name in self.groups:
            self.groups[name]["destroyed"] = True

    # ------------------------------------------------------------ output
    def entries(self, now: float) -> list[dict[str, Any]]:
        """The recorded operations, oldest first, as dictionaries."""
        slots = sorted((i, slot) for slot, i in enumerate(list(self._indices)) if i >= 0)
        errors = dict(self._errors)
        found = []
        for index, slot in slots:
            record, duration = self._records[slot], self._durations[slot]
            if record is not None and self._indices[slot] == index:
                found.append(_as_dict(record, duration, errors.get(index), now))
        return found

    def traced(self, now: float) -> list[dict[str, Any]]:
        """Every operation since the start (tracing on), as dictionaries."""
        ends = dict(self._trace_ends)
        return [_as_dict(record, *ends.get(index, (_PENDING, None)), now) for index, record in list(self._trace or ())]

    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        return int(os.environ.get("RANK", "-1") or -1)

    def _path(self, stem: str) -> str:
        rank = self._rank()
        name = f"{stem}{rank}" if rank >= 0 else f"{stem}-pid{os.getpid()}"
        return os.path.join(self.settings.dump_dir, name + ".json")

    def dump(self, reason: str) -> Optional[str]:
        """Write this rank's dump (and trace, with tracing on); return the dump's path, or
        None when the dump directory is refused (see :mod:`tdist_debug.dumpfiles`)."""
        with self._dump_lock:
            now = time.time()
            data = {
                "format": DUMP_FORMAT,
                "rank": self._rank(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "time": now,
                "reason": reason,
                "capacity": self.settings.capacity,
                "groups": self.groups,
                "entries": self.entries(now),
            }
            path = self._path("rank")
            try:
                write_json(path, data)
                if self._trace is not None:
                    write_json(self._path("trace-rank"), trace_events(self._rank(), self.traced(now)))
            except DumpDirRefused as exc:  # said once; the job goes on without dumps
                if not self._refused:
                    self._refused = True
                    print(f"tdist-debug: {exc.strerror}", file=sys.stderr, flush=True)
                return None
            return path


def trace_events(rank: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace events (one complete event per operation, one thread per group)."""
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}]
    for e in entries:
        events.append(
            {
                "name": f"{e['op']} #{e['seq']}",
                "cat": e["backend"],
                "ph": "X",
                "pid": rank,
                "tid": e["group"],
                "ts": e["issued_time"] * 1e6,
                "dur": max((e["duration"] or 0.0) * 1e6, 0.0),
                "args": {
                    k: e[k] for k in ("state", "shapes", "dtype", "nbytes", "reduce_op", "root", "peer", "tag", "error")
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_recorder: Optional[Recorder] = None


def current() -> Optional[Recorder]:
    """The running recorder, or None when it is off."""
    return _recorder


def start(settings: Settings) -> Recorder:
    """Start recording with ``settings`` (once per process): SIGUSR1 dumps; with
    ``at_exit``, exit and SIGTERM dump too. A handler the program installed is left
    alone (SIGUSR1's is replaced when default or ignored, SIGTERM's only when default)."""
    global _recorder
    if _recorder is not None:
        return _recorder
    _recorder = recorder = Recorder(settings)
    if threading.current_thread() is threading.main_thread():
        # SIGUSR1 also over an ignored one: SIG_IGN is inherited from the parent process
        _install(signal.SIGUSR1, lambda: recorder.dump("SIGUSR1"), then_default=False, over_ignored=True)
        if settings.at_exit:
            _install(signal.SIGTERM, lambda: recorder.dump("SIGTERM"), then_default=True)
    if settings.at_exit:
        atexit.register(recorder.dump, "exit")
    return recorder


def _install(signum: signal.Signals, action: Any, then_default: bool, over_ignored: bool = False) -> None:
    replaceable = (signal.SIG_DFL, None, signal.SIG_IGN) if over_ignored else (signal.SIG_DFL, None)
    if signal.getsignal(signum) not in replaceable:
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
    """Turn the recorder on in this process (as ``TDIST_DEBUG_RECORDER`` does when the
    plugins load); the running recorder if it is on already."""
    from tdist.plugin import register_plugin, registered_plugins

    from .hooks import recorder_plugin

    recorder = start(Settings(capacity, dump_dir, at_exit, trace))
    if not enabled_by_env() and "tdist-debug-recorder" not in registered_plugins():
        register_plugin(recorder_plugin(recorder), "tdist-debug-recorder")  # else its hooks are in already
    return recorder
