"""Worker processes of :mod:`tdist.launch`: starting them, prefixing their output,
noticing failures and stopping them without leaving orphans.

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
import time
from dataclasses import dataclass, field
from typing import IO, Callable, Optional, Sequence

from .._local import free_port

__all__ = ["WorkerSpec", "Worker", "WorkerGroup", "free_port", "exit_status", "describe_status", "group_members"]

_POLL_INTERVAL = 0.02


def exit_status(returncode: int) -> int:
    """A process's exit status as a shell reports it: ``128 + signal`` for a signal."""
    return 128 - returncode if returncode < 0 else returncode


def describe_status(returncode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"``."""
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


def _pdeathsig_preexec() -> Optional[Callable[[], None]]:
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
class WorkerSpec:
    """What to run for one worker, and under which ranks."""

    rank: int
    local_rank: int
    cmd: list[str]
    env: dict[str, str] = field(default_factory=dict)


class Worker:
    """One running worker process and the threads that copy its output."""

    def __init__(self, spec: WorkerSpec, proc: "subprocess.Popen[bytes]") -> None:
        self.spec = spec
        self.proc = proc
        self.pid = proc.pid
        self.pgid = proc.pid  # start_new_session: the worker leads its own group
        self.threads: list[threading.Thread] = []

    @property
    def rank(self) -> int:
        return self.spec.rank

    def poll(self) -> Optional[int]:
        return self.proc.poll()

    def signal_group(self, signum: int) -> None:
        """Send ``signum`` to the worker's whole process group (no error if it is gone)."""
        try:
            os.killpg(self.pgid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def __repr__(self) -> str:
        return f"<Worker rank {self.rank} pid {self.pid} returncode {self.proc.returncode}>"


class _LinePump:
    """Copies lines from a worker's pipe to one of the launcher's streams, prefixed."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock

    def run(self, pipe: IO[bytes], sink: IO, prefix: bytes) -> None:
        out = getattr(sink, "buffer", None)
        broken = False
        try:
            for line in iter(pipe.readline, b""):
                if broken:
                    continue  # keep draining so the worker never blocks on a full pipe
                if not line.endswith(b"\n"):
                    line += b"\n"
                try:
                    with self._lock:
                        if out is not None:
                            out.write(prefix + line)
                        else:
                            sink.write((prefix + line).decode(errors="replace"))
                        sink.flush()
                except (BrokenPipeError, ValueError, OSError):
                    broken = True
        finally:
            pipe.close()


class WorkerGroup:
    """The workers of one launch.

    ``prefix``: copy each worker's stdout/stderr through pipes, each line prefixed
    with ``[rank N] ``; otherwise workers write straight to the launcher's streams.
    ``grace_period``: seconds between SIGTERM and SIGKILL when stopping workers.
    ``log``: where the launcher's own messages go (default ``sys.stderr``).
    """

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        *,
        prefix: bool = True,
        grace_period: float = 5.0,
        stdout: Optional[IO] = None,
        stderr: Optional[IO] = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.prefix = prefix
        self.grace_period = grace_period
        self.stdout = stdout if stdout is not None else sys.stdout
        self.stderr = stderr if stderr is not None else sys.stderr
        self.log = log or self._default_log
        self.workers: list[Worker] = []
        self._out_lock = threading.Lock()
        self._pending_signal: Optional[int] = None
        self._signalled = 0
        self._stopping = False

    def _default_log(self, message: str) -> None:
        with self._out_lock:
            try:
                self.stderr.write(f"tdistrun: {message}\n")
                self.stderr.flush()
            except (OSError, ValueError):
                pass

    # ------------------------------------------------------------------ starting
    def start(self) -> None:
        """Start every worker, then the threads that copy their output."""
        preexec = _pdeathsig_preexec()
        pipe = subprocess.PIPE if self.prefix else None
        for stream in (self.stdout, self.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        try:
            for spec in self.specs:
                proc = subprocess.Popen(
                    spec.cmd,
                    env=spec.env,
                    stdout=pipe,
                    stderr=pipe,
                    start_new_session=True,
                    preexec_fn=preexec,
                )
                self.workers.append(Worker(spec, proc))
        except BaseException:
            self.kill_all()
            raise
        if self.prefix:
            pump = _LinePump(self._out_lock)
            for worker in self.workers:
                prefix = f"[rank {worker.rank}] ".encode()
                for pipe_, sink in ((worker.proc.stdout, self.stdout), (worker.proc.stderr, self.stderr)):
                    thread = threading.Thread(
                        target=pump.run, args=(pipe_, sink, prefix), name=f"tdistrun-rank{worker.rank}", daemon=True
                    )
                    thread.start()
                    worker.threads.append(thread)

    # ------------------------------------------------------------------ signals
    def on_signal(self, signum: int, _frame: object = None) -> None:
        """Signal handler for the launcher: forward ``signum`` to every worker at once.

        The main loop then waits for them; a second signal while stopping
        escalates to SIGKILL.
        """
        if self._stopping or self._pending_signal is not None:
            self.kill_all()
        else:
            self._pending_signal = signum
            self._signalled = len(self.workers)
            self.signal_all(signum)

    def signal_all(self, signum: int) -> None:
        for worker in self.workers:
            worker.signal_group(signum)

    def kill_all(self) -> None:
        self.signal_all(signal.SIGKILL)

    # ------------------------------------------------------------------ running
    def run(self) -> int:
        """Wait for the workers; return the launcher's exit status.

        0 when every worker exits 0. When a worker fails, the others are stopped
        and its exit status is returned. When the launcher gets a signal, it has
        been forwarded; the workers are given ``grace_period`` to exit and
        ``128 + signal`` is returned.
        """
        try:
            while True:
                if self._pending_signal is not None:
                    signum = self._pending_signal
                    for worker in self.workers[self._signalled :]:  # started after the signal came
                        worker.signal_group(signum)
                    alive = [w for w in self.workers if w.poll() is None]
                    self.log(
                        f"received {signal.Signals(signum).name}; forwarded it to {len(alive)} running worker(s)"
                    )
                    self.stop(first_signal=None)
                    return 128 + signum
                running = False
                for worker in self.workers:
                    code = worker.poll()
                    if code is None:
                        running = True
                    elif code != 0:
                        if self._pending_signal is not None:
                            break  # killed by the signal we just forwarded: handled above
                        return self._on_failure(worker, code)
                else:
                    if not running:
                        return 0
                    time.sleep(_POLL_INTERVAL)
        finally:
            self.close()

    def _on_failure(self, worker: Worker, code: int) -> int:
        others = [w for w in self.workers if w is not worker and w.poll() is None]
        self.log(
            f"rank {worker.rank} (local rank {worker.spec.local_rank}, pid {worker.pid}) failed with "
            f"{describe_status(code)}; stopping {len(others)} other worker(s)"
        )
        self.stop()
        self.log(f"rank {worker.rank} failed with {describe_status(code)}")
        return exit_status(code)

    def stop(self, first_signal: Optional[int] = signal.SIGTERM) -> None:
        """Stop every worker: ``first_signal`` (None: already sent), then SIGKILL to
        whatever is left of their process groups after ``grace_period``."""
        self._stopping = True
        if first_signal is not None:
            self.signal_all(first_signal)
        deadline = time.monotonic() + self.grace_period
        while time.monotonic() < deadline:
            if all(w.poll() is not None for w in self.workers) and not self._leftovers():
                break
            time.sleep(_POLL_INTERVAL)
        stragglers = [w for w in self.workers if w.poll() is None]
        if stragglers:
            self.log(
                f"rank(s) {[w.rank for w in stragglers]} still running after {self.grace_period:g} s grace period; "
                "sending SIGKILL"
            )
        self.kill_all()
        for worker in self.workers:
            try:
                worker.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def _leftovers(self) -> list[int]:
        """Live processes in the workers' groups (workers or what they started)."""
        return [pid for w in self.workers for pid in group_members(w.pgid)]

    def close(self) -> None:
        """Make sure nothing the launch started survives it, and drain the output."""
        if any(w.poll() is None for w in self.workers) or self._leftovers():
            # Workers still running (the launcher itself failed), or processes the
            # workers started and left behind: they would be orphans.
            self.stop()
        for worker in self.workers:
            for thread in worker.threads:
                thread.join(timeout=2.0)
