"""Operating-system side of :mod:`tdist.launch`'s workers (no torch here): where a
worker's output goes, how a worker process starts, and how its exit status reads.

Each worker starts in its own session (hence its own process group), so the
launcher can signal a worker *and everything it started* with ``os.killpg``,
and a terminal's Ctrl-C reaches only the launcher, which forwards it. On Linux
a worker also gets ``PR_SET_PDEATHSIG`` so that it dies with the launcher even
if the launcher is killed with SIGKILL and cannot clean up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, IO, Callable, Optional, Sequence

__all__ = [
    "OutputRoute",
    "start_pump",
    "OUTPUT_LOCK",
    "write_locked",
    "exit_status",
    "describe_status",
    "group_members",
    "pdeathsig_preexec",
    "popen_target",
]

#: Orders every write to the launcher's streams (workers' lines, the launcher's own
#: messages) and to the shared filtered files, so that lines never interleave.
OUTPUT_LOCK = threading.Lock()


def write_locked(sink: IO, data: bytes) -> None:
    """Write ``data`` to ``sink`` (a text stream with a buffer, or any text/binary stream)
    and flush it, under :data:`OUTPUT_LOCK`."""
    with OUTPUT_LOCK:
        out = getattr(sink, "buffer", None)
        if out is not None:
            sink.flush()
            out.write(data)
            out.flush()
        else:
            sink.write(data.decode(errors="replace"))
        sink.flush()


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + signal`` for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL (exit status 137)"``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"signal {name} (exit status {exit_status(returncode)})"
    return f"exit code {returncode}"


def group_members(pgid: int) -> list[int]:
    """The pids of the live (non-zombie) processes in process group ``pgid``.

    Scans ``/proc`` on Linux; elsewhere returns ``[pgid]`` if ``killpg(pgid, 0)``
    finds anyone in the group, else ``[]``.
    """
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        # fields: state, ppid, pgrp, session, ...
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(entry))
    return members


def pdeathsig_preexec() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that makes the child get SIGKILL when the launcher dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class OutputRoute:
    """Where one stream (stdout or stderr) of one worker goes.

    ``console``: the launcher's stream to copy lines to (None: not shown), each line
    prefixed with ``prefix``. ``log_file``: a file that gets the lines as written
    (None: no file). ``filtered``: a file shared by the workers that gets the prefixed
    lines containing any of ``needles`` (torchrun's ``--duplicate-std*-filters``).
    """

    console: Optional[IO] = None
    prefix: bytes = b""
    log_file: Optional[IO[bytes]] = None
    filtered: Optional[IO] = None
    needles: Sequence[bytes] = field(default_factory=tuple)

    @property
    def needs_pipe(self) -> bool:
        """Whether the launcher must read the stream itself (rather than hand the worker
        its own stream, a file, or /dev/null)."""
        if self.filtered is not None and self.needles:
            return True
        if self.console is not None:
            return bool(self.prefix) or self.log_file is not None
        return False


def popen_target(route: OutputRoute) -> Any:
    """The ``stdout=``/``stderr=`` argument of ``Popen`` for ``route``."""
    if route.needs_pipe:
        return subprocess.PIPE
    if route.log_file is not None:
        return route.log_file
    if route.console is not None:
        return None  # the worker writes to the launcher's own stream
    return subprocess.DEVNULL


def start_pump(pipe: IO[bytes], route: OutputRoute, name: str) -> threading.Thread:
    """A daemon thread that copies the lines of a worker's ``pipe`` to ``route`` until it closes."""
    thread = threading.Thread(target=_pump, args=(pipe, route), name=name, daemon=True)
    thread.start()
    return thread


def _pump(pipe: IO[bytes], route: OutputRoute) -> None:
    broken = False
    try:
        for raw in iter(pipe.readline, b""):
            line = raw if raw.endswith(b"\n") else raw + b"\n"
            if route.log_file is not None:
                try:
                    route.log_file.write(raw)
                    route.log_file.flush()
                except (OSError, ValueError):
                    pass
            if route.filtered is not None and any(needle in line for needle in route.needles):
                try:
                    write_locked(route.filtered, route.prefix + line)
                except (OSError, ValueError):
                    pass
            if route.console is not None and not broken:
                try:
                    write_locked(route.console, route.prefix + line)
                except (OSError, ValueError):
                    broken = True  # keep draining so the worker never blocks on a full pipe
    finally:
        pipe.close()
