"""Bus bandwidth (nccl-tests' formulas), the terminal table, CSV and JSON."""

from __future__ import annotations

import csv
import json
from typing import Iterable, Optional, Sequence

__all__ = ["bus_factor", "annotate", "format_size", "table", "write_csv", "write_json"]


def bus_factor(op: str, world: int) -> float:
    """busbw / algbw for ``op`` on ``world`` ranks (nccl-tests' PERFORMANCE.md)."""
    n = world
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce


def annotate(results: Iterable[dict]) -> list[dict]:
    """Add ``algbw_GBps`` (size / time) and ``busbw_GBps`` to every result."""
    out = []
    for r in results:
        r = dict(r)
        t = r["time_s"]
        alg = r["bytes"] / t / 1e9 if t > 0 else 0.0
        r["algbw_GBps"] = alg
        r["busbw_GBps"] = alg * bus_factor(r["op"], r["world"])
        out.append(r)
    return out


def format_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _fmt_time(t: float) -> str:
    us = t * 1e6
    if us < 1000:
        return f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1000:.2f} ms"
    return f"{us / 1e6:.2f} s"


def table(results: Sequence[dict], backends: Sequence[str], reference: Optional[str] = "gloo") -> str:
    """One block per (world size, operation): time and bus bandwidth per backend per
    size, and each backend's time as a multiple of ``reference``'s (below 1: faster)."""
    lines: list[str] = []
    keys = sorted({(r["world"], r["op"]) for r in results}, key=lambda k: (k[0], _op_order(k[1])))
    present = [b for b in backends if any(r["backend"] == b for r in results)]
    ref = reference if reference in present else None
    for world, op in keys:
        rows = [r for r in results if r["world"] == world and r["op"] == op]
        by = {(r["backend"], r["bytes"]): r for r in rows}
        sizes = sorted({r["bytes"] for r in rows})
        head = f"{'size':>9}"
        for b in present:
            head += f" | {b + ' time':>12} {'busbw':>9}"
        others = [b for b in present if b != ref] if ref else []
        for b in others:
            head += f" | {f'{b}/{ref}':>10}"
        lines.append(f"{op}, {world} ranks (float32; time per call, bus bandwidth in GB/s)")
        lines.append(head)
        lines.append("-" * len(head))
        for n in sizes:
            line = f"{format_size(n):>9}"
            for b in present:
                r = by.get((b, n))
                line += f" | {_fmt_time(r['time_s']):>12} {r['busbw_GBps']:>9.3f}" if r else f" | {'-':>12} {'':>9}"
            for b in others:
                r, g = by.get((b, n)), by.get((ref, n))
                line += f" | {r['time_s'] / g['time_s']:>9.2f}x" if r and g else f" | {'-':>10}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


_ORDER = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier")


def _op_order(op: str) -> int:
    return _ORDER.index(op) if op in _ORDER else len(_ORDER)


_FIELDS = ("world", "op", "bytes", "backend", "time_s", "algbw_GBps", "busbw_GBps", "iters")


def write_csv(path: str, results: Sequence[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(_FIELDS) + ["samples_s"], extrasaction="ignore")
        w.writeheader()
        for r in results:
            row = dict(r)
            row["samples_s"] = " ".join(f"{s:.9g}" for s in r.get("samples_s", ()))
            w.writerow(row)


def write_json(path: str, results: Sequence[dict], meta: Optional[dict] = None) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta or {}, "results": list(results)}, f, indent=1)
