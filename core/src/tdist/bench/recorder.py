"""``--recorder-overhead``: what tdist-debug's flight recorder adds to one call.

At world size 1 (the tcp backend over a :class:`tdist.HashStore`, nothing sent), time
``tdist.all_reduce`` of one float32 in three states, alternating, ``repeats`` times
(medians of wall-clock and of CPU time, which a loaded machine inflates least): no work
hook (the recorder off, as when tdist-debug is installed but not enabled), a work
observer whose hooks do nothing (the core's cost of describing and observing an op),
and the recorder on. recorder - off is what turning it on costs per op (target <= 2 us);
recorder - null is the recorder's own share.
"""

from __future__ import annotations

import shutil
import statistics
import types
from typing import Any

from .overhead import _per_call

__all__ = ["recorder_overhead", "format_recorder_overhead"]


def _null_observer() -> types.ModuleType:
    from tdist import hookimpl

    module = types.ModuleType("null_observer")
    module.TDIST_HOOKSPEC_VERSION = "1.1"  # type: ignore[attr-defined]
    module.tdist_work_issued = hookimpl(lambda info: None)  # type: ignore[attr-defined]
    module.tdist_work_completed = hookimpl(lambda info, duration: None)  # type: ignore[attr-defined]
    module.tdist_work_failed = hookimpl(lambda info, error, duration: None)  # type: ignore[attr-defined]
    return module


def recorder_overhead(iters: int = 20000, repeats: int = 7) -> dict[str, Any]:
    import tempfile

    import torch

    import tdist
    from tdist._plugins import plugins, reset_plugins

    try:
        import tdist_debug
    except ImportError:
        raise RuntimeError("--recorder-overhead needs tdist-debug: pip install tdist-debug") from None
    if tdist.is_initialized():
        raise RuntimeError("--recorder-overhead needs a process without a default group")
    tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, torch_bridge=False)
    t = torch.ones(1)
    dump_dir = tempfile.mkdtemp(prefix="tdist-recorder-bench-")

    def observed(state: str) -> None:
        reset_plugins()
        if state == "null":
            plugins().register(_null_observer(), "null_observer")
        elif state == "recorder":
            tdist_debug.enable(capacity=2000, dump_dir=dump_dir)

    states = ("off", "null", "recorder")
    wall: dict[str, list[float]] = {state: [] for state in states}
    cpu: dict[str, list[float]] = {state: [] for state in states}
    try:
        for state in states:
            observed(state)
            _per_call(lambda: tdist.all_reduce(t), max(1, iters // 10))
        for _ in range(repeats):
            for state in states:
                observed(state)
                seconds, cpu_seconds = _per_call(lambda: tdist.all_reduce(t), iters)
                wall[state].append(seconds)
                cpu[state].append(cpu_seconds)
    finally:
        reset_plugins()
        tdist.destroy_process_group()
        shutil.rmtree(dump_dir, ignore_errors=True)
    us = {state: statistics.median(values) * 1e6 for state, values in wall.items()}
    cpu_us = {state: statistics.median(values) * 1e6 for state, values in cpu.items()}
    return {
        "iters": iters,
        "repeats": repeats,
        **{f"{s}_us": v for s, v in us.items()},
        **{f"{s}_cpu_us": v for s, v in cpu_us.items()},
        "recorder_cost_us": us["recorder"] - us["off"],
        "recorder_own_us": us["recorder"] - us["null"],
        "recorder_cost_cpu_us": cpu_us["recorder"] - cpu_us["off"],
        "recorder_own_cpu_us": cpu_us["recorder"] - cpu_us["null"],
    }


def format_recorder_overhead(r: dict[str, Any]) -> str:
    return (
        f"flight recorder overhead, tdist.all_reduce of 1 float32 at world size 1 (tcp, HashStore), "
        f"median of {r['repeats']} x {r['iters']} calls:\n"
        f"  recorder off (no work hook)              {r['off_us']:8.2f} us/call\n"
        f"  a work observer doing nothing            {r['null_us']:8.2f} us/call\n"
        f"  recorder on (TDIST_DEBUG_RECORDER)       {r['recorder_us']:8.2f} us/call\n"
        f"  turning the recorder on (on - off)       {r['recorder_cost_us']:8.2f} us/op (target <= 2 us); "
        f"CPU time: {r['recorder_cost_cpu_us']:.2f} us\n"
        f"  the recorder's own share (on - null)     {r['recorder_own_us']:8.2f} us/op; "
        f"CPU time: {r['recorder_own_cpu_us']:.2f} us"
    )
