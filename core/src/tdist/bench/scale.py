"""``--scale``: what a rank costs as the world grows, tdist-tcp against torch's gloo, and a
simulated large world on this one machine.

- **Real worlds** (``--world-sizes``, default 4,8,16,32): one process per rank; each
  times ``init_process_group`` plus one all_reduce of one float and then reports its
  threads (``/proc/self/task``), open descriptors (``/proc/self/fd``) and RSS, before
  and after. tdist-tcp (``tdist.init_process_group("tcp")``) and torch's own gloo
  (``torch.distributed.init_process_group("gloo")``), in that order, in one run.
  **init** is the time from the moment the *last* rank entered ``init_process_group``
  to the moment the last rank finished the all_reduce (wall clock of the one host):
  what the ranks take together once all are there, not the wait for the slowest
  process to start (importing torch takes 1-2 s of CPU each, and with more ranks than
  cores the last one starts seconds after the first). **own** is the older measure,
  the slowest rank's own time from entering ``init_process_group``, which includes that
  wait. Descriptors are reported for the rank that hosts the store (rank 0: one
  server connection per rank) and, apart, the largest among the others. Each worker
  collects garbage once before it enters ``init_process_group``, on both backends:
  importing torch leaves a full collection owed (about 0.1 s of CPU over torch's 170,000
  objects), which the next few thousand allocations of any Python code trigger -- inside
  tdist's init (Python), after torch's (C++), in the program's own code; either way the
  program pays it once, whatever its backend.
- **Simulated worlds** (``--sim-worlds``, default 16,64,256): ``--sim-procs`` processes
  (default 8) each host ``world / procs`` ranks as threads; every rank builds its tdist-tcp
  group through the backend's factory (shared memory off: the socket transport, the part
  whose cost could grow with the world) and runs one all_reduce. Reported: the time until
  every rank is done, and threads, descriptors and RSS per process and per rank. torch is
  imported once per process (not per rank), so RSS per rank is the transport's, not torch's.

    python -m tdist.bench --scale
    python -m tdist.bench --scale --world-sizes 4,8 --sim-worlds 16,64
    python -m tdist.bench --scale --scale-repeats 3     # each world 3 times, the median run

``python -m tdist.bench`` byte-compiles tdist's packages first (:mod:`tdist.bench.precompile`): a
``pip install`` precompiles them; an editable install with ``PYTHONDONTWRITEBYTECODE``
set would make every worker compile them at import.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

__all__ = ["scale_bench", "format_scale", "process_usage"]


def process_usage() -> dict[str, int]:
    """This process's threads, open descriptors and resident memory (KiB), from /proc."""
    rss = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"threads": len(os.listdir("/proc/self/task")), "fds": len(os.listdir("/proc/self/fd")), "rss_kib": rss}


def scale_bench(
    world_sizes: list[int], sim_worlds: list[int], sim_procs: int = 8, timeout: float = 600.0, repeats: int = 1
) -> list[dict]:
    """One row per (kind, backend, world size): with ``repeats`` runs of each (tcp and gloo
    alternating, so that both meet the same load), the run of median init time, with every
    run's init time in ``init_samples``."""
    runs: dict[tuple[str, str, int], list[dict]] = {}
    for world in world_sizes:
        for _ in range(max(1, repeats)):
            for backend in ("tcp", "gloo"):
                runs.setdefault(("real", backend, world), []).append(_launch(["real", backend], world, world, timeout))
    for world in sim_worlds:
        procs = min(sim_procs, world)
        for _ in range(max(1, repeats)):
            runs.setdefault(("sim", "tcp", world), []).append(_launch(["sim", "tcp"], world, procs, timeout))
    rows = []
    for samples in runs.values():
        ordered = sorted(samples, key=lambda r: r["init_s"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["init_samples"] = [r["init_s"] for r in samples]
        rows.append(row)
    return rows


def _launch(args: list[str], world: int, procs: int, timeout: float) -> dict:
    """Run ``procs`` worker processes for a world of ``world`` ranks; rank 0's report."""
    from tdist.testing import free_port

    from .runner import wait_workers

    tmp = tempfile.mkdtemp(prefix="tdist-bench-scale-")
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "tdist.bench.scale", "--worker", tmp, *args, str(world), str(procs)]
    workers = [
        subprocess.Popen([*cmd, str(p)], env={**env, "RANK": str(p), "WORLD_SIZE": str(world)}, start_new_session=True)
        for p in range(procs)
    ]
    try:
        failed = wait_workers(workers, timeout, f"the world of {world} ({' '.join(args)})")
        if failed is not None:
            raise RuntimeError(f"tdist.bench --scale: {failed}")
        with open(os.path.join(tmp, "result.json")) as f:
            return dict(json.load(f))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def format_scale(rows: list[dict]) -> str:
    runs = max((len(r.get("init_samples", [])) for r in rows), default=1)
    lines = [
        "what a rank costs, after init_process_group + one all_reduce (max over processes"
        + (f"; the run of median init of {runs}" if runs > 1 else "")
        + "):",
        f"  {'kind':<5} {'backend':<7} {'world':>5}  {'init':>7}  {'own':>7}  {'threads':>7}  {'+threads':>8}  "
        f"{'fds':>5}  {'+fds':>5}  {'fds@0':>5}  {'RSS MiB':>7}  {'ranks/proc':>10}",
    ]
    for r in rows:
        lines.append(
            f"  {r['kind']:<5} {r['backend']:<7} {r['world']:>5}  {r['init_s']:6.2f}s  {r['own_s']:6.2f}s  "
            f"{r['threads']:>7}  {r['threads_added']:>8}  {r['fds']:>5}  {r['fds_added']:>5}  {r['fds_store']:>5}  "
            f"{r['rss_kib'] / 1024:7.0f}  {r['ranks_per_proc']:>10}"
            + (f"  init {min(r['init_samples']):.2f}-{max(r['init_samples']):.2f}s" if runs > 1 else "")
        )
    lines.append(
        "  (init: from the last rank entering init_process_group to the last rank done with the first all_reduce;\n"
        "   own: the slowest rank's own time from entering init_process_group (includes waiting for the last\n"
        "   process to start); fds, +fds: the processes that do not host the store (the largest), fds@0: the one\n"
        "   that does (one server connection per client); +threads, +fds: what init and the all_reduce added;\n"
        "   sim: ranks as threads of --sim-procs processes, tcp over sockets only, one tdist-tcp group per rank)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- worker side
def _real(tmp: str, backend: str, world: int) -> None:
    import torch

    rank = int(os.environ["RANK"])
    if backend == "gloo":
        import torch.distributed as dist
    else:
        import tdist as dist  # type: ignore[no-redef]
    gc.collect()  # the full collection importing torch leaves owed: not init's (see the module's docstring)
    before = process_usage()
    entered, started = time.time(), time.monotonic()
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    dist.all_reduce(torch.ones(1))
    elapsed, done = time.monotonic() - started, time.time()
    after = process_usage()
    mine = {"own_s": elapsed, "entered": entered, "done": done, **after}
    mine["threads_added"] = after["threads"] - before["threads"]
    mine["fds_added"] = after["fds"] - before["fds"]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        _write(tmp, "real", backend, world, 1, everyone)
    dist.barrier()
    dist.destroy_process_group()


def _sim(tmp: str, world: int, procs: int, index: int) -> None:
    """Ranks ``index::procs`` of the world as threads of this process."""
    import torch

    import tdist
    from tdist.plugin import PrefixStore, Reduction, ReduceOp

    gc.collect()  # as in _real
    before = process_usage()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = tdist.TCPStore(host, port, is_master=index == 0, timeout=timedelta(seconds=300), wait_for_workers=False)
    factory = tdist.get_backend_spec("tcp").factory
    ranks = list(range(index, world, procs))
    backends: dict[int, Any] = {}
    errors: list[BaseException] = []
    done = threading.Barrier(len(ranks) + 1)

    def run(rank: int) -> None:
        try:  # a store client per rank, as each rank of a real world has (a blocking wait holds its client)
            client = tdist.TCPStore(host, port, timeout=timedelta(seconds=300))
            backend = factory(
                store=PrefixStore("sim", client),
                rank=rank,
                world_size=world,
                timeout=timedelta(seconds=300),
                options={"shm": False},
                global_ranks=list(range(world)),
            )
            backends[rank] = backend
            backend.all_reduce(torch.ones(1), Reduction(ReduceOp.SUM)).wait()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        done.wait()

    entered, started = time.time(), time.monotonic()
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in ranks]
    for t in threads:
        t.start()
    done.wait()
    elapsed, finished = time.monotonic() - started, time.time()
    if errors:
        raise errors[0]
    after = process_usage()
    report = {"own_s": elapsed, "entered": entered, "done": finished, **after, "before": before}
    store.set(f"report/{index}", json.dumps(report))
    store.wait([f"report/{p}" for p in range(procs)])
    if index == 0:
        reports = [json.loads(store.get(f"report/{p}")) for p in range(procs)]
        for r in reports:
            r["threads_added"] = r["threads"] - r["before"]["threads"] - len(ranks)  # not the bench's own threads
            r["fds_added"] = r["fds"] - r["before"]["fds"] - 1 - len(ranks)  # nor its store connections
        _write(tmp, "sim", "tcp", world, len(ranks), reports)
    store.add("finished", 1)
    while int(store.add("finished", 0)) < procs:  # the store's host goes last
        time.sleep(0.05)
    for backend in backends.values():
        backend.shutdown()


def _write(tmp: str, kind: str, backend: str, world: int, per_proc: int, reports: list[dict]) -> None:
    """Rank 0's result file: the world's row (``reports`` by rank, or by process for ``sim``;
    the first one hosts the store)."""
    row: dict[str, Any] = {"kind": kind, "backend": backend, "world": world, "ranks_per_proc": per_proc}
    row["init_s"] = max(r["done"] for r in reports) - max(r["entered"] for r in reports)
    for key in ("own_s", "threads", "threads_added", "rss_kib"):
        row[key] = max(r[key] for r in reports)
    others = reports[1:] or reports
    for key in ("fds", "fds_added"):
        row[key] = max(r[key] for r in others)
    row["fds_store"] = reports[0]["fds"]
    with open(os.path.join(tmp, "result.json"), "w") as f:
        json.dump(row, f)


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--worker":
        tmp, kind, backend, world, procs, index = sys.argv[2:]
        if kind == "real":
            _real(tmp, backend, int(world))
        else:
            _sim(tmp, int(world), int(procs), int(index))
    else:
        sys.exit("usage: python -m tdist.bench --scale (this module is its worker)")
