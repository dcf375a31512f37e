"""The hosts of :mod:`tdist.testing.cluster`: :class:`Host` (one host's namespaces, the
commands run on it, its link) and :class:`HostProcess` (a command running on a host).
A host belongs to a :class:`~tdist.testing.cluster.Cluster`, which makes the network
(:mod:`tdist.testing._netns`) and starts and stops its hosts.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Optional, Sequence, Union

from ._hostinit import kill_netns, netns_inode, processes_in_netns
from ._netns import IFNAME, SETUP_TIMEOUT, ClusterError, parse_rate, python_script, read_line, setup, tc_rate

if TYPE_CHECKING:
    from .cluster import Cluster

__all__ = ["Host", "HostProcess", "HostCommandError", "KEEP"]


class HostCommandError(ClusterError):
    """A command run with :meth:`Host.run` failed (``check=True``) or ran past its
    timeout (``timeout`` set). ``returncode``, ``stdout``, ``stderr`` as captured."""

    def __init__(
        self,
        host: "Host",
        args: Sequence[str],
        returncode: Optional[int],
        stdout: str,
        stderr: str,
        timeout: Optional[float] = None,
    ) -> None:
        self.host, self.cmd, self.returncode = host, list(args), returncode
        self.stdout, self.stderr, self.timeout = stdout, stderr, timeout
        what = f"timed out after {timeout:g} s" if timeout is not None else f"exited with {returncode}"
        tail = (stderr or "")[-2000:]
        super().__init__(
            f"on {host.hostname} ({host.address}): {shlex.join(map(str, args))} {what}"
            + (f"; stderr ends with:\n{tail}" if tail.strip() else "")
        )


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()
"""For :meth:`Host.set_link`: leave that setting as it is."""


# ------------------------------------------------------------------ processes
class HostProcess(subprocess.Popen):
    """A process started by :meth:`Host.popen`, in a session of its own (``pid`` is the
    command's). Signals (``send_signal``, ``terminate``, ``kill``) go to its whole
    process group: the command and what it started in that group; ``os.kill(pid, ...)``
    reaches the command alone. ``timed_out`` is True once the ``timeout`` given to
    :meth:`Host.popen` expired and the group was killed."""

    host: "Host"
    timed_out: bool = False
    _timer: Optional[threading.Timer] = None

    def send_signal(self, sig: int) -> None:
        self.poll()
        if self.returncode is None:
            self.signal_group(sig)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group, even after the command itself has exited."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _expire(self) -> None:
        if self.poll() is None:
            self.timed_out = True
            self.signal_group(signal.SIGKILL)


class Host:
    """One host of a :class:`Cluster` (see the module's description).

    ``index``, ``hostname``, ``address`` (IPv4), ``address6`` (IPv6), ``ifname``
    (``eth0``), ``mac`` (its Ethernet address), ``netns`` (its network namespace's name, for ``ip -n``), ``rate`` (bits
    per second, None: unlimited) and ``delay`` (seconds) describe it; :meth:`popen` and
    :meth:`run` run commands on it.
    """

    def __init__(self, cluster: "Cluster", index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.hostname = f"host{index}-{cluster.token}"
        self.netns = f"{cluster.name}-h{index}"
        self.address = f"10.77.0.{index + 1}"
        self.address6 = f"fd77::{index + 1:x}"
        self.mac = f"02:77:00:00:{(index + 1) >> 8:02x}:{(index + 1) & 0xFF:02x}"
        self.ifname = IFNAME
        self.rate: Optional[float] = None
        self.delay = 0.0
        self._init: Optional[subprocess.Popen] = None

    def __repr__(self) -> str:
        return f"<Host {self.hostname} {self.address} [{self.address6}]>"

    @property
    def init_pid(self) -> int:
        """The pid of the host's first process, whose namespaces commands join (0: not running)."""
        return self._init.pid if self._init is not None and self._init.returncode is None else 0

    @property
    def switch_port(self) -> str:
        """The switch's end of this host's link (an interface in :attr:`Cluster.switch_netns`)."""
        return f"p{self.index}"

    # --------------------------------------------------------------- commands
    def enter_command(self, cwd: Optional[str] = None) -> list[str]:
        """The command prefix that runs a program on this host, in ``cwd`` (default:
        the caller's working directory)."""
        if not self.init_pid:
            raise ClusterError(f"{self.hostname} is not running (start the cluster first)")
        return [
            "nsenter",
            f"--target={self.init_pid}",
            "--net",
            "--mount",
            "--uts",
            "--ipc",
            f"--wd={cwd or os.getcwd()}",
            "--",
        ]

    def popen(
        self, args: Sequence[str], *, timeout: Optional[float] = None, cwd: Optional[str] = None, **kwargs: Any
    ) -> HostProcess:
        """Start ``args`` on this host, as :class:`subprocess.Popen` would (``env``,
        ``stdout``, ... as there; the environment is the caller's unless ``env`` is
        given). ``timeout``: seconds after which its process group is killed. It is
        killed when the cluster closes, at the latest."""
        for forbidden in ("start_new_session", "preexec_fn", "process_group"):
            if forbidden in kwargs:
                raise TypeError(f"Host.popen: {forbidden} is set by the cluster")
        proc = HostProcess(self.enter_command(cwd) + [str(a) for a in args], start_new_session=True, **kwargs)
        proc.host = self
        self.cluster._procs.append(proc)
        if timeout is not None:
            proc._timer = threading.Timer(timeout, proc._expire)
            proc._timer.daemon = True
            proc._timer.start()
        self._wait_entered(proc)
        return proc

    def _wait_entered(self, proc: HostProcess) -> None:
        """Return once ``proc`` runs in this host's network namespace (or has ended): from
        then on :meth:`processes`, :meth:`kill_all` and the host's end find it (a process
        still entering the namespace would escape them)."""
        net = netns_inode(self.init_pid)
        deadline = time.monotonic() + SETUP_TIMEOUT
        while proc.poll() is None and netns_inode(proc.pid) != net:
            if time.monotonic() > deadline:
                proc.signal_group(signal.SIGKILL)
                raise ClusterError(f"{self.hostname}: a command did not enter the host within {SETUP_TIMEOUT:g} s")
            time.sleep(0.001)

    def run(
        self,
        args: Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = False,
        input: Optional[str] = None,
        env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
    ) -> subprocess.CompletedProcess:
        """Run ``args`` on this host to completion, capturing its output as text.
        Past ``timeout`` seconds its process group is killed (every process on the host,
        if something outside the group still holds its output pipes) and
        :class:`HostCommandError` raised; so too with ``check`` and a non-zero exit."""
        proc = self.popen(
            args,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.signal_group(signal.SIGKILL)
            try:
                out, err = proc.communicate(timeout=5.0)
            except subprocess.TimeoutExpired:  # something outside its group holds the pipes
                self.kill_all()
                out, err = proc.communicate()
            raise HostCommandError(self, args, proc.returncode, out, err, timeout=timeout) from None
        if check and proc.returncode != 0:
            raise HostCommandError(self, args, proc.returncode, out, err)
        return subprocess.CompletedProcess(list(args), proc.returncode, out, err)

    def processes(self) -> list[int]:
        """The pids of the processes running on this host (its first process excepted)."""
        net = netns_inode(self.init_pid) if self.init_pid else None
        return [] if net is None else processes_in_netns([net], exclude=[self.init_pid])

    def kill_all(self) -> None:
        """SIGKILL every process on this host (its first process excepted): a host crash."""
        net = netns_inode(self.init_pid) if self.init_pid else None
        if net is not None:
            kill_netns([net], exclude=[self.init_pid])

    # ------------------------------------------------------------------- link
    def link_bytes(self) -> tuple[int, int]:
        """(received, sent) bytes of this host's ``eth0`` so far (the kernel's counters)."""
        if not self.init_pid:
            raise ClusterError(f"{self.hostname} is not running")
        with open(f"/proc/{self.init_pid}/net/dev") as f:
            for line in f:
                name, _, counters = line.partition(":")
                if name.strip() == self.ifname:
                    fields = counters.split()
                    return int(fields[0]), int(fields[8])
        raise ClusterError(f"{self.hostname}: no {self.ifname} in /proc/net/dev")

    def set_link(
        self,
        *,
        rate: Union[None, str, int, float, _Keep] = KEEP,
        delay: Union[None, float, _Keep] = KEEP,
        up: Union[bool, _Keep] = KEEP,
    ) -> None:
        """Shape this host's link: ``rate`` in bits per second (or ``"1gbit"``; None:
        unlimited), both directions; ``delay``: seconds added to every frame the host
        sends (needs a cluster with a delay line); ``up=False`` cuts the link at the
        switch (every frame to and from the host is lost and nobody is told, as when a
        cable is pulled), ``up=True`` mends it. Left out (:data:`KEEP`): unchanged."""
        if not isinstance(up, _Keep):
            state = "up" if up else "down"
            setup(["ip", "-n", self.cluster.switch_netns, "link", "set", self.switch_port, state])
        if not isinstance(delay, _Keep):
            seconds = float(delay or 0.0)
            if seconds < 0:
                raise ValueError(f"delay must not be negative, got {delay}")
            self.cluster._set_delay(self, seconds)
            self.delay = seconds
        if not isinstance(rate, _Keep):
            value = parse_rate(rate)
            tc_rate(self.netns, self.ifname, value)
            tc_rate(self.cluster.switch_netns, self.switch_port, value)
            self.rate = value

    # ------------------------------------------------------------------ life
    def _start(self, log: IO[bytes]) -> None:
        """Start the host's first process: new mount, UTS and IPC namespaces in the host's
        network namespace, a private /dev/shm, the cluster's /etc/hosts, the host name."""
        cluster = self.cluster
        script = (
            f"mount -t tmpfs -o size={cluster.shm_size},mode=1777 tdist-shm /dev/shm"
            f" && {{ [ ! -e /etc/hosts ] || mount --bind {shlex.quote(cluster.hosts_file)} /etc/hosts; }}"
            f" && hostname {self.hostname}"
            f" && exec {shlex.join(python_script('_hostinit.py'))}"
        )
        self._init = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.netns,
                "unshare",
                "--mount",
                "--uts",
                "--ipc",
                "--propagation",
                "slave",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )

    def _wait_ready(self, deadline: float) -> None:
        init = self._init
        assert init is not None and init.stdout is not None
        line = read_line(init.stdout, deadline)
        init.stdout.close()
        if line.strip() != b"ready":
            raise ClusterError(
                f"{self.hostname} did not come up (exit status {init.poll()}); see {self.cluster.workdir}/hosts.log"
            )

    def _stop(self) -> None:
        """Close the pipe to the host's first process: it kills everything on the host and exits."""
        init = self._init
        if init is None:
            return
        if init.stdin is not None:
            init.stdin.close()
        try:
            init.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            init.kill()
