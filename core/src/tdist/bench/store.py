"""``--store``: tdist's TCPStore against torch's (libuv) TCPStore, side by side in one run.

Three measurements, each on both stores:

* ``multi_get`` of ``keys`` keys (one request) against ``keys`` single ``get``s, from one client;
* ``clients`` clients doing ``ops`` ``add``s each on one counter, all at once (every client in a
  process of its own, as ranks are): the wall time from the start signal until the last client
  is done, and the server's throughput;
* a load test: ``load_clients`` light clients (default 4096) connected at once, spread over
  ``load_procs`` processes that each open many connections (4096 processes are too many for a
  small machine); the time to connect them all (and each client's connect, p50/p99), then every
  client doing ``set`` and ``get`` of its own key, ``load_rounds`` times, all processes at once:
  p50/p99 latency of each under that load. torch's ``set`` returns once sent (its protocol
  has no reply to SET); tdist's waits for the reply, so a torch ``get`` also waits for its
  ``set`` to be served. Each process (and the server's) raises its open-file limit to the hard limit first;
  when that still cannot hold the clients, the run uses as many as fit and says so.

The two stores alternate round by round and medians are reported: on a shared machine the
load changes between rounds.

The server runs in this process (the master store); clients start, check in, wait for the
start signal, and report through the store itself.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any, Dict, List, Tuple

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


_DESCRIPTOR_MARGIN = 256  # descriptors a process needs besides its connections (libraries, pipes)
_LOAD_TIMEOUT = 1200.0
#: torch's TCPStore resolves addresses back to names on every connection (PTR queries through
#: getnameinfo, in the client and in the server's loop); where the resolver drops some queries
#: each drop stalls the server for the resolver's timeout (5 s by default). The load test caps
#: that at 1 s (glibc's RES_OPTIONS, for this process and the load processes; tdist makes no
#: query), unless RES_OPTIONS is set already.
_RES_OPTIONS = "timeout:1 attempts:1"


def _fit_clients(clients: int, procs: int) -> Tuple[int, str]:
    """The load clients this machine's open-file limit allows (after raising it to the hard
    limit here; the server's process needs one per client), and a note when that is fewer."""
    from tdist._store.fd_limits import raise_descriptor_limit

    soft, hard = raise_descriptor_limit()
    room = max(0, int(soft) - _DESCRIPTOR_MARGIN)
    if clients <= room:
        return clients, ""
    return room, (
        f"the open-file limit (soft {soft}, hard {hard}) holds {room} of the {clients} clients asked for: "
        "raise the hard limit (ulimit -Hn) to measure all of them"
    )


def _load_worker(kind: str, port: int, index: int, count: int, rounds: int) -> None:
    """A load process: on "go" open ``count`` clients (and report the time), on "run" have each
    ``set`` and ``get`` its own key ``rounds`` times (report every latency), on "close" end."""
    from tdist._store.fd_limits import raise_descriptor_limit

    raise_descriptor_limit()
    out = sys.stdout

    def say(obj: Any) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    say("ready")
    if sys.stdin.readline().strip() != "go":
        return
    stores, connects = [], []
    for _ in range(count):
        start = time.perf_counter()
        stores.append(_open(kind, port, master=False))
        connects.append(round(time.perf_counter() - start, 7))
    say({"connect": connects})
    if sys.stdin.readline().strip() != "run":
        return
    value = b"v" * 32
    keys = [f"load/{index}/{i}" for i in range(count)]
    sets: List[float] = []
    gets: List[float] = []
    clock = time.perf_counter
    for _ in range(rounds):
        for key, store in zip(keys, stores):
            t0 = clock()
            store.set(key, value)
            t1 = clock()
            store.get(key)
            t2 = clock()
            sets.append(t1 - t0)
            gets.append(t2 - t1)
    say({"set": [round(x, 7) for x in sets], "get": [round(x, 7) for x in gets]})
    sys.stdin.readline()
    for store in stores:
        if hasattr(store, "close"):
            store.close()


class _Proc:
    """A load process and the lines it wrote (read without blocking past a deadline)."""

    def __init__(self, kind: str, port: int, index: int, count: int, rounds: int) -> None:
        code = f"from tdist.bench.store import _load_worker; _load_worker({kind!r}, {port}, {index}, {count}, {rounds})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.buf = b""

    def tell(self, word: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(word.encode() + b"\n")
        self.proc.stdin.flush()

    def line(self, deadline: float) -> Any:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("tdist.bench --store: a load process did not answer in time")
            poller = select.poll()  # not select(): the server's connections push descriptors past 1024
            poller.register(fd, select.POLLIN)
            if poller.poll(left * 1000):
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"tdist.bench --store: a load process ended (exit {self.proc.wait()})")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def end(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell("close")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _percentile(sorted_values: List[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _load(kind: str, clients: int, procs: int, rounds: int) -> Dict[str, float]:
    """The load test on one store: connect ``clients`` clients from ``procs`` processes, then set/get."""
    master = _open(kind, 0, master=True)
    procs = max(1, min(procs, clients))
    shares = [clients // procs + (1 if i < clients % procs else 0) for i in range(procs)]
    workers: List[_Proc] = []
    deadline = time.monotonic() + _LOAD_TIMEOUT
    try:
        workers = [_Proc(kind, master.port, i, n, rounds) for i, n in enumerate(shares)]
        for w in workers:
            assert w.line(deadline) == "ready"
        start = time.perf_counter()
        for w in workers:
            w.tell("go")
        connects: List[float] = []
        for w in workers:
            connects += w.line(deadline)["connect"]
        connect = time.perf_counter() - start
        server = getattr(master, "server", None)
        if server is not None:  # tdist: every client is connected at once (and the master)
            assert server.connections >= clients, (server.connections, clients)
        start = time.perf_counter()
        for w in workers:
            w.tell("run")
        sets: List[float] = []
        gets: List[float] = []
        for w in workers:
            got = w.line(deadline)
            sets += got["set"]
            gets += got["get"]
        wall = time.perf_counter() - start
    finally:
        for w in workers:
            w.end()
        if hasattr(master, "close"):
            master.close()
        del master
    sets.sort()
    gets.sort()
    connects.sort()
    return {
        "load_connect_s": connect,
        "load_connect_p50_s": _percentile(connects, 0.5),
        "load_connect_p99_s": _percentile(connects, 0.99),
        "load_set_p50_s": _percentile(sets, 0.5),
        "load_set_p99_s": _percentile(sets, 0.99),
        "load_get_p50_s": _percentile(gets, 0.5),
        "load_get_p99_s": _percentile(gets, 0.99),
        "load_ops_per_s": (len(sets) + len(gets)) / wall,
    }


def store_bench(
    clients: int = 16,
    ops: int = 1000,
    keys: int = 100,
    repeats: int = 5,
    load_clients: int = 4096,
    load_procs: int = 4,
    load_rounds: int = 5,
) -> Dict[str, Any]:
    """The measurements on both stores, the stores alternating round by round (so that a change
    in the machine's load hits both alike); medians over ``repeats`` rounds, per store kind.
    ``load_clients=0`` skips the load test."""
    load_clients, note = _fit_clients(load_clients, load_procs) if load_clients > 0 else (0, "")
    if load_clients:
        os.environ.setdefault("RES_OPTIONS", _RES_OPTIONS)  # before torch's server first resolves
    out: Dict[str, Any] = {"clients": clients, "ops": ops, "keys": keys, "repeats": repeats}
    out.update(load_clients=load_clients, load_procs=min(load_procs, max(load_clients, 1)), load_rounds=load_rounds)
    if note:
        out["note"] = note
    if load_clients:
        out["res_options"] = os.environ["RES_OPTIONS"]
    rounds: Dict[str, List[Dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind in KINDS:
            row = {**_multi_get(kind, keys, 1), **_adds(kind, clients, ops)}
            if load_clients:
                row.update(_load(kind, load_clients, load_procs, load_rounds))
            rounds[kind].append(row)
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
    if r.get("load_clients"):
        n, procs = r["load_clients"], r["load_procs"]
        lines.append(
            f"  load: {n} clients connected at once from {procs} processes, each doing set + get of its own key "
            f"{r['load_rounds']} times:"
        )
        load_rows = [
            (f"connect all {n} clients (wall)", t["load_connect_s"], o["load_connect_s"], "s", 1.0),
            ("one client's connect p50", t["load_connect_p50_s"], o["load_connect_p50_s"], "us", 1e6),
            ("one client's connect p99", t["load_connect_p99_s"], o["load_connect_p99_s"], "us", 1e6),
            ("set p50", t["load_set_p50_s"], o["load_set_p50_s"], "us", 1e6),
            ("set p99", t["load_set_p99_s"], o["load_set_p99_s"], "us", 1e6),
            ("get p50", t["load_get_p50_s"], o["load_get_p50_s"], "us", 1e6),
            ("get p99", t["load_get_p99_s"], o["load_get_p99_s"], "us", 1e6),
        ]
        for name, a, b, unit, scale in load_rows:
            lines.append(f"  {name:40s} {a * scale:10.1f} {unit:<2s} {b * scale:10.1f} {unit:<2s} {a / b:9.2f}x")
        lines.append(f"  {'set+get throughput (ops/s)':40s} {t['load_ops_per_s']:12.0f} {o['load_ops_per_s']:12.0f}")
    if r.get("load_clients"):
        lines.append(
            f"  (RES_OPTIONS={r.get('res_options', '')!r}: torch's store resolves every connection's address "
            "back to a name; a dropped query stalls its server for the resolver's timeout)"
        )
    if r.get("note"):
        lines.append(f"  note: {r['note']}")
    return "\n".join(lines)
