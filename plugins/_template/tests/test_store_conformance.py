"""The tdist conformance kit against this backend: ``pytest tests/ [--tdist-world-sizes 1,2]``."""

from tdist.testing import collect

collect(globals())
