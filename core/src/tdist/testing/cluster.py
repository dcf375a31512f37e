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
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import IO, Any, Iterator, Optional, Sequence, Union

from ._hostinit import kill_netns, netns_inode, processes_in_netns

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

PREFIX = "tdc-"
IFNAME = "eth0"
NETNS_DIR = "/run/netns"
#: Seconds allowed for one setup command, or for the hosts to come up (the machine may be loaded).
SETUP_TIMEOUT = 60.0
_REQUIRED_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "sh")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_HERE = os.path.dirname(os.path.abspath(__file__))

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


class ClusterError(RuntimeError):
    """The cluster could not be set up, or a host operation failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot run a simulated cluster (not Linux, not root, tools or
    capabilities missing); the message says what is missing."""


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


# ------------------------------------------------------------------ this machine
def _start_time(pid: int) -> Optional[int]:
    """Start time of process ``pid`` (clock ticks since boot), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def _owner_tag() -> str:
    return f"{os.getpid()}-{_start_time(os.getpid())}"


def _owner_alive(name: str) -> bool:
    """Whether the process that made ``tdc-<pid>-<start>-...`` still runs."""
    match = re.match(re.escape(PREFIX) + r"(\d+)-(\d+)-", name)
    if match is None:
        return True  # not named by us: not ours to judge
    return _start_time(int(match.group(1))) == int(match.group(2))


def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return 0


_probed: dict[str, Optional[str]] = {}


def unavailable_reason() -> Optional[str]:
    """Why this machine cannot run a :class:`Cluster` (None: it can). Checks the
    platform, root, the tools (``ip``, ``tc``, ``nsenter``, ``unshare``, ``mount``),
    CAP_SYS_ADMIN and CAP_NET_ADMIN, then makes and removes the namespaces of one host
    (once per process)."""
    if "reason" in _probed:
        return _probed["reason"]
    reason: Optional[str] = None
    if not sys.platform.startswith("linux"):
        reason = f"needs Linux namespaces (this is {sys.platform})"
    elif os.geteuid() != 0:
        reason = "needs root (network, mount and UTS namespaces)"
    elif [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]:
        missing = [tool for tool in _REQUIRED_TOOLS if shutil.which(tool) is None]
        reason = f"needs {', '.join(missing)} on PATH (iproute2, util-linux)"
    elif not (_effective_caps() >> _CAP_SYS_ADMIN & 1 and _effective_caps() >> _CAP_NET_ADMIN & 1):
        reason = "needs CAP_SYS_ADMIN and CAP_NET_ADMIN (a privileged container, or the machine itself)"
    else:
        reason = _probe_namespaces()
    _probed["reason"] = reason
    return reason


def _probe_namespaces() -> Optional[str]:
    """Make what a host is made of (a network namespace; in it mount, UTS and IPC
    namespaces, a tmpfs, a host name) and remove it; what failed, or None."""
    probe = f"{PREFIX}{_owner_tag()}-probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=SETUP_TIMEOUT)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        host = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "unshare",
                "--mount",
                "--uts",
                "--ipc",
                "--propagation",
                "slave",
                "sh",
                "-c",
                "mount -t tmpfs -o size=1m tdist-probe /dev/shm && hostname tdist-probe",
            ],
            capture_output=True,
            text=True,
            timeout=SETUP_TIMEOUT,
        )
        if host.returncode != 0:
            return f"cannot make a host's mount, UTS and IPC namespaces: {host.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=SETUP_TIMEOUT)


def parse_rate(rate: Union[None, str, int, float]) -> Optional[float]:
    """A link rate in bits per second: a number, or ``tc`` syntax (``"1gbit"``,
    ``"100mbit"``, ``"500kbit"``; ``"125mbps"`` is bytes per second). None: unlimited."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        value = float(rate)
    else:
        match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+]+)?)\s*([kmgt]?)(bit|bps)?\s*", str(rate).lower())
        if match is None:
            raise ValueError(f"link rate {rate!r}: expected bits per second, e.g. 1e9, '1gbit' or '100mbit'")
        scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match.group(2)]
        value = float(match.group(1)) * scale * (8 if match.group(3) == "bps" else 1)
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {rate!r}")
    return value


def _setup(cmd: Sequence[str], stdin: Optional[str] = None) -> None:
    """Run one setup command; :class:`ClusterError` with its output if it fails."""
    done = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=SETUP_TIMEOUT)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise ClusterError(
            f"cluster setup: {shlex.join(cmd)} failed ({done.returncode}): {detail}"
            + (f"\ninput:\n{stdin}" if stdin else "")
        )


def _delete_netns(names: Sequence[str]) -> None:
    """Kill every process inside the named network namespaces, then remove them."""
    inodes = []
    for name in names:
        try:
            inodes.append(os.stat(os.path.join(NETNS_DIR, name)).st_ino)
        except OSError:
            pass
    kill_netns(inodes)
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=SETUP_TIMEOUT)


def reclaim_stale() -> list[str]:
    """Remove the namespaces and directories of clusters whose owner process is gone
    (killed before it could clean up), with every process still inside; return their
    names. Safe while other processes run clusters: only dead owners' are touched."""
    try:
        names = sorted(os.listdir(NETNS_DIR))
    except OSError:
        names = []
    stale = [n for n in names if n.startswith(PREFIX) and not _owner_alive(n)]
    if stale:
        _delete_netns(stale)
    tmp = tempfile.gettempdir()
    try:
        dirs = sorted(d for d in os.listdir(tmp) if d.startswith(PREFIX) and not _owner_alive(d))
    except OSError:
        dirs = []
    for d in dirs:
        shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)
    return stale + dirs


def _read_line(stream: IO[bytes], deadline: float) -> bytes:
    """One line from a pipe, or what came of it before ``deadline`` or end of file."""
    data = b""
    fd = stream.fileno()
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            break
        chunk = os.read(fd, 256)
        if not chunk:
            break
        data += chunk
    return data


def _python_script(name: str) -> list[str]:
    """The command that runs this package's stdlib-only script ``name`` (no tdist import)."""
    return [sys.executable, "-S", os.path.join(_HERE, name)]


def _tc_rate(netns: str, dev: str, rate: Optional[float]) -> None:
    """A ``tbf`` qdisc limiting ``dev`` to ``rate`` bits/s (None: remove the limit).
    Burst: 1 ms at that rate, at least 64 KiB (one segmentation-offload frame)."""
    if rate is None:
        subprocess.run(
            ["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=SETUP_TIMEOUT
        )
        return
    burst = max(int(rate / 8 / 1000), 64 << 10)
    _setup(
        [
            "tc",
            "-n",
            netns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            f"{int(rate)}bit",
            "burst",
            str(burst),
            "latency",
            "50ms",
        ]
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
        self, *, rate: Union[None, str, int, float, _Keep] = KEEP, delay: Union[None, float, _Keep] = KEEP
    ) -> None:
        """Shape this host's link: ``rate`` in bits per second (or ``"1gbit"``; None:
        unlimited), both directions; ``delay``: seconds added to every frame the host
        sends (needs a cluster with a delay line). Left out (:data:`KEEP`): unchanged."""
        if not isinstance(delay, _Keep):
            seconds = float(delay or 0.0)
            if seconds < 0:
                raise ValueError(f"delay must not be negative, got {delay}")
            self.cluster._set_delay(self, seconds)
            self.delay = seconds
        if not isinstance(rate, _Keep):
            value = parse_rate(rate)
            _tc_rate(self.netns, self.ifname, value)
            _tc_rate(self.cluster.switch_netns, self.switch_port, value)
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
            f" && exec {shlex.join(_python_script('_hostinit.py'))}"
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
        line = _read_line(init.stdout, deadline)
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
            init.wait()


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
        self.name = f"{PREFIX}{_owner_tag()}-{self.token}"
        self.switch_netns = f"{self.name}-sw"
        self.hosts = [Host(self, i) for i in range(hosts)]
        self.rate = parse_rate(rate)
        self.delay = float(delay)
        self.uses_delay_line = bool(delay_line) or delay > 0
        self.multicast = bool(multicast)
        self.shm_size = shm_size
        self.workdir = ""
        self._procs: list[HostProcess] = []
        self._delayline: Optional[subprocess.Popen] = None
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
            self._make_network()
            if self.rate is not None:
                for host in self.hosts:
                    host.set_link(rate=self.rate)
            if self.uses_delay_line:
                self._start_delay_line()
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

    def _make_network(self) -> None:
        for name in self.netns_names:
            _setup(["ip", "netns", "add", name])
        # Before the links exist, so that they inherit it: no duplicate address detection
        # (addresses usable at once); the switch itself takes no part in IPv6.
        for host in self.hosts:
            _setup(
                [
                    "ip",
                    "netns",
                    "exec",
                    host.netns,
                    "sh",
                    "-c",
                    "echo 0 > /proc/sys/net/ipv6/conf/all/accept_dad && "
                    "echo 0 > /proc/sys/net/ipv6/conf/default/accept_dad",
                ]
            )
        _setup(
            [
                "ip",
                "netns",
                "exec",
                self.switch_netns,
                "sh",
                "-c",
                "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
                "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
            ]
        )
        switch = (
            [] if self.uses_delay_line else ["link add br0 type bridge mcast_snooping 0 stp_state 0", "link set br0 up"]
        )
        for host in self.hosts:
            switch.append(
                f"link add {host.switch_port} type veth peer name {IFNAME} address {host.mac} netns {host.netns}"
            )
            if not self.uses_delay_line:
                switch.append(f"link set {host.switch_port} master br0")
                if not self.multicast:
                    switch.append(f"link set dev {host.switch_port} type bridge_slave mcast_flood off")
            switch.append(f"link set {host.switch_port} up")
        _setup(["ip", "-n", self.switch_netns, "-batch", "-"], "\n".join(switch) + "\n")
        for host in self.hosts:
            # Static neighbours: IPv6 unicast works even on a switch that drops multicast
            # (neighbour discovery is multicast).
            neighbours = [
                f"neigh replace {address} lladdr {other.mac} dev {IFNAME} nud permanent"
                for other in self.hosts
                if other is not host
                for address in (other.address, other.address6)
            ]
            _setup(
                ["ip", "-n", host.netns, "-batch", "-"],
                "\n".join(
                    [
                        "link set lo up",
                        f"addr add {host.address}/24 dev {IFNAME}",
                        f"addr add {host.address6}/64 dev {IFNAME} nodad",
                        f"link set {IFNAME} multicast on up",
                        f"route add 224.0.0.0/4 dev {IFNAME}",
                        *neighbours,
                    ]
                )
                + "\n",
            )

    def _start_delay_line(self) -> None:
        with open(os.path.join(self.workdir, "delayline.log"), "ab") as log:
            self._delayline = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.switch_netns,
                    *_python_script("_delayline.py"),
                    *[h.switch_port for h in self.hosts],
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self._delayline.stdout is not None
        ready = _read_line(self._delayline.stdout, time.monotonic() + SETUP_TIMEOUT)
        self._delayline.stdout.close()
        if ready.strip() != b"ready":
            raise ClusterError(f"the delay line did not start; see {self.workdir}/delayline.log")

    def set_multicast(self, enabled: bool) -> None:
        """Let the switch forward multicast (True, the default) or drop it (False)."""
        if self.uses_delay_line:
            self._delay_line_command(f"multicast {int(bool(enabled))}")
        else:
            flag = "on" if enabled else "off"
            _setup(
                ["ip", "-n", self.switch_netns, "-batch", "-"],
                "".join(f"link set dev {h.switch_port} type bridge_slave mcast_flood {flag}\n" for h in self.hosts),
            )
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
        if self._delayline is None or self._delayline.stdin is None or self._delayline.poll() is not None:
            raise ClusterError(f"the delay line of {self.name} is not running; see {self.workdir}/delayline.log")
        self._delayline.stdin.write(f"{line}\n".encode())
        self._delayline.stdin.flush()

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
            if self._delayline.stdin is not None:
                self._delayline.stdin.close()  # it exits at end of file
            try:
                self._delayline.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                self._delayline.kill()
                self._delayline.wait()
        for proc in self._procs:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        if self._started:
            _delete_netns(self.netns_names)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        _LIVE.discard(self)
