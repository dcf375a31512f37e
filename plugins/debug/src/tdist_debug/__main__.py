"""``tdist-debug`` / ``python -m tdist_debug``: ``analyze DIR`` explains the dumps of a
job; ``trace DIR -o FILE`` merges every rank's trace (or dumps) into one Chrome/Perfetto
trace file."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from typing import Optional, Sequence

from .analyze import analyze, load_dumps
from .recorder import trace_events


def _merge_traces(directory: str) -> dict:
    events: list = []
    traces = sorted(glob.glob(os.path.join(directory, "trace-rank*.json")))
    for path in traces:
        with open(path) as f:
            events.extend(json.load(f)["traceEvents"])
    if not traces:  # no full trace: the dumps' windows
        for rank, dump in load_dumps(directory).items():
            events.extend(trace_events(rank, dump["entries"])["traceEvents"])
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tdist-debug", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    analyse = commands.add_parser("analyze", help="explain the dumps in DIR (one rank<R>.json per rank)")
    analyse.add_argument("directory")
    trace = commands.add_parser("trace", help="merge DIR's traces into one Chrome trace-event file")
    trace.add_argument("directory")
    trace.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "analyze":
            print(analyze(load_dumps(args.directory)))
        else:
            with open(args.output, "w") as f:
                json.dump(_merge_traces(args.directory), f)
            print(f"tdist-debug: wrote {args.output} (open it in https://ui.perfetto.dev or chrome://tracing)")
    except (OSError, ValueError) as exc:
        print(f"tdist-debug: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
