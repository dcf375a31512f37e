"""``--core-overhead``: what the core, and the bridge to torch.distributed, add to one call.

At world size 1 (the tcp backend over a :class:`tdist.HashStore`, so nothing is sent),
time three loops on a one-element float32 tensor (4 B), alternating, ``repeats`` times
(medians of wall-clock time reported, and of the process's CPU time, which a loaded
machine inflates least):

* ``backend.run_blocking(call, None)`` with ``call = lambda b: b.all_reduce(t, SUM)``: the
  backend object called directly, the way the core runs a blocking call;
* ``tdist.all_reduce(t)``: the difference to the first is the core's own cost (argument
  checks, group lookup, Work hooks, wait);
* ``backend.all_reduce(t, SUM).wait()``: the backend's queued path, which returns a Work;
* ``torch.distributed.all_reduce(t)`` on the same group, which tdist made torch's default
  group (:mod:`tdist._torch`). torch's ProcessGroup API always expects a Work, so the
  bridge takes the queued path: the difference to it is what the bridge costs (torch's
  own Python wrapper, pybind's trampoline, the torch Work).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["core_overhead", "format_overhead"]


def _per_call(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(wall-clock, CPU) seconds per call. The process's CPU time is what a loaded machine
    inflates least: time spent waiting for a core is not counted."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def core_overhead(backend: str = "tcp", iters: int = 20000, repeats: int = 7) -> dict[str, Any]:
    import torch
    import torch.distributed as torch_dist

    import tdist
    from tdist._groups import resolve_group
    from tdist._reduce_op import ReduceOp, Reduction

    if tdist.is_initialized() or torch_dist.is_initialized():
        raise RuntimeError("--core-overhead needs a process without a default group")
    tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(1)
        pg = resolve_group(None)
        be = pg.backend_for("cpu", "all_reduce")  # type: ignore[union-attr]
        red = Reduction(ReduceOp.SUM)
        call = lambda b: b.all_reduce(t, red)  # noqa: E731
        loops = {
            "backend": lambda: be.run_blocking(call, None),
            "queued": lambda: be.all_reduce(t, red).wait(),
            "api": lambda: tdist.all_reduce(t),
            "torch": lambda: torch_dist.all_reduce(t),
        }
        samples: dict[str, list[float]] = {name: [] for name in loops}
        cpu_samples: dict[str, list[float]] = {name: [] for name in loops}
        for fn in loops.values():
            _per_call(fn, max(1, iters // 10))
        for _ in range(repeats):
            for name, fn in loops.items():
                wall, cpu = _per_call(fn, iters)
                samples[name].append(wall)
                cpu_samples[name].append(cpu)
        us = {name: statistics.median(values) * 1e6 for name, values in samples.items()}
        cpu_us = {name: statistics.median(values) * 1e6 for name, values in cpu_samples.items()}
        return {
            "backend": backend,
            "iters": iters,
            "repeats": repeats,
            "api_us": us["api"],
            "backend_us": us["backend"],
            "torch_us": us["torch"],
            "queued_us": us["queued"],
            "core_us": us["api"] - us["backend"],
            "bridge_us": us["torch"] - us["queued"],
            "core_cpu_us": cpu_us["api"] - cpu_us["backend"],
            "bridge_cpu_us": cpu_us["torch"] - cpu_us["queued"],
            **{f"{name}_cpu_us": value for name, value in cpu_us.items()},
            **{f"{name}_samples_us": [x * 1e6 for x in values] for name, values in samples.items()},
        }
    finally:
        tdist.destroy_process_group()


def format_overhead(r: dict[str, Any]) -> str:
    return (
        f"core overhead, all_reduce of 1 float32 at world size 1 ({r['backend']} backend, HashStore), "
        f"median of {r['repeats']} x {r['iters']} calls:\n"
        f"  backend.run_blocking(all_reduce(t, SUM)) {r['backend_us']:8.2f} us/call\n"
        f"  tdist.all_reduce(t)                      {r['api_us']:8.2f} us/call\n"
        f"  backend.all_reduce(t, SUM).wait()        {r['queued_us']:8.2f} us/call (the queued path)\n"
        f"  torch.distributed.all_reduce(t)          {r['torch_us']:8.2f} us/call (tdist's group, bridged)\n"
        f"  core's own cost (tdist - backend)        {r['core_us']:8.2f} us/call (target <= 2 us); "
        f"CPU time: {r['core_cpu_us']:.2f} us\n"
        f"  bridge's own cost (torch - queued)       {r['bridge_us']:8.2f} us/call (target <= 5 us); "
        f"CPU time: {r['bridge_cpu_us']:.2f} us"
    )
