"""``--recovery --hosts H``: recovery from a host cut off the network, on simulated hosts.

The loop of :mod:`tdist.bench.recovery` (torch's DDP through the bridge, shrink on
failure) runs on a :class:`tdist.testing.Cluster` of ``H`` hosts x ``--ranks-per-host``
ranks, the job's store on host 0. At step ``KILL_STEP`` the last rank asks the bench to
cut its host's link (:meth:`Host.set_link` ``up=False``: frames in both directions are
lost and no connection is closed, as when a cable is pulled) and goes on into the
step's all-reduces. The other hosts' ranks find out only by the group's timeout
(``CUT_TIMEOUT_S``); they agree that the cut host's ranks failed (silent ranks on
another host, after ``TDIST_FAILURE_WINDOW``), shrink and train on. Measured from the
cut: the survivors' error (*detect*) and their first completed step (*first step*).
The cut host's ranks fail with an error (they can reach neither their peers nor the
store) and are ended with the cluster.

Needs root and network namespaces (:func:`tdist.testing.cluster.unavailable_reason`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from .recovery import CUT_ME, CUT_WINDOW_S, LOST_AT, read_row

__all__ = ["recovery_hosts_bench"]

_PORT = 29500  # every host has a network of its own: free on host 0


def recovery_hosts_bench(backends: list[str], hosts: int = 2, per_host: int = 2, timeout: float = 300.0) -> list[dict]:
    """One ``cut`` row per backend, each on a cluster of its own."""
    return [_run(backend, hosts, per_host, timeout) for backend in backends]


def _run(backend: str, hosts: int, per_host: int, timeout: float) -> dict:
    from ..testing.cluster import Cluster

    world = hosts * per_host
    deadline = time.monotonic() + timeout
    with Cluster(hosts) as cluster:
        tmp = tempfile.mkdtemp(prefix="tdist-bench-cut-", dir=cluster.workdir)  # seen by every host
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE"))}
        env.update(
            MASTER_ADDR=cluster[0].address,
            MASTER_PORT=str(_PORT),
            WORLD_SIZE=str(world),
            TDIST_FAILURE_WINDOW=str(CUT_WINDOW_S),
            PYTHONUNBUFFERED="1",
        )
        worker = [sys.executable, "-m", "tdist.bench.recovery", "--worker", tmp, "cut", backend]
        survivors = []
        for host in cluster:
            for local in range(per_host):
                proc = host.popen(worker, env=dict(env, RANK=str(host.index * per_host + local)))
                if host.index < hosts - 1:
                    survivors.append(proc)
        _await(os.path.join(tmp, CUT_ME), deadline, f"{backend}: the last rank never reached step of the cut")
        cluster[hosts - 1].set_link(up=False)
        with open(os.path.join(tmp, LOST_AT), "w") as f:
            f.write(repr(time.time()))
        for proc in survivors:
            code = proc.wait(max(0.1, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"tdist.bench --recovery --hosts: a survivor on {backend} exited with {code}")
        row = read_row(tmp, "cut", backend, world)
    row["hosts"] = hosts
    return row


def _await(path: str, deadline: float, what: str) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise RuntimeError(f"tdist.bench --recovery --hosts: {what}")
        time.sleep(0.005)
