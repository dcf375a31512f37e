"""Failure scenarios (peer killed, missing peer at init, mismatches, timeouts), one-off worlds."""

from tdist.testing import collect

collect(globals(), suite="failures")
