"""The tdist-debug tests run real jobs with the repository's job helpers (tests/jobs.py)."""

import os
import sys

sys.path.insert(
    0,
    os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "tests"
    ),
)
