"""A simulated cluster on this machine: N hosts, each with its own network, host name
and ``/dev/shm``, for multi-host tests and benchmarks. Linux, as root.

Each :class:`Host` is a set of namespaces:

- **network**: one interface, ``eth0``, linked to the cluster's switch, with
  ``10.77.0.<i+1>/24`` and ``fd77::<i+1>/64`` (no duplicate address detection: both
  usable at once), multicast on (a route for ``224.0.0.0/4``; IPv6 has ``ff00::/8`` on
  every interface), and its own loopback;
- **UTS**: its own host name, ``host<i>-<cluster token>``; the host's ``/etc/hosts``
  maps every host name to its IPv4 address, so ``gethostbyname(gethostname())`` is
  the host's address (gloo and Open MPI rely on that);
- **mount** and **IPC**: a private tmpfs on ``/dev/shm``, so shared memory never
  crosses hosts; the rest of the file system is this machine's, as if shared over NFS:
  a directory made here (e.g. :attr:`Cluster.workdir`) is seen by every host.

Process ids stay this machine's (no PID namespace: Open MPI's daemons, started from
one host, must enter another, which a sibling PID namespace forbids).

The switch lives in a network namespace of its own: a kernel bridge with multicast
snooping off (multicast reaches every host), or, when the links have a delay, the
user-space switch of :mod:`tdist.testing._delayline` (this kernel has ``tbf`` but no
``netem``). Links are shaped per host: ``rate`` (bits per second; ``tbf`` on both ends
of the host's link, so both directions) and ``delay`` (seconds added to every frame the
host sends, as ``netem delay`` on its ``eth0`` would).

Nothing is created in this machine's own network namespace. Namespace and directory
names start with ``tdc-<owner pid>-<owner start time>-``, unique per cluster.
:meth:`Cluster.close` (also on an exception, at interpreter exit, and in the pytest
fixture ``tdist_cluster`` when a test fails) kills every process and removes every
namespace, mount and file. If the owner is killed outright, each host's first process
(:mod:`tdist.testing._hostinit`) sees its pipe from the owner close and kills every
process of the host; the next cluster started on this machine (or
:func:`reclaim_stale`) removes the namespaces left.

The parts: :mod:`tdist.testing._netns` (what this machine must offer, the namespaces,
the switch, link shaping, removing what a killed owner left), :mod:`tdist.testing._hosts`
(a host's commands, processes and link) and this module, the cluster's life; every name
of the three that a user needs is importable from here.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from typing import Iterator, Optional, Sequence, Union

from ._hosts import KEEP, Host, HostCommandError, HostProcess
from ._netns import (
    PREFIX,
    SETUP_TIMEOUT,
    ClusterError,
    ClusterUnavailable,
    DelayLine,
    delete_netns,
    make_network,
    owner_tag,
    parse_rate,
    reclaim_stale,
    set_bridge_multicast,
    unavailable_reason,
)

__all__ = [
    "Cluster",
    "Host",
    "HostProcess",
    "ClusterError",
    "ClusterUnavailable",
    "HostCommandError",
    "KEEP",
    "unavailable_reason",
    "reclaim_stale",
    "parse_rate",
]

# Open MPI's stand-in for ssh (plm_ssh_agent): "AGENT [-options] HOST COMMAND..." runs
# COMMAND with /bin/sh on HOST, as sshd would.
_AGENT = """\
#!/bin/sh
# ssh for Open MPI (plm_ssh_agent) in tdist cluster {name}: AGENT [-options] HOST COMMAND...
while [ $# -gt 0 ] && [ "${{1#-}}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
{cases}
  *) echo "tdist cluster {name}: unknown host '$host'" >&2; exit 255;;
esac
exec {nsenter} --target="$pid" --net --mount --uts --ipc --wd=/ -- /bin/sh -c "$*"
"""


_LIVE: "weakref.WeakSet[Cluster]" = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for cluster in list(_LIVE):
        cluster.close()


class Cluster:
    """``hosts`` simulated hosts on one switch (see the module's description).

    ``rate``: every link's rate (bits per second, or ``"1gbit"``; None: unlimited).
    ``delay``: seconds added to every frame a host sends (the one-way delay between
    hosts; a round trip takes twice that). ``delay_line``: use the user-space switch even
    with no delay, so that :meth:`Host.set_link` can add one later (default: only when
    ``delay`` > 0; the kernel bridge is faster). ``multicast``: False makes the switch
    drop multicast (a network without it; hosts can still send); :meth:`set_multicast`
    changes it later. ``shm_size``: each host's ``/dev/shm`` (tmpfs syntax).

    Use as a context manager (``with Cluster(2) as cluster:``), or call :meth:`start`
    and :meth:`close`. Raises :class:`ClusterUnavailable` where namespaces cannot be made
    (see :func:`unavailable_reason`).
    """

    def __init__(
        self,
        hosts: int = 2,
        *,
        rate: Union[None, str, int, float] = None,
        delay: float = 0.0,
        delay_line: Optional[bool] = None,
        multicast: bool = True,
        shm_size: str = "1g",
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"Cluster: hosts must be 1..250, got {hosts}")
        if delay < 0:
            raise ValueError(f"Cluster: delay must not be negative, got {delay}")
        if delay > 0 and delay_line is False:
            raise ValueError("Cluster: a delay needs the delay line (delay_line=True, or leave it out)")
        if not re.fullmatch(r"[0-9]+[kmgKMG%]?", shm_size):
            raise ValueError(f"Cluster: shm_size must be a tmpfs size such as '512m' or '1g', got {shm_size!r}")
        self.token = secrets.token_hex(3)
        self.name = f"{PREFIX}{owner_tag()}-{self.token}"
        self.switch_netns = f"{self.name}-sw"
        self.hosts = [Host(self, i) for i in range(hosts)]
        self.rate = parse_rate(rate)
        self.delay = float(delay)
        self.uses_delay_line = bool(delay_line) or delay > 0
        self.multicast = bool(multicast)
        self.shm_size = shm_size
        self.workdir = ""
        self._procs: list[HostProcess] = []
        self._delayline: Optional[DelayLine] = None
        self._started = False
        self._closed = False

    # -------------------------------------------------------------- accessors
    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self._started else "not started")
        return f"<Cluster {self.name}: {len(self.hosts)} hosts, {state}>"

    @property
    def netns_names(self) -> list[str]:
        """Every network namespace of the cluster: the switch's, then the hosts'."""
        return [self.switch_netns] + [h.netns for h in self.hosts]

    @property
    def hosts_file(self) -> str:
        """The ``/etc/hosts`` every host sees."""
        return os.path.join(self.workdir, "hosts")

    @property
    def ssh_agent(self) -> str:
        """An executable that stands in for ``ssh HOST COMMAND...`` (HOST: a host name or
        address of this cluster), for Open MPI's ``plm_ssh_agent``."""
        return os.path.join(self.workdir, "ssh-agent")

    def mpirun_args(self, slots: int = 1, hosts: Optional[Sequence[Host]] = None) -> list[str]:
        """``mpirun`` options that place ``slots`` ranks on each of ``hosts`` (default: all),
        reached through :attr:`ssh_agent`. Run that ``mpirun`` on one of the hosts."""
        chosen = self.hosts if hosts is None else list(hosts)
        return [
            "--host",
            ",".join(f"{h.hostname}:{slots}" for h in chosen),
            "--prtemca",
            "plm_ssh_agent",
            self.ssh_agent,
        ]

    # ------------------------------------------------------------------- life
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> "Cluster":
        """Make the namespaces, the switch and the links, and start every host."""
        if self._started:
            raise ClusterError(f"{self!r} was already started")
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(f"simulated cluster: {reason}")
        reclaim_stale()
        self._started = True
        _LIVE.add(self)
        try:
            self.workdir = tempfile.mkdtemp(prefix=self.name + "-")
            self._write_hosts_file()
            make_network(self.switch_netns, self.hosts, delay_line=self.uses_delay_line, multicast=self.multicast)
            if self.rate is not None:
                for host in self.hosts:
                    host.set_link(rate=self.rate)
            if self.uses_delay_line:
                self._delayline = DelayLine(
                    self.name, self.switch_netns, [h.switch_port for h in self.hosts], self.workdir
                )
                for host in self.hosts:
                    host.set_link(delay=self.delay)
                self.set_multicast(self.multicast)
            with open(os.path.join(self.workdir, "hosts.log"), "ab") as log:
                for host in self.hosts:
                    host._start(log)
            deadline = time.monotonic() + SETUP_TIMEOUT
            for host in self.hosts:
                host._wait_ready(deadline)
            self._write_ssh_agent()
        except BaseException:
            self.close()
            raise
        return self

    def _write_hosts_file(self) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address}\t{h.hostname}" for h in self.hosts]
        with open(self.hosts_file, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _write_ssh_agent(self) -> None:
        cases = "\n".join(f"  {h.hostname}|{h.address}|{h.address6}) pid={h.init_pid};;" for h in self.hosts)
        with open(self.ssh_agent, "w") as f:
            f.write(_AGENT.format(name=self.name, cases=cases, nsenter=shutil.which("nsenter") or "nsenter"))
        os.chmod(self.ssh_agent, 0o755)

    def set_multicast(self, enabled: bool) -> None:
        """Let the switch forward multicast (True, the default) or drop it (False)."""
        if self.uses_delay_line:
            self._delay_line_command(f"multicast {int(bool(enabled))}")
        else:
            set_bridge_multicast(self.switch_netns, [h.switch_port for h in self.hosts], enabled)
        self.multicast = bool(enabled)

    def _set_delay(self, host: Host, delay: float) -> None:
        if self._delayline is None:
            if delay > 0:
                raise ClusterError(
                    f"{host.hostname}: a delay needs a cluster with a delay line (Cluster(..., delay_line=True))"
                )
            return
        self._delay_line_command(f"delay {host.index} {delay!r}")

    def _delay_line_command(self, line: str) -> None:
        if self._delayline is None:
            raise ClusterError(f"the delay line of {self.name} is not running; see {self.workdir}/delayline.log")
        self._delayline.command(line)

    def close(self) -> None:
        """Kill every process on every host and the switch, and remove the namespaces and
        files. Idempotent; never raises for what is already gone."""
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            if proc._timer is not None:
                proc._timer.cancel()
            proc.signal_group(signal.SIGKILL)
        for host in self.hosts:
            host._stop()
        if self._delayline is not None:
            self._delayline.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        if self._started:
            delete_netns(self.netns_names)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        _LIVE.discard(self)
