"""tdist across hosts, on a simulated cluster (tdist.testing.cluster): each host a network
namespace with its own address, host name and /dev/shm, on one switch.

The harness itself first (the hosts are separate machines as far as a program can tell,
links shaped as asked, nothing left behind), then jobs started as users start them:
``tdistrun --nnodes 2 --node_rank N`` on each host (tcp, gloo), ``mpirun`` across the
hosts (mpi), plain processes with env://, tcp:// and file:// rendezvous, and a host's
launcher killed mid-job. The jobs (tests/multihost_job.py) check an all_reduce and an
all_gather, that the bytes went over each host's eth0, and that the tcp backend used
shared memory within a host (its hierarchical collectives) and never between hosts. Needs root and namespaces; skipped, saying why, otherwise.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Sequence

import pytest

from repo_paths import ROOT, TESTS
from tdist.testing.processes import base_env
from tdist._local import find_mpirun, mpirun_env
from tdist.testing.cluster import Cluster, HostCommandError, reclaim_stale, unavailable_reason

_REASON = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(_REASON is not None, reason=f"simulated cluster unavailable: {_REASON}"),
    pytest.mark.slow,
    pytest.mark.timeout(180),
]

JOB = os.path.join(TESTS, "multihost_job.py")
NET = os.path.join(TESTS, "multihost_net.py")
PORT = 29500  # every cluster has its own network: no other test can hold it
JOB_TIMEOUT = 90.0
SIZE = 4 << 20  # bytes all_reduced by the jobs


def tdistrun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "tdistrun")
    return here if os.access(here, os.X_OK) else "tdistrun"


def start(cluster: Cluster, commands: Sequence[Sequence[str]], envs: Sequence[dict] = (), timeout: float = JOB_TIMEOUT):
    """Start ``commands[i]`` on host i, output captured; killed after ``timeout``."""
    envs = list(envs) or [base_env()] * len(commands)
    return [
        host.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=timeout)
        for host, cmd, env in zip(cluster, commands, envs)
    ]


def finish(procs) -> list[tuple[int, str, str]]:
    """Wait for every process (each has its hard timeout); fail, with every output, if one
    timed out or failed."""
    results = [(p, *p.communicate()) for p in procs]
    if any(p.timed_out or p.returncode != 0 for p, _, _ in results):
        details = "\n".join(
            f"--- {p.host.hostname}: exit {p.returncode}{' (timed out)' * p.timed_out}\n{out}\n{err[-3000:]}"
            for p, out, err in results
        )
        pytest.fail(f"a job failed\n{details}", pytrace=False)
    return [(p.returncode, out, err) for p, out, err in results]


def job_results(outputs: Sequence[str]) -> list[dict]:
    """The RESULT lines of multihost_job.py, by rank."""
    found = [json.loads(m) for out in outputs for m in re.findall(r"RESULT (\{.*\})", out)]
    return sorted(found, key=lambda r: (str(r["init_method"]), r["rank"]))


def check_job(cluster: Cluster, results: list[dict], world_size: int, backend: str) -> None:
    """Every rank reduced right, the ranks span the hosts in order, and each host's eth0
    carried at least half the tensor each way (no rank could have skipped the network)."""
    assert [r["rank"] for r in results] == list(range(world_size)), results
    per_host = world_size // len(cluster)
    expected_hosts = [h.hostname for h in cluster for _ in range(per_host)]
    for r in results:
        assert r["reduced_ok"] and r["others_ok"] == [], r
        assert r["hosts"] == expected_hosts, r
        assert r["host"] == expected_hosts[r["rank"]], r
        assert r["rx"] >= SIZE // 2 and r["tx"] >= SIZE // 2, f"rank {r['rank']}: too little went over eth0: {r}"
        if backend == "tcp":  # shared memory within a host (hierarchical collectives), never across
            layout = [list(range(h * per_host, (h + 1) * per_host)) for h in range(len(cluster))]
            hierarchical = per_host > 1
            assert r["uses_shm"] is hierarchical, f"rank {r['rank']}: shared memory across hosts, or none within: {r}"
            assert r["tcp_hosts"] == (layout if hierarchical else None), r


def multicast_received(sender, receiver, group: str, wait: float) -> str:
    """What ``receiver`` got of the datagrams ``sender`` sent to ``group`` ("nothing" if none in ``wait`` s)."""
    proc = receiver.popen(
        [sys.executable, NET, "mcast-recv", group, str(PORT), str(wait)], stdout=subprocess.PIPE, text=True, timeout=60
    )
    assert proc.stdout.readline().strip() == "ready"
    sender.run([sys.executable, NET, "mcast-send", group, str(PORT), sender.hostname], check=True, timeout=30)
    return proc.communicate(timeout=60)[0].strip()


# ------------------------------------------------------------------ the harness
@pytest.mark.parametrize("switch", ["bridge", "delay_line"])
def test_hosts_are_separate_machines(switch):
    with Cluster(2, delay_line=switch == "delay_line") as cluster:
        h0, h1 = cluster
        # host name, its address, a private /dev/shm
        h0.run(["sh", "-c", "echo x > /dev/shm/tdist-multihost-probe"], check=True)
        seen = [json.loads(h.run([sys.executable, NET, "whoami"], check=True, timeout=30).stdout) for h in cluster]
        assert [s["hostname"] for s in seen] == [h0.hostname, h1.hostname]
        assert [s["address"] for s in seen] == [h0.address, h1.address]
        assert "tdist-multihost-probe" in seen[0]["shm"] and "tdist-multihost-probe" not in seen[1]["shm"]
        assert not os.path.exists("/dev/shm/tdist-multihost-probe")
        # IPv4 and IPv6 multicast from host 0 reach host 1 (for the multicast rendezvous);
        # a switch set to drop multicast drops it
        for multicast in (True, False):
            cluster.set_multicast(multicast)
            for group in ("239.255.77.1", "ff15:1e18:5d4c:4cf0:d02d:b659:53ba:b0a7"):
                expected = h0.hostname if multicast else "nothing"
                assert multicast_received(h0, h1, group, wait=30 if multicast else 1) == expected
        # TCP over IPv4 and IPv6 (even without multicast: IPv6 neighbours are static): the
        # bytes arrive, and over eth0
        for address in (h0.address, h0.address6):
            rx0 = h0.link_bytes()[0]
            server = h0.popen(
                [sys.executable, NET, "serve", address, str(PORT)], stdout=subprocess.PIPE, text=True, timeout=60
            )
            assert server.stdout.readline().strip() == "ready"
            h1.run([sys.executable, NET, "client", address, str(PORT), str(1 << 20)], check=True, timeout=60)
            assert int(server.communicate(timeout=60)[0]) == 1 << 20
            assert h0.link_bytes()[0] - rx0 >= 1 << 20


@pytest.mark.tdist_cluster(2, rate="40mbit", delay=0.01)
def test_link_rate_and_delay(tdist_cluster):
    """Lower bounds only (a loaded machine is slower, never faster): a round trip takes
    at least twice the one-way delay, and 1 MiB at least 8 Mbit / 40 Mbit/s."""
    h0, h1 = tdist_cluster
    assert (h0.rate, h0.delay) == (40e6, 0.01)
    server = h0.popen(
        [sys.executable, NET, "serve", h0.address, str(PORT)], stdout=subprocess.PIPE, text=True, timeout=60
    )
    assert server.stdout.readline().strip() == "ready"
    measured = json.loads(
        h1.run([sys.executable, NET, "client", h0.address, str(PORT), str(1 << 20)], check=True, timeout=60).stdout
    )
    assert int(server.communicate(timeout=60)[0]) == 1 << 20
    assert measured["rtt"] >= 0.02, measured
    bound = ((1 << 20) - (64 << 10)) * 8 / 40e6  # less tbf's burst
    assert measured["send_seconds"] >= bound, (measured, bound)
    h1.set_link(rate=None, delay=0.0)
    assert (h1.rate, h1.delay, h0.rate) == (None, 0.0, 40e6)


def test_timeouts_and_cleanup(tmp_path):
    """A command past its timeout is killed with everything it started; closing a cluster
    leaves no process, namespace or file; a cluster whose owner was SIGKILLed loses its
    processes at once and its namespaces to the next reclaim."""
    with Cluster(1) as cluster:
        host = cluster[0]
        with pytest.raises(HostCommandError, match="timed out after 0.5 s"):
            host.run(["sh", "-c", "sleep 60 & sleep 60"], timeout=0.5)
        assert host.processes() == []
        busy = host.popen(["sleep", "60"])
        names, workdir = cluster.netns_names, cluster.workdir
    assert busy.returncode is not None
    assert not set(names) & set(os.listdir("/run/netns")) and not os.path.exists(workdir)

    owner = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import sys, time
        from tdist.testing.cluster import Cluster
        cluster = Cluster(2).start()
        pids = [h.popen(["sleep", "60"]).pid for h in cluster]
        print(" ".join(cluster.netns_names), cluster.workdir, *pids, flush=True)
        time.sleep(60)
    """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        words = owner.stdout.readline().split()
    finally:
        owner.kill()
        owner.wait()
    names, workdir, pids = words[:3], words[3], [int(p) for p in words[4:]]
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if os.path.exists(f"/proc/{pid}")], "a host process outlived its cluster's owner"
    reclaim_stale()  # (or another cluster's start, in a concurrent test run, did it first)
    assert not set(names) & set(os.listdir("/run/netns")) and not os.path.exists(workdir)


# ------------------------------------------------------------------ jobs across hosts
@pytest.mark.parametrize("backend,nproc,streams", [("tcp", 2, 1), ("tcp", 2, 3), ("gloo", 1, 1)])
def test_tdistrun_on_two_hosts(tdist_cluster, backend, nproc, streams):
    """``tdistrun --nnodes 2`` on each host; with ``streams`` (tcp), every pair of ranks on
    different hosts uses that many TCP connections, a pair on one host one Unix-domain socket."""
    commands = [
        [
            tdistrun(),
            "--nnodes",
            "2",
            "--node_rank",
            str(host.index),
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            tdist_cluster[0].address,
            "--master_port",
            str(PORT),
            JOB,
            "--backend",
            backend,
            "--size",
            str(SIZE),
        ]
        for host in tdist_cluster
    ]
    env = dict(base_env(), TDIST_TCP_STREAMS=str(streams))
    outputs = [out for _, out, _ in finish(start(tdist_cluster, commands, [env] * len(commands)))]
    results = job_results(outputs)
    check_job(tdist_cluster, results, 2 * nproc, backend)
    if backend == "tcp":
        for r in results:
            host = r["rank"] // nproc
            expected = {str(q): 1 if q // nproc == host else streams for q in range(2 * nproc) if q != r["rank"]}
            assert r["links"] == expected, r


def test_mpirun_across_hosts(tdist_cluster, tmp_path):
    """mpirun on host 0 starts a rank on each host through the cluster's ssh agent."""
    pytest.importorskip("tdist_mpi")
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found")
    env = mpirun_env(base_env(), tempfile.mkdtemp(dir=tmp_path))
    command = [
        mpirun,
        "-n",
        "2",
        *tdist_cluster.mpirun_args(slots=1),
        sys.executable,
        JOB,
        "--backend",
        "mpi",
        "--size",
        str(SIZE),
    ]
    proc = tdist_cluster[0].popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=JOB_TIMEOUT
    )
    outputs = [out for _, out, _ in finish([proc])]
    check_job(tdist_cluster, job_results(outputs), 2, "mpi")


def test_rendezvous_across_hosts(tdist_cluster, tmp_path):
    """One process per host, no launcher, six rendezvous in turn (one group after the
    other, in the same processes): env://; tcp:// with fixed ranks, and with ranks
    assigned in arrival order; file:// in a directory every host sees; tcp:// and file://
    with a group_name (the job's own store on a free port of its first process's host)."""
    master = tdist_cluster[0].address
    methods = [
        "env://",
        f"tcp://{master}:{PORT + 1}?world_size=2&rank={{rank}}",
        f"tcp://{master}:{PORT + 2}?world_size=2",
        f"file://{tmp_path}/rendezvous?world_size=2",
        f"tcp://{master}:{PORT + 3}?world_size=2#jobs",
        f"file://{tmp_path}/shared?world_size=2#jobs",
    ]
    commands, envs = [], []
    for host in tdist_cluster:
        commands.append(
            [sys.executable, JOB, "--backend", "tcp", "--size", str(SIZE)]
            + [arg for m in methods for arg in ("--init-method", m.format(rank=host.index))]
        )
        envs.append(base_env(MASTER_ADDR=master, MASTER_PORT=str(PORT), RANK=str(host.index), WORLD_SIZE="2"))
    results = job_results([out for _, out, _ in finish(start(tdist_cluster, commands, envs))])
    for method in methods:
        done = [r for r in results if r["init_method"].split("?")[0] == method.split("?")[0]]
        if "rank=" in method or method == "env://":
            check_job(tdist_cluster, done, 2, "tcp")
        else:  # ranks in arrival order: check them against the hosts they ran on
            assert sorted(r["rank"] for r in done) == [0, 1], done
            assert sorted(r["host"] for r in done) == [h.hostname for h in tdist_cluster], done
            for r in done:
                assert r["hosts"][r["rank"]] == r["host"] and r["reduced_ok"] and r["uses_shm"] is False, r
                assert r["rx"] >= SIZE // 2 and r["tx"] >= SIZE // 2, r


def test_launcher_killed_on_one_host(tdist_cluster):
    """SIGKILL to host 1's tdistrun mid-job (its worker dies with it): host 0's job stops
    with an error naming rank 1, long before the 30 s process-group timeout."""
    commands = [
        [
            tdistrun(),
            "--nnodes",
            "2",
            "--node_rank",
            str(host.index),
            "--master_addr",
            tdist_cluster[0].address,
            "--master_port",
            str(PORT),
            JOB,
            "--backend",
            "tcp",
            "--size",
            "4096",
            "--steps",
            "100000",
            "--timeout",
            "30",
        ]
        for host in tdist_cluster
    ]
    procs = start(tdist_cluster, commands, timeout=JOB_TIMEOUT)
    for proc in procs:
        for line in proc.stdout:
            if "step 3" in line:
                break
        else:
            pytest.fail(f"{proc.host.hostname}'s job ended early: exit {proc.wait()}\n{proc.stderr.read()[-3000:]}")
    killed = time.monotonic()
    os.kill(procs[1].pid, signal.SIGKILL)  # the launcher alone: its pid is the command's
    out, err = procs[0].communicate()
    took = time.monotonic() - killed
    assert not procs[0].timed_out, err[-3000:]
    assert procs[0].returncode not in (0, None), err[-3000:]
    assert re.search(r"rank 0 lost its connection to rank 1\b", err), err[-3000:]
    assert took < 30, f"host 0's job took {took:.1f} s to stop"
    assert procs[1].wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while tdist_cluster[1].processes() and time.monotonic() < deadline:  # the worker dies with its launcher
        time.sleep(0.05)
    assert tdist_cluster[1].processes() == []
