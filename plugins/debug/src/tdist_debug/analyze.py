"""The analyser: reads every rank's dump and explains, in plain words, which operation
each rank is in, which ranks never entered the collective the others wait in, and
where ranks diverged (a different op, size, dtype, reduction or root at one sequence
number of a group)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Optional

from .recorder import DUMP_FORMAT

__all__ = ["load_dumps", "analyze", "POINT_TO_POINT"]

POINT_TO_POINT = ("send", "recv")
#: What must be equal on every rank for one collective (sizes are compared except where
#: ranks may legitimately pass different sizes).
_SIGNATURE = ("op", "dtype", "nbytes", "reduce_op", "root")
_FREE_SIZES = ("all_to_all", "all_to_all_single")


def load_dumps(directory: str) -> dict[int, dict[str, Any]]:
    """{rank: dump} for every ``rank<R>.json`` in ``directory``; ValueError if there is none."""
    dumps: dict[int, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank*.json"))):
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != DUMP_FORMAT:
            continue
        dumps[int(data["rank"])] = data
    if not dumps:
        raise ValueError(f"{directory}: no tdist-debug dump (rank<R>.json) found")
    return dumps


def _describe(entry: dict[str, Any]) -> str:
    parts = [entry["dtype"].replace("torch.", "") or "no tensor", f"{entry['nbytes']} B"]
    if entry.get("reduce_op"):
        parts.append(entry["reduce_op"])
    if entry.get("root") is not None:
        parts.append(f"root {entry['root']}")
    return f"{entry['op']} #{entry['seq']} of group {entry['group']} ({', '.join(parts)})"


def _doing(entry: dict[str, Any]) -> str:
    if entry["op"] in POINT_TO_POINT:
        other = "any rank" if entry.get("peer") is None else f"rank {entry['peer']}"
        where = f"{entry['op']} {'to' if entry['op'] == 'send' else 'from'} {other} (tag {entry.get('tag')})"
    else:
        where = _describe(entry)
    if entry["state"] == "failed":
        return f"in {where}, which failed after {entry['duration'] or 0:.1f} s: {entry['error']}"
    return f"in {where}, waiting for {entry['duration'] or 0:.1f} s"


def _world(dumps: dict[int, dict[str, Any]]) -> list[int]:
    for dump in dumps.values():
        world = dump.get("groups", {}).get("pg0")
        if world:
            return list(world["ranks"])
    seen = {r for d in dumps.values() for e in d["entries"] for r in e.get("group_ranks", [])}
    return sorted(seen | set(dumps))


def _collectives(dumps: dict[int, dict[str, Any]]) -> dict[str, dict[int, dict[int, dict[str, Any]]]]:
    """{group: {rank: {seq: entry}}} of the collectives in the dumps."""
    found: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    for rank, dump in dumps.items():
        for entry in dump["entries"]:
            if entry["op"] not in POINT_TO_POINT and entry["seq"] > 0:
                found.setdefault(entry["group"], {}).setdefault(rank, {})[entry["seq"]] = entry
    return found


def _members(group: str, by_rank: dict[int, dict[int, dict[str, Any]]], dumps: dict[int, dict[str, Any]]) -> list[int]:
    for entries in by_rank.values():
        for entry in entries.values():
            if entry.get("group_ranks"):
                return list(entry["group_ranks"])
    for dump in dumps.values():
        if group in dump.get("groups", {}):
            return list(dump["groups"][group]["ranks"])
    return sorted(by_rank)


def _divergence(group: str, by_rank: dict[int, dict[int, dict[str, Any]]]) -> Optional[str]:
    """The first sequence number at which the ranks' collectives differ, in words."""
    for seq in sorted({s for entries in by_rank.values() for s in entries}):
        present = {rank: entries[seq] for rank, entries in by_rank.items() if seq in entries}
        if len(present) < 2:
            continue
        fields = [f for f in _SIGNATURE if len({json.dumps(e.get(f)) for e in present.values()}) > 1]
        if fields == ["nbytes"] and all(e["op"] in _FREE_SIZES for e in present.values()):
            continue
        if not fields:
            continue
        field = fields[0]
        by_value: dict[str, list[int]] = {}
        for rank, entry in sorted(present.items()):
            value = entry.get(field)
            label = {
                "op": f"called {value}",
                "nbytes": f"passed {value} B",
                "dtype": f"passed {value}",
                "reduce_op": f"reduced with {value}",
                "root": f"used root {value}",
            }[field]
            by_value.setdefault(label, []).append(rank)
        listing = "; ".join(f"rank(s) {ranks} {label}" for label, ranks in by_value.items())
        what = {"op": "operation", "nbytes": "size", "dtype": "dtype", "reduce_op": "reduction", "root": "root"}
        return f"DIVERGED at collective #{seq} of group {group}: the ranks disagree on the {what[field]}: {listing}"
    return None


def _stuck(
    group: str, members: list[int], by_rank: dict[int, dict[int, dict[str, Any]]], dumps: dict[int, dict[str, Any]]
) -> Optional[str]:
    """Which ranks are in the group's latest unfinished collective and which never entered it."""
    top = max((s for entries in by_rank.values() for s in entries), default=0)
    inside = sorted(r for r, entries in by_rank.items() if top in entries and entries[top]["state"] != "completed")
    if not top or not inside:
        return None
    entry = by_rank[inside[0]][top]
    absent = [r for r in members if r not in inside and not (r in by_rank and top in by_rank[r])]
    lines = [f"rank(s) {inside} are in {_describe(entry)}, which did not complete"]
    for rank in absent:
        if rank not in dumps:
            lines.append(
                f"rank {rank} NEVER ENTERED collective #{top} of group {group}: it left no dump "
                "(stopped, killed or stuck where it could not write one)"
            )
            continue
        last = max(by_rank.get(rank, {}), default=0)
        if last and by_rank[rank][last]["state"] != "completed":
            previous = by_rank[rank][last]
            how = "failed" if previous["state"] == "failed" else "is pending"
            lines.append(
                f"rank {rank} NEVER ENTERED collective #{top} of group {group}: it is still in "
                f"{previous['op']} #{last}, which {how}"
            )
        elif last:
            previous = by_rank[rank][last]
            lines.append(
                f"rank {rank} NEVER ENTERED collective #{top} of group {group}: its last collective there "
                f"is {previous['op']} #{last} (completed); it issued {top - last} fewer "
                "collective(s) in this group than the others (a skipped or extra collective?)"
            )
        else:
            lines.append(
                f"rank {rank} NEVER ENTERED collective #{top} of group {group} (no collective of this group "
                "in its dump)"
            )
    return "\n".join(lines)


def analyze(dumps: dict[int, dict[str, Any]]) -> str:
    """The verdict on ``dumps`` (from :func:`load_dumps`), as lines of plain text."""
    world = _world(dumps)
    lines = [f"tdist-debug: dumps of rank(s) {sorted(dumps)} of a world of {len(world)}"]
    missing = [r for r in world if r not in dumps]
    if missing:
        lines.append(f"rank(s) {missing} left no dump (stopped, killed or stuck where they could not write one)")
    lines.append("what each rank is doing:")
    for rank in world:
        if rank not in dumps:
            lines.append(f"  rank {rank}: unknown (no dump)")
            continue
        entries = [e for e in dumps[rank]["entries"] if e["seq"] > 0]
        open_ = [e for e in entries if e["state"] != "completed"]
        if open_:
            lines.append(f"  rank {rank}: {_doing(open_[-1])}")
        elif entries:
            lines.append(
                f"  rank {rank}: in no operation; last completed {_describe(entries[-1])} "
                f"(dumped on: {dumps[rank]['reason']})"
            )
        else:
            lines.append(f"  rank {rank}: issued no operation (dumped on: {dumps[rank]['reason']})")
    findings = []
    for group, by_rank in sorted(_collectives(dumps).items()):
        diverged = _divergence(group, by_rank)
        if diverged:
            findings.append(diverged)
        stuck = _stuck(group, _members(group, by_rank, dumps), by_rank, dumps)
        if stuck:
            findings.append(stuck)
    lines.append("verdict:")
    lines.extend(f"  {line}" for finding in findings for line in finding.splitlines())
    if not findings:
        lines.append("  the ranks agree: no collective diverged and none is unfinished")
    return "\n".join(lines)
