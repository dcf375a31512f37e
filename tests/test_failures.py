"""Failure scenarios in one-off worlds: peer killed mid-collective, init with a missing
peer, mismatched collectives, recv/wait timeouts, op before init, re-init, init methods."""

from tdist.testing import collect

collect(globals(), suite="failures")
