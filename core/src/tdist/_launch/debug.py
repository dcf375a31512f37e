"""``tdistrun --debug-dump DIR``: the flight recorder (the ``tdist-debug`` distribution)
on in every worker, and its analyser's verdict when the job fails.

The core does not depend on tdist-debug: it is imported only when the option is given.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Callable, Optional

__all__ = ["missing_reason", "worker_env", "clear_old_dumps", "verdict"]

#: How many operations each worker keeps when ``TDIST_DEBUG_RECORDER`` does not say.
DEFAULT_CAPACITY = "2000"


def missing_reason() -> Optional[str]:
    """Why ``--debug-dump`` cannot work here (tdist-debug not installed), or None."""
    if importlib.util.find_spec("tdist_debug") is None:
        return "--debug-dump needs the flight recorder, which is not installed: pip install tdist-debug"
    return None


def worker_env(directory: str) -> dict[str, str]:
    """The variables that turn the recorder on in a worker, dumping to ``directory`` on
    failure, timeout, SIGUSR1, SIGTERM and exit."""
    return {
        "TDIST_DEBUG_RECORDER": os.environ.get("TDIST_DEBUG_RECORDER") or DEFAULT_CAPACITY,
        "TDIST_DEBUG_DUMP_DIR": os.path.abspath(directory),
        "TDIST_DEBUG_DUMP_AT_EXIT": "1",
    }


def clear_old_dumps(directory: str) -> None:
    """Remove the dumps and traces an earlier job left in ``directory`` (the analyser
    would read them as this job's); nothing in a directory the recorder refuses."""
    from tdist_debug.dumpfiles import dump_dir_refusal

    if dump_dir_refusal(directory) is not None:
        return  # the workers say why, and write nothing there
    for pattern in ("rank*.json", "trace-rank*.json"):
        for path in glob.glob(os.path.join(directory, pattern)):
            os.remove(path)


def verdict(directory: str, log: Callable[[str], None]) -> None:
    """Log the analyser's verdict on the dumps in ``directory`` (or why there is none)."""
    from tdist_debug import analyze, load_dumps
    from tdist_debug.dumpfiles import dump_dir_refusal

    refusal = dump_dir_refusal(directory)
    if refusal is not None:  # whatever is there was not written by this job
        log(f"debug dumps: {refusal}")
        return
    try:
        text = analyze(load_dumps(directory))
    except (OSError, ValueError) as exc:
        log(f"debug dumps: {exc}")
        return
    log(f"debug dumps in {directory}; the flight recorder's analysis:")
    for line in text.splitlines():
        log(line)
