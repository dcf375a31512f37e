"""tdist-debug: a flight recorder and hang/desync analyser for every tdist backend.

Turn the recorder on with ``TDIST_DEBUG_RECORDER=N`` (keep the last N operations per
rank) before the program first uses tdist, with ``tdistrun --debug-dump DIR``, or in
process with :func:`enable`. Dumps go to ``TDIST_DEBUG_DUMP_DIR`` (one
``rank<R>.json`` per rank); ``python -m tdist_debug analyze DIR`` explains them.
"""

from __future__ import annotations

from .analyze import analyze, load_dumps
from .recorder import Recorder, current, enable

__all__ = ["Recorder", "enable", "current", "analyze", "load_dumps"]
