"""The shared-memory engine's waiting policy: when a waiting rank spins, and when it
sleeps in ``futex(2)`` at once.

A rank that has posted a step waits for its peers' counters (:mod:`tdist_tcp.shared.shmstep`).
It can spin, re-reading them, or sleep until a poster wakes it. A spin answers within a
microsecond, but it pays only while the peer being waited for runs on another CPU and
nobody else wants the spinner's: with more runnable threads than CPUs, every microsecond
spun is taken from a peer that has yet to post, or from the rank's own computation
(torch's DDP runs its backward pass while its all-reduces wait), and a sleep and wake
(tens of microseconds) is the cheaper wait.

The policy (:func:`decide`), fixed when a group's segment is mapped:

- ``shm_spin_us`` given: spin that long (0: never), whatever the rest says;
- members that are threads of one process: never spin (they share one GIL);
- more members (the group's ranks on this host) than *usable CPUs* (:func:`usable_cpus`:
  the CPUs the members may run on, the union of their affinity masks, capped by this
  process's cgroup CPU quota): never spin; yield the CPU once (``sched_yield``, so that a
  runnable peer on this CPU can post first), then sleep;
- otherwise spin up to :data:`DEFAULT_SPIN_US`, but only while a CPU is free: from the
  first microseconds of a spin on, and then every :data:`CHECK_US`, the waiter reads the
  number of runnable threads (:class:`RunQueue`, the kernel's ``/proc/loadavg``) and goes to
  sleep as soon as they outnumber the host's online CPUs (another job, or the ranks' own
  threads).

The C part (:mod:`tdist_tcp.shared.native`) applies the same policy in its bounded spin. Since
every step of an oversubscribed group costs a sleep and a wake, such a group also takes
fewer steps: :func:`tdist_tcp.shared.shm.open_shm` gives it bigger buffers (4 MiB instead of 1 MiB
per rank, unless ``shm_slot_bytes`` says otherwise), so a large collective takes a
quarter of the rounds.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "DEFAULT_SPIN_US",
    "CHECK_US",
    "WaitPolicy",
    "decide",
    "oversubscribed",
    "usable_cpus",
    "cgroup_cpu_limit",
    "online_cpus",
    "RunQueue",
    "run_queue",
]

#: The longest spin (microseconds) of a waiter that has a CPU to itself.
DEFAULT_SPIN_US = 100.0
#: How often (microseconds) a spinning waiter checks that a CPU is still free.
CHECK_US = 20.0


@dataclass(frozen=True)
class WaitPolicy:
    """How a rank waits for its peers: spin at most ``spin`` seconds (``adaptive``: only
    while the host has a CPU free, :meth:`RunQueue.busy`), then sleep; ``yield_first``:
    give the CPU away once (``sched_yield``) before sleeping. ``why`` says which rule."""

    spin: float
    adaptive: bool
    yield_first: bool
    why: str


def oversubscribed(ranks_on_host: int, usable: int) -> bool:
    """Whether the ranks on the host outnumber the CPUs they may use: every step then waits
    for a rank that is not running (the engine also takes bigger rounds, so fewer steps)."""
    return ranks_on_host > usable


def decide(ranks_on_host: int, usable: int, spin_us: Optional[float] = None, same_process: bool = False) -> WaitPolicy:
    """The policy of a segment shared by ``ranks_on_host`` ranks that may use ``usable`` CPUs
    between them (see the module's docstring); ``spin_us``: the ``shm_spin_us`` option."""
    if spin_us is not None:
        return WaitPolicy(max(float(spin_us), 0.0) * 1e-6, False, False, "shm_spin_us")
    if same_process:
        return WaitPolicy(0.0, False, False, "threads of one process")
    if oversubscribed(ranks_on_host, usable):
        return WaitPolicy(0.0, False, True, f"{ranks_on_host} ranks on {usable} CPUs")
    return WaitPolicy(DEFAULT_SPIN_US * 1e-6, True, False, f"{ranks_on_host} ranks on {usable} CPUs")


def usable_cpus(pids: Sequence[int] = ()) -> int:
    """The CPUs this process and ``pids`` may run on between them (the union of their
    affinity masks; a pid that cannot be asked is left out), capped by this process's
    cgroup CPU quota (:func:`cgroup_cpu_limit`); at least 1."""
    cpus: set[int] = set()
    for pid in (0, *pids):
        try:
            cpus |= os.sched_getaffinity(pid)
        except (OSError, AttributeError):
            continue
    n = len(cpus) or online_cpus()
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, limit)
    return max(1, n)


def online_cpus() -> int:
    """The host's online CPUs (what the kernel's count of runnable threads compares to)."""
    return os.cpu_count() or 1


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> Optional[int]:
    """The CPUs this process's cgroup quota allows (quota / period, rounded up), or None
    without a quota. cgroup v2 (``cpu.max`` of the process's cgroup and of the root seen
    here, as in a container) and v1 (``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    rel = {"v2": "", "v1": ""}
    for line in (_read(proc_cgroup) or "").splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            rel["v2"] = path.strip("/")
        elif "cpu" in controllers.split(","):
            rel["v1"] = path.strip("/")
    quotas: list[int] = []
    for path in {os.path.join(root, rel["v2"]), root}:
        text = _read(os.path.join(path, "cpu.max"))
        if text:
            quota, _, period = text.partition(" ")
            if quota != "max" and quota.isdigit() and period.isdigit() and int(period) > 0:
                quotas.append(math.ceil(int(quota) / int(period)))
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        for path in {os.path.join(root, sub, rel["v1"]), os.path.join(root, sub)}:
            quota_text = _read(os.path.join(path, "cpu.cfs_quota_us"))
            period_text = _read(os.path.join(path, "cpu.cfs_period_us"))
            try:
                us, period_us = int(quota_text or "-1"), int(period_text or "0")
            except ValueError:
                continue
            if us > 0 and period_us > 0:
                quotas.append(math.ceil(us / period_us))
    return max(1, min(quotas)) if quotas else None


class RunQueue:
    """The host's count of runnable threads (``/proc/loadavg``'s fourth field, read with
    one ``pread``), against its online CPUs."""

    __slots__ = ("_fd", "cpus")

    def __init__(self) -> None:
        self.cpus = online_cpus()
        try:
            self._fd: Optional[int] = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = None

    def runnable(self) -> int:
        """Threads running or waiting for a CPU now (0 if it cannot be read)."""
        if self._fd is None:
            return 0
        try:
            text = os.pread(self._fd, 128, 0)
            return int(text.split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return 0

    def busy(self) -> bool:
        """Whether some thread waits for a CPU: more runnable threads than online CPUs."""
        return self.runnable() > self.cpus


_RUN_QUEUE: Optional[RunQueue] = None


def run_queue() -> RunQueue:
    """The process's :class:`RunQueue` (one descriptor, opened on first use, for every group)."""
    global _RUN_QUEUE
    if _RUN_QUEUE is None:
        _RUN_QUEUE = RunQueue()
    return _RUN_QUEUE
