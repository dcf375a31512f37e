"""tdist-broken: a backend that breaks one "must" of the backend contract on purpose.

A test fixture, not a plugin to use: ``tests/test_kit_catches_violations.py`` registers
it (a ``*.dist-info`` with an entry point, written into a temporary directory) and runs
the conformance kit on it once per violation, proving that the kit fails each one
with a message that names it.

The backend ``broken`` is the ``tcp`` backend behind a wrapper (:mod:`.backend`);
``TDIST_BROKEN=<violation>`` picks what the wrapper breaks (:data:`VIOLATIONS`),
unset it breaks nothing.
"""

from __future__ import annotations

import os

__all__ = ["BACKEND_NAME", "VIOLATIONS", "violation"]

BACKEND_NAME = "broken"

#: What ``TDIST_BROKEN`` may name, and what the backend then does wrong.
VIOLATIONS: dict[str, str] = {
    "blocks_async": "every operation blocks its caller until it has completed, async_op=True too",
    "not_bit_identical": "the last rank's float all_reduce/reduce results are off by a few ulps",
    "pending_survive_destroy": "a receive that fails (its group destroyed here or at the peer) stays pending forever",
    "timeout_as_runtime_error": "a timed-out operation raises RuntimeError instead of DistBackendTimeoutError",
    "timeout_names_nobody": "a timed-out operation's DistBackendTimeoutError names no rank",
    "lazy_send": "sends complete at once; the data leaves 1 s later, from the caller's buffer",
    "single_threaded": "an operation issued while another thread's is pending raises",
    "recv_accepts_anything": "a receive that fails (wrong size or dtype, ...) completes successfully",
    "no_source_rank": "receives complete without naming their sender",
    "any_source_by_rotation": "any-source receives take the peers in a fixed order (last rank first), not arrival order",
    "declares_int16_unsupported": "declares dtype.int16 unsupported, yet reduces int16 correctly",
    "refuses_uint8": "raises on uint8 reductions it declares supported",
    "early_is_completed": "is_completed() is True as soon as an operation is issued",
    "completes_only_in_wait": "a Work completes only when someone calls wait()",
}


def violation() -> str:
    """The violation ``TDIST_BROKEN`` names ("" for none); an unknown name is an error."""
    name = os.environ.get("TDIST_BROKEN", "")
    if name and name not in VIOLATIONS:
        raise ValueError(f"TDIST_BROKEN={name!r}: not one of {', '.join(VIOLATIONS)}")
    return name
