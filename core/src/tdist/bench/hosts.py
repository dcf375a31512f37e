"""``python -m tdist.bench --hosts H``: collectives across simulated hosts.

The workers of :mod:`tdist.bench.workers` run on a :class:`tdist.testing.Cluster` of ``H``
hosts (network namespaces on one switch, each with its own address and ``/dev/shm``,
so the tcp backend uses shared memory within a host and sockets between hosts, as on a
real cluster), ``--ranks-per-host`` each, host ``h`` holding ranks ``h*R .. h*R+R-1``.
``--link-rate`` limits every host's link (``tbf``, both directions) and ``--link-delay``
delays every frame a host sends (the cluster's user-space delay line). With a rate, the
table is followed by each size's *link bound*: the time an all_reduce needs at least,
``2 (H-1)/H x size / rate``, what every host must send and receive through its one link,
and each backend's time as a multiple of it.

Needs root and network namespaces (:func:`tdist.testing.cluster.unavailable_reason`).
All hosts share this machine's CPUs: with 2 of them, ranks of different hosts compete
for the same cores, which a real cluster would not.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Optional, Sequence

from .report import format_size
from .runner import wait_workers

__all__ = ["run_hosts", "link_bound", "format_bounds", "DEFAULT_SIZES", "FLAT_BACKEND"]

#: Sizes measured by ``--hosts`` unless ``--sizes`` says otherwise.
DEFAULT_SIZES = (4, 256 << 10, 16 << 20, 64 << 20)
#: The tcp backend with ``hierarchy=off`` (its flat socket algorithms), a column of ``--hosts``.
FLAT_BACKEND = "tcp+flat"
_PORTS = {"gloo": 29500, "tdist": 29501}  # every host has a network of its own: these are free on rank 0's


def run_hosts(
    hosts: int,
    per_host: int,
    cfg: dict[str, Any],
    timeout: float,
    rate: Optional[str] = None,
    delay: float = 0.0,
    verbose: Any = False,
) -> list[dict]:
    """Run one bench world of ``hosts`` x ``per_host`` ranks on a simulated cluster; the
    results (rank 0's), each row also naming ``hosts``, ``link_rate_bps`` and ``link_delay_s``."""
    from ..testing.cluster import Cluster

    world = hosts * per_host
    with Cluster(hosts, rate=rate, delay=delay) as cluster:
        tmp = tempfile.mkdtemp(prefix="tdist-bench-hosts-", dir=cluster.workdir)  # seen by every host
        cfg = dict(cfg, result=os.path.join(tmp, "result.json"), ports=_PORTS, master=cluster[0].address)
        cfg["progress"] = verbose
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TDIST_BENCH_", "MASTER_", "RANK"))}
        env.setdefault("PYTHONUNBUFFERED", "1")
        procs = []
        for host in cluster:
            for local in range(per_host):
                rank = host.index * per_host + local
                penv = dict(env, TDIST_BENCH_RANK=str(rank), TDIST_BENCH_WORLD=str(world))
                procs.append(host.popen([sys.executable, "-m", "tdist.bench.workers", path], env=penv))
        failed = wait_workers(procs, timeout, f"the world of {hosts} hosts x {per_host} ranks")
        if failed is not None:
            raise RuntimeError(f"tdist.bench --hosts: {failed}")
        with open(cfg["result"]) as f:
            results = json.load(f)
        link = cluster.rate
    for r in results:
        r.update(hosts=hosts, link_rate_bps=link, link_delay_s=delay)
    return results


def link_bound(op: str, nbytes: int, hosts: int, rate_bps: float) -> Optional[float]:
    """The least time ``op`` of ``nbytes`` per rank can take when each of ``hosts`` hosts
    has one link of ``rate_bps`` (all_reduce: every host sends, and receives,
    ``2 (H-1)/H x size``); None for the operations this does not model."""
    if op != "all_reduce" or hosts < 2 or not rate_bps:
        return None
    return 2.0 * (hosts - 1) / hosts * nbytes * 8.0 / rate_bps


def format_bounds(results: Sequence[dict], backends: Sequence[str]) -> str:
    """Per size: the link bound, and each backend's time as a multiple of it."""
    rows = [r for r in results if r.get("link_rate_bps")]
    if not rows:
        return ""
    hosts, rate = rows[0]["hosts"], rows[0]["link_rate_bps"]
    by = {(r["backend"], r["op"], r["bytes"]): r["time_s"] for r in rows}
    lines = [f"link bound: 2 (H-1)/H x size / rate, {hosts} hosts at {rate / 1e9:g} Gbit/s each"]
    for op, nbytes in sorted({(r["op"], r["bytes"]) for r in rows}, key=lambda k: (k[0], k[1])):
        bound = link_bound(op, nbytes, hosts, rate)
        if bound is None or nbytes < 1 << 20:  # below a MiB the link's latency, not its rate, decides
            continue
        ratios = "  ".join(f"{b} {by[(b, op, nbytes)] / bound:.2f}x" for b in backends if (b, op, nbytes) in by)
        lines.append(f"  {op} {format_size(nbytes):>9}: bound {bound * 1e3:.1f} ms; {ratios}")
    return "\n".join(lines) + "\n"
