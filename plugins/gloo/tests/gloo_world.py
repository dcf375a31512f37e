"""A minimal multi-process runner for tdist-gloo's own tests.

``run_world(body, world_size, timeout=..., **kwargs)`` starts ``world_size``
processes (spawn), each running ``body(rank, world_size, **kwargs)`` with
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE set for ``env://``; returns the
per-rank results in rank order. A body that raises fails the call with every
failing rank's traceback; a world that runs past ``timeout`` is killed
(SIGKILL, every process) and the call fails naming the ranks that never answered.
Ranks in ``may_exit`` may end their process without a result (None).
Processes are always killed and reaped before ``run_world`` returns.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any, Callable, Optional

from tdist.testing import free_port

__all__ = ["run_world", "free_port", "WorldFailed"]


class WorldFailed(AssertionError):
    """Some rank raised, died or did not finish in time."""


def _child(body: Callable[..., Any], rank: int, world_size: int, env: dict, kwargs: dict, results: Any) -> None:
    os.environ.update(env)
    try:
        value = body(rank, world_size, **kwargs)
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, False, traceback.format_exc()))
    else:
        results.put((rank, True, value))


def run_world(
    body: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 60.0,
    env: Optional[dict] = None,
    may_exit: tuple = (),
    **kwargs: Any,
) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        **(env or {}),
    }
    procs = [
        ctx.Process(
            target=_child,
            args=(body, rank, world_size, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, kwargs, results),
            name=f"gloo-test-rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    outcome: dict = {}
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a dying rank's report arrive first
                    while True:
                        try:
                            rank, ok, value = results.get_nowait()
                        except queue.Empty:
                            break
                        outcome[rank] = (ok, value)
                    for r in dead:
                        if r in may_exit:
                            outcome.setdefault(r, (True, None))
                        else:
                            message = f"rank {r} exited (code {procs[r].exitcode}) without a result"
                            outcome.setdefault(r, (False, message))
                continue
            outcome[rank] = (ok, value)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(10)
        results.close()
    missing = [r for r in range(world_size) if r not in outcome]
    failures = {r: v for r, (ok, v) in outcome.items() if not ok}
    if missing or failures:
        parts = [f"rank {r}:\n{v}" for r, v in sorted(failures.items())]
        if missing:
            parts.append(f"rank(s) {missing} did not finish within {timeout:g} s (killed)")
        raise WorldFailed(f"{getattr(body, '__name__', body)} failed:\n" + "\n".join(parts))
    return [outcome[r][1] for r in range(world_size)]
