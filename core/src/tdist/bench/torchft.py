"""``--torchft``: how fast torchft's DDP training recovers from a SIGKILL with tdist's
backend as its process group (:class:`tdist.integrations.torchft.ProcessGroupTdist`)
against torchft's own ``ProcessGroupGloo``, side by side in one run.

Each sample runs torchft's DDP example (``examples/torchft/train_ddp.py`` of this
repository: torchft's ``Manager``, ``DistributedDataParallel`` and ``Optimizer``, two
replica groups of one process on CPU) with a lighthouse in this process; once 5 steps
are committed replica group 1 SIGKILLs itself, either ``between-steps`` (before its next
quorum) or ``mid-step`` (in the next step, after its forward pass, while replica group 0
is in the gradient all-reduce), and is not restarted. Measured on the survivor, from the
kill (wall-clock times the processes print):

* *failure seen*: the step torchft drops because the all-reduce failed (mid-step only);
* *reconfigure*: how long the survivor's ``pg.configure`` for the new quorum took (the
  abort of the old group, then the new one: the process group's own part of the recovery);
* *recovered*: its first step committed without the dead one (step 6): the lighthouse's
  new quorum without the dead replica group (which waits for its heartbeat to time out,
  ``--torchft-heartbeat-ms``), the reconfiguration, one training step.

Samples alternate between the process groups, ``--repeats`` each; medians are reported.
A survivor that does not survive is reported as such, with its last error line.
Needs torchft (``pip install torchft``) and a source checkout (the example).

    python -m tdist.bench --torchft
    python -m tdist.bench --torchft --repeats 5 --torchft-heartbeat-ms 500
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

__all__ = ["torchft_bench", "format_torchft", "PGS", "KILLS"]

#: The process groups compared: tdist's adapter on tdist-tcp, torchft's ProcessGroupGloo.
PGS = ("tdist-tcp", "gloo")
KILLS = ("between-steps", "mid-step")
KILL_AT, STEPS = 5, 12
_LABELS = {"tdist-tcp": "tdist-tcp (ProcessGroupTdist)", "gloo": "torchft ProcessGroupGloo"}


def example_path() -> Path:
    """``examples/torchft/train_ddp.py`` of the source checkout this module runs from."""
    path = Path(__file__).resolve().parents[4] / "examples" / "torchft" / "train_ddp.py"
    if not path.is_file():
        raise SystemExit(f"tdist.bench --torchft: needs a source checkout of tdist ({path} not found)")
    return path


def _records(output: str, tag: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in output.splitlines() if line.startswith(tag + " ")]


def _last_error(output: str) -> str:
    """The last error line of ``output``, with where it was raised when a traceback says."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if "Error" in line and not line.startswith("TORCHFT_")]
    if not errors:
        return (lines[-1] if lines else "no output")[:160]
    last = errors[-1]
    where = [line for line in lines[:last] if line.startswith('File "')]
    if where:
        path, _, rest = where[-1][len('File "') :].partition('"')
        place = "/".join(Path(path).parts[-2:]) + rest.split(",")[1].replace(" line ", ":")
        return f"{lines[last][:120]} at {place}"
    return lines[last][:160]


def run_once(pg: str, kill: str, heartbeat_ms: int, timeout: float) -> dict:
    """One sample: the lighthouse, two replica groups, the kill; what the survivor saw."""
    from torchft._torchft import LighthouseServer

    from ..testing.processes import base_env, run_job

    example = str(example_path())
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=10000, quorum_tick_ms=100, heartbeat_timeout_ms=heartbeat_ms
    )
    try:
        common = [sys.executable, example, "--pg", pg, "--steps", str(STEPS)]
        commands = [common, [*common, "--kill-at", str(KILL_AT), "--kill-when", kill]]
        envs = [
            base_env(TORCHFT_LIGHTHOUSE=lighthouse.address(), REPLICA_GROUP_ID=str(r), NUM_REPLICA_GROUPS="2")
            for r in range(2)
        ]
        survivor, killed = run_job(commands, envs, timeout)
    finally:
        lighthouse.shutdown()
    row: dict = {"pg": pg, "kill": kill, "heartbeat_ms": heartbeat_ms}
    kills = _records(killed.stdout, "TORCHFT_KILL")
    if not kills:
        row["error"] = f"the replica to kill never got to step {KILL_AT}: {_last_error(killed.output)}"
        return row
    killed_at = kills[0]["t"]
    failed = [r for r in _records(survivor.stdout, "TORCHFT_FAILED") if r["t"] > killed_at]
    # The first step the survivor commits without the dead replica group: the kill came
    # after step KILL_AT's commit (between steps) or during the next step (mid-step).
    steps = [r for r in _records(survivor.stdout, "TORCHFT_STEP") if r["step"] > KILL_AT]
    if survivor.returncode != 0 or not steps:
        row["error"] = f"the survivor did not survive (exit {survivor.returncode}): {_last_error(survivor.output)}"
        return row
    row["failure_seen_s"] = failed[0]["t"] - killed_at if failed else None
    row["recovered_s"] = steps[0]["t"] - killed_at
    configures = [r for r in _records(survivor.stdout, "TORCHFT_CONFIGURE") if r["t"] > killed_at]
    row["configure_s"] = configures[0]["seconds"] if configures else None
    return row


def torchft_bench(repeats: int = 3, heartbeat_ms: int = 1000, timeout: float = 300.0) -> list[dict]:
    """``repeats`` samples of every (kill, process group), alternating; one row for each
    with medians (or the error of the first sample that failed)."""
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"tdist.bench --torchft: needs torchft ({exc}); pip install torchft") from None
    samples: dict[tuple[str, str], list[dict]] = {(k, p): [] for k in KILLS for p in PGS}
    for index in range(repeats):
        for kill in KILLS:
            for pg in PGS:
                sample = run_once(pg, kill, heartbeat_ms, min(timeout, 300.0))
                print(f"[bench] torchft {kill} {pg} ({index + 1}/{repeats}): {sample}", file=sys.stderr, flush=True)
                samples[(kill, pg)].append(sample)
    rows = []
    for (kill, pg), runs in samples.items():
        good = [r for r in runs if "error" not in r]
        row: dict = {"pg": pg, "kill": kill, "heartbeat_ms": heartbeat_ms, "samples": len(good), "of": len(runs)}
        if good:
            row["recovered_s"] = statistics.median(r["recovered_s"] for r in good)
            for key in ("failure_seen_s", "configure_s"):
                values = [r[key] for r in good if r.get(key) is not None]
                row[key] = statistics.median(values) if values else None
        if len(good) < len(runs):
            row["error"] = next(r["error"] for r in runs if "error" in r)
        rows.append(row)
    return rows


def format_torchft(rows: list[dict]) -> str:
    first = rows[0]
    lines = [
        "torchft's DDP example, 2 replica groups x 1 process (CPU), one SIGKILLed after step "
        f"{KILL_AT}; lighthouse heartbeat timeout {first['heartbeat_ms']} ms; medians, seconds from the kill "
        "to the survivor's dropped step and its recovery; its reconfiguration's duration:",
        f"  {'kill':<14} {'process group':<30} {'failure seen':>12} {'reconfigure':>12} {'recovered':>10}",
    ]
    for row in rows:
        label = _LABELS.get(row["pg"], row["pg"])
        if "recovered_s" not in row:
            lines.append(f"  {row['kill']:<14} {label:<30} {row['error']}")
            continue
        seen = "-" if row.get("failure_seen_s") is None else f"{row['failure_seen_s']:.3f} s"
        configure = "-" if row.get("configure_s") is None else f"{row['configure_s'] * 1e3:.1f} ms"
        note = (
            ""
            if row["samples"] == row["of"]
            else f"  ({row['of'] - row['samples']} of {row['of']} failed: {row['error']})"
        )
        lines.append(f"  {row['kill']:<14} {label:<30} {seen:>12} {configure:>12} {row['recovered_s']:>8.3f} s{note}")
    return "\n".join(lines)
