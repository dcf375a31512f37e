"""The conformance suite against our backends: every body in tdist.testing.conformance,
for each --tdist-backend (default: all available) and world size 1, 2, 4.

    .venv/bin/python -m pytest tests/test_conformance.py --tdist-backend tcp
"""

from tdist.testing import collect

collect(globals())
