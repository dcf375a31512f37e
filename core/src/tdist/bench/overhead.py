"""``--core-overhead``: what the core adds to one call.

At world size 1 (the tcp backend over a :class:`tdist.HashStore`, so nothing is sent),
time ``tdist.all_reduce`` on a one-element tensor against calling the backend object
directly (``backend.all_reduce(t, Reduction(SUM)).wait()``); the difference is the
core's own cost per call (argument checks, group lookup, Work hooks, wait).
The two loops alternate, ``repeats`` times; medians are reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["core_overhead"]


def core_overhead(backend: str = "tcp", iters: int = 20000, repeats: int = 7) -> dict[str, Any]:
    import torch

    import tdist
    from tdist._groups import resolve_group
    from tdist._reduce_op import ReduceOp, Reduction

    if tdist.is_initialized():
        raise RuntimeError("--core-overhead needs a process without a default group")
    tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(1)
        pg = resolve_group(None)
        be = pg.backend_for("cpu", "all_reduce")  # type: ignore[union-attr]
        red = Reduction(ReduceOp.SUM)
        api = tdist.all_reduce

        def via_api(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                api(t)
            return (time.perf_counter() - start) / n

        def direct(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                be.all_reduce(t, red).wait()
            return (time.perf_counter() - start) / n

        via_api(max(1, iters // 10))
        direct(max(1, iters // 10))
        a, d = [], []
        for _ in range(repeats):
            a.append(via_api(iters))
            d.append(direct(iters))
        api_s, direct_s = statistics.median(a), statistics.median(d)
        return {
            "backend": backend, "iters": iters, "repeats": repeats,
            "api_us": api_s * 1e6, "backend_us": direct_s * 1e6, "core_us": (api_s - direct_s) * 1e6,
            "api_samples_us": [x * 1e6 for x in a], "backend_samples_us": [x * 1e6 for x in d],
        }
    finally:
        tdist.destroy_process_group()


def format_overhead(r: dict[str, Any]) -> str:
    return (
        f"core overhead, all_reduce of 1 float32 at world size 1 ({r['backend']} backend, HashStore), "
        f"median of {r['repeats']} x {r['iters']} calls:\n"
        f"  tdist.all_reduce(t)                      {r['api_us']:8.2f} us/call\n"
        f"  backend.all_reduce(t, SUM).wait()        {r['backend_us']:8.2f} us/call\n"
        f"  core's own cost (difference)             {r['core_us']:8.2f} us/call (target < 10 us)"
    )
