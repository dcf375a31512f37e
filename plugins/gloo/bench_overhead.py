"""Overhead of tdist's gloo backend against torch.distributed's own gloo, side by side.

Starts ``--world-size`` processes (default 2) on this machine. Each joins two
groups: ``tdist.init_process_group("gloo")`` and, on another port,
``torch.distributed.init_process_group("gloo")``; a raw ``ProcessGroupGloo``
call (the floor both sit on) is timed too. Then the same processes time
all_reduce (SUM, float32, synchronous) through each API, interleaving the APIs
call by call so that drift and noise hit all alike, and rank 0 prints the
median time per call, the ratio tdist/torch and the difference.

    python plugins/gloo/bench_overhead.py                 # 4 B and 16 MiB
    python plugins/gloo/bench_overhead.py --sizes 4 1048576 --scale 0.5

Targets: ratio <= 1.05 at 16 MiB, difference <= +20 us at 4 B.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta

from tdist.testing import free_port


def _calls(nbytes: int, scale: float) -> int:
    """Timed calls per API for one size (about 1-3 s of work each)."""
    if nbytes <= 4096:
        n = 5000
    elif nbytes <= 1 << 20:
        n = 1000
    else:
        n = 100
    return max(5, int(n * scale))


def _worker(rank: int, world_size: int, tdist_port: int, torch_port: int, sizes: list, scale: float, out: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as td

    import tdist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    tdist.init_process_group(  # torch_bridge=False: torch's own gloo group is measured next to it
        "gloo",
        init_method=f"tcp://127.0.0.1:{tdist_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        torch_bridge=False,
    )
    td.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank, world_size=world_size, timeout=timeout
    )
    raw = tdist.group.WORLD.backends["cpu"].process_group  # the ProcessGroupGloo under tdist's group
    raw_opts = torch._C._distributed_c10d.AllreduceOptions()

    def call_tdist(t: "torch.Tensor") -> None:
        tdist.all_reduce(t)

    def call_torch(t: "torch.Tensor") -> None:
        td.all_reduce(t)

    def call_raw(t: "torch.Tensor") -> None:
        raw.allreduce([t], raw_opts).wait()

    apis = [("tdist-gloo", call_tdist), ("torch.distributed", call_torch), ("raw ProcessGroupGloo", call_raw)]
    clock = time.perf_counter
    results: dict = {}
    for nbytes in sizes:
        tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        calls = _calls(nbytes, scale)
        times: dict = {name: [] for name, _ in apis}
        for _name, fn in apis:  # warm up every path
            for _ in range(max(2, calls // 20)):
                fn(tensor)
        td.barrier()
        # Call by call, rotating which API goes first: all three see the same machine state,
        # and the medians ignore the scheduler's outliers.
        for i in range(calls):
            shift = i % len(apis)
            for name, fn in apis[shift:] + apis[:shift]:
                start = clock()
                fn(tensor)
                times[name].append(clock() - start)
        results[nbytes] = {name: statistics.median(samples) for name, samples in times.items()}
    td.barrier()
    td.destroy_process_group()
    tdist.destroy_process_group()
    if rank == 0:
        out.update(results)


def _fmt_size(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):g} MiB"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):g} KiB"
    return f"{nbytes} B"


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 16 << 20], help="bytes per all_reduce")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the number of timed calls")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is killed")
    args = parser.parse_args(argv)

    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    out = manager.dict()
    ports = (free_port(), free_port())
    procs = [
        ctx.Process(target=_worker, args=(rank, args.world_size, ports[0], ports[1], args.sizes, args.scale, out))
        for rank in range(args.world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + args.timeout
    failed = False
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive() or proc.exitcode != 0:
            failed = True
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    if failed:
        print("benchmark failed (a rank died or timed out)", file=sys.stderr)
        return 1
    results = dict(out)
    manager.shutdown()
    print(
        f"all_reduce SUM float32, {args.world_size} ranks on 127.0.0.1; "
        "median time per call, APIs interleaved call by call"
    )
    print(f"{'size':>10} {'tdist-gloo':>12} {'torch.dist':>12} {'raw PG':>12} {'ratio':>7} {'diff':>10}")
    for nbytes in args.sizes:
        r = results[nbytes]
        ours, theirs, raw = r["tdist-gloo"], r["torch.distributed"], r["raw ProcessGroupGloo"]
        print(
            f"{_fmt_size(nbytes):>10} {ours * 1e6:10.1f}us {theirs * 1e6:10.1f}us {raw * 1e6:10.1f}us "
            f"{ours / theirs:7.3f} {(ours - theirs) * 1e6:+8.1f}us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
