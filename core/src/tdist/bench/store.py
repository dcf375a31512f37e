"""``--store``: tdist's TCPStore against torch's (libuv) TCPStore, side by side in one run.

Two measurements, each on both stores, with every client in a process of its own (as ranks are):

* ``multi_get`` of ``keys`` keys (one request) against ``keys`` single ``get``s, from one client;
* ``clients`` clients doing ``ops`` ``add``s each on one counter, all at once: the wall time from
  the start signal until the last client is done, and the server's throughput.

The two stores alternate round by round and medians are reported: on a shared machine the
load changes between rounds.

The server runs in this process (the master store); clients start, check in, wait for the
start signal, and report through the store itself.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List

__all__ = ["store_bench", "format_store_bench"]

KINDS = ("tdist", "torch")
_HOST = "127.0.0.1"


def _open(kind: str, port: int, master: bool) -> Any:
    if kind == "tdist":
        import tdist

        return tdist.TCPStore(_HOST, port, is_master=master, timeout=timedelta(seconds=120), wait_for_workers=False)
    import torch.distributed as torch_dist

    return torch_dist.TCPStore(_HOST, port, is_master=master, timeout=timedelta(seconds=120), wait_for_workers=False)


def _worker(kind: str, port: int, mode: str, index: int, count: int, repeats: int) -> None:
    """A client process: ``add`` (``count`` adds after the start signal) or ``multi_get``."""
    store = _open(kind, port, master=False)
    if mode == "add":
        store.add("ready", 1)
        store.wait(["go"])
        for _ in range(count):
            store.add("counter", 1)
        store.set(f"done/{index}", b"1")
        return
    keys = [f"key/{i}" for i in range(count)]
    store.multi_get(keys)  # warm up
    batched, single = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        store.multi_get(keys)
        batched.append(time.perf_counter() - start)
        start = time.perf_counter()
        for key in keys:
            store.get(key)
        single.append(time.perf_counter() - start)
    store.set("result", f"{statistics.median(batched)} {statistics.median(single)}".encode())


def _spawn(kind: str, port: int, mode: str, index: int, count: int, repeats: int) -> subprocess.Popen:
    code = f"from tdist.bench.store import _worker; _worker({kind!r}, {port}, {mode!r}, {index}, {count}, {repeats})"
    return subprocess.Popen([sys.executable, "-c", code])


def _join(procs: List[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"tdist.bench --store: a client process failed (exit {code})")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _multi_get(kind: str, keys: int, repeats: int) -> Dict[str, float]:
    master = _open(kind, 0, master=True)
    names = [f"key/{i}" for i in range(keys)]
    master.multi_set(names, [b"v" * 16] * keys)
    _join([_spawn(kind, master.port, "multi_get", 0, keys, repeats)], 300)
    batched, single = (float(x) for x in master.get("result").split())
    return {"multi_get_s": batched, "gets_s": single}


def _adds(kind: str, clients: int, ops: int) -> Dict[str, float]:
    master = _open(kind, 0, master=True)
    procs = [_spawn(kind, master.port, "add", i, ops, 0) for i in range(clients)]
    try:
        while int(master.add("ready", 0)) < clients:
            time.sleep(0.01)
            if any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError("tdist.bench --store: a client process failed to start")
        start = time.perf_counter()
        master.set("go", b"1")
        master.wait([f"done/{i}" for i in range(clients)], timedelta(seconds=600))
        wall = time.perf_counter() - start
    finally:
        _join(procs, 60)
    assert int(master.add("counter", 0)) == clients * ops
    return {"adds_wall_s": wall, "adds_per_s": clients * ops / wall}


def store_bench(clients: int = 16, ops: int = 1000, keys: int = 100, repeats: int = 5) -> Dict[str, Any]:
    """Both measurements on both stores, the stores alternating round by round (so that a change
    in the machine's load hits both alike); medians over ``repeats`` rounds, per store kind."""
    out: Dict[str, Any] = {"clients": clients, "ops": ops, "keys": keys, "repeats": repeats}
    rounds: Dict[str, List[Dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind in KINDS:
            rounds[kind].append({**_multi_get(kind, keys, 1), **_adds(kind, clients, ops)})
    for kind in KINDS:
        out[kind] = {name: statistics.median(r[name] for r in rounds[kind]) for name in rounds[kind][0]}
        out[kind]["rounds"] = rounds[kind]
    return out


def format_store_bench(r: Dict[str, Any]) -> str:
    t, o = r["tdist"], r["torch"]
    rows = [
        (f"multi_get of {r['keys']} keys (1 request)", t["multi_get_s"] * 1e6, o["multi_get_s"] * 1e6, "us"),
        (f"{r['keys']} x get", t["gets_s"] * 1e6, o["gets_s"] * 1e6, "us"),
        (f"{r['clients']} clients x {r['ops']} add (wall)", t["adds_wall_s"], o["adds_wall_s"], "s"),
    ]
    lines = [
        f"TCPStore: tdist against torch (libuv server), clients in separate processes, "
        f"median of {r['repeats']} alternating rounds:",
        f"  {'operation':40s} {'tdist':>12s} {'torch':>12s} {'tdist/torch':>12s}",
    ]
    for name, a, b, unit in rows:
        lines.append(f"  {name:40s} {a:10.3f} {unit:<1s} {b:10.3f} {unit:<1s} {a / b:11.2f}x")
    lines.append(
        f"  {'multi_get speed-up over single gets':40s} {t['gets_s'] / t['multi_get_s']:11.1f}x "
        f"{o['gets_s'] / o['multi_get_s']:11.1f}x"
    )
    lines.append(f"  {'add throughput (ops/s)':40s} {t['adds_per_s']:12.0f} {o['adds_per_s']:12.0f}")
    return "\n".join(lines)
