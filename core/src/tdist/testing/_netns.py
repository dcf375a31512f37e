"""The machine side of :mod:`tdist.testing.cluster`: what this machine must offer,
the namespaces and the switch of a cluster, link shaping, and removing what a killed
owner left behind. Every function here runs ``ip``, ``tc`` or a helper script and knows
nothing of hosts' processes (:mod:`tdist.testing._hosts`) or of a cluster's life
(:class:`tdist.testing.cluster.Cluster`).
"""

from __future__ import annotations

import os
import re
import secrets
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, TYPE_CHECKING, Optional, Sequence, Union

from ._hostinit import kill_netns

if TYPE_CHECKING:
    from ._hosts import Host

__all__ = [
    "PREFIX",
    "IFNAME",
    "NETNS_DIR",
    "SETUP_TIMEOUT",
    "ClusterError",
    "ClusterUnavailable",
    "owner_tag",
    "unavailable_reason",
    "parse_rate",
    "setup",
    "delete_netns",
    "reclaim_stale",
    "read_line",
    "python_script",
    "tc_rate",
    "make_network",
    "set_bridge_multicast",
    "DelayLine",
]

PREFIX = "tdc-"
IFNAME = "eth0"
NETNS_DIR = "/run/netns"
#: Seconds allowed for one setup command, or for the hosts to come up (the machine may be loaded).
SETUP_TIMEOUT = 60.0
_REQUIRED_TOOLS = ("ip", "tc", "nsenter", "unshare", "mount", "sh")
_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
_HERE = os.path.dirname(os.path.abspath(__file__))


class ClusterError(RuntimeError):
    """The cluster could not be set up, or a host operation failed."""


class ClusterUnavailable(ClusterError):
    """This machine cannot run a simulated cluster (not Linux, not root, tools or
    capabilities missing); the message says what is missing."""


# ------------------------------------------------------------------ this machine
def _start_time(pid: int) -> Optional[int]:
    """Start time of process ``pid`` (clock ticks since boot), None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rfind(b")") + 2 :].split()[19])


def owner_tag() -> str:
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
    probe = f"{PREFIX}{owner_tag()}-probe{secrets.token_hex(2)}"
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


def setup(cmd: Sequence[str], stdin: Optional[str] = None) -> None:
    """Run one setup command; :class:`ClusterError` with its output if it fails."""
    done = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=SETUP_TIMEOUT)
    if done.returncode != 0:
        detail = (done.stderr or done.stdout).strip()
        raise ClusterError(
            f"cluster setup: {shlex.join(cmd)} failed ({done.returncode}): {detail}"
            + (f"\ninput:\n{stdin}" if stdin else "")
        )


def delete_netns(names: Sequence[str]) -> None:
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
        delete_netns(stale)
    tmp = tempfile.gettempdir()
    try:
        dirs = sorted(d for d in os.listdir(tmp) if d.startswith(PREFIX) and not _owner_alive(d))
    except OSError:
        dirs = []
    for d in dirs:
        shutil.rmtree(os.path.join(tmp, d), ignore_errors=True)
    return stale + dirs


def read_line(stream: IO[bytes], deadline: float) -> bytes:
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


def python_script(name: str) -> list[str]:
    """The command that runs this package's stdlib-only script ``name`` (no tdist import)."""
    return [sys.executable, "-S", os.path.join(_HERE, name)]


def tc_rate(netns: str, dev: str, rate: Optional[float]) -> None:
    """A ``tbf`` qdisc limiting ``dev`` to ``rate`` bits/s (None: remove the limit).
    Burst: 1 ms at that rate, at least 64 KiB (one segmentation-offload frame)."""
    if rate is None:
        subprocess.run(
            ["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"], capture_output=True, timeout=SETUP_TIMEOUT
        )
        return
    burst = max(int(rate / 8 / 1000), 64 << 10)
    setup(
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


# ------------------------------------------------------------------ the network
def make_network(switch_netns: str, hosts: Sequence[Host], *, delay_line: bool, multicast: bool) -> None:
    """Make the switch's and the hosts' network namespaces and link every host to the
    switch: a kernel bridge (``delay_line`` False; ``multicast`` False makes it drop
    multicast) or bare ports for the delay line's user-space switch (:class:`DelayLine`)."""
    for name in [switch_netns] + [h.netns for h in hosts]:
        setup(["ip", "netns", "add", name])
    # Before the links exist, so that they inherit it: no duplicate address detection
    # (addresses usable at once); the switch itself takes no part in IPv6.
    for host in hosts:
        setup(
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
    setup(
        [
            "ip",
            "netns",
            "exec",
            switch_netns,
            "sh",
            "-c",
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6 && "
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6",
        ]
    )
    switch = [] if delay_line else ["link add br0 type bridge mcast_snooping 0 stp_state 0", "link set br0 up"]
    for host in hosts:
        switch.append(f"link add {host.switch_port} type veth peer name {IFNAME} address {host.mac} netns {host.netns}")
        if not delay_line:
            switch.append(f"link set {host.switch_port} master br0")
            if not multicast:
                switch.append(f"link set dev {host.switch_port} type bridge_slave mcast_flood off")
        switch.append(f"link set {host.switch_port} up")
    setup(["ip", "-n", switch_netns, "-batch", "-"], "\n".join(switch) + "\n")
    for host in hosts:
        # Static neighbours: IPv6 unicast works even on a switch that drops multicast
        # (neighbour discovery is multicast).
        neighbours = [
            f"neigh replace {address} lladdr {other.mac} dev {IFNAME} nud permanent"
            for other in hosts
            if other is not host
            for address in (other.address, other.address6)
        ]
        setup(
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


def set_bridge_multicast(switch_netns: str, ports: Sequence[str], enabled: bool) -> None:
    """Let the kernel bridge flood multicast to ``ports`` (True) or not (False)."""
    flag = "on" if enabled else "off"
    setup(
        ["ip", "-n", switch_netns, "-batch", "-"],
        "".join(f"link set dev {port} type bridge_slave mcast_flood {flag}\n" for port in ports),
    )


class DelayLine:
    """The user-space switch of a cluster whose links have a delay
    (:mod:`tdist.testing._delayline`), running in ``switch_netns`` on ``ports``; commands
    go to it line by line on its standard input, and it exits at end of file. ``name``
    (the cluster's) and ``workdir`` (where ``delayline.log`` goes) are for its messages."""

    def __init__(self, name: str, switch_netns: str, ports: Sequence[str], workdir: str) -> None:
        self.name, self.workdir = name, workdir
        with open(os.path.join(workdir, "delayline.log"), "ab") as log:
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", switch_netns, *python_script("_delayline.py"), *ports],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self.process.stdout is not None
        ready = read_line(self.process.stdout, time.monotonic() + SETUP_TIMEOUT)
        self.process.stdout.close()
        if ready.strip() != b"ready":
            raise ClusterError(f"the delay line did not start; see {workdir}/delayline.log")

    def command(self, line: str) -> None:
        """Send the switch one command (``delay <port index> <seconds>``, ``multicast 0|1``)."""
        if self.process.stdin is None or self.process.poll() is not None:
            raise ClusterError(f"the delay line of {self.name} is not running; see {self.workdir}/delayline.log")
        self.process.stdin.write(f"{line}\n".encode())
        self.process.stdin.flush()

    def close(self) -> None:
        """Stop the switch (end of file on its input; killed if it does not exit in 5 s)."""
        if self.process.stdin is not None:
            self.process.stdin.close()  # it exits at end of file
        try:
            self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
