"""What a user gets from the built distributions alone: ``make dist`` puts a wheel and an sdist of
every distribution into dist/; a fresh venv installs tdist and tdist-tcp from those wheels (no
checkout on its path, no other backend) and runs a 2-rank job under tdistrun."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
from repo_paths import ROOT as _ROOT

ROOT = pathlib.Path(_ROOT)
DIST = ROOT / "dist"
INSTALL_TIMEOUT = 600
JOB_TIMEOUT = 120

pytestmark = pytest.mark.skipif(
    not list(DIST.glob("tdist_tcp-*.whl")) and not os.environ.get("CI"),
    reason="no wheels in dist/: run `make dist` (make test does)",
)

_PROGRAM = """
    import json, os, sys
    import torch, tdist, tdist_tcp
    tdist.init_process_group("tcp")
    t = torch.ones(3) * (tdist.get_rank() + 1)
    tdist.all_reduce(t)
    report = {"sum": t.tolist(), "tdist": tdist.__file__, "tdist_tcp": tdist_tcp.__file__}
    tdist.destroy_process_group()
    print("RESULT " + json.dumps(report))
"""


def _run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_a_fresh_venv_runs_a_job_from_the_wheels_alone(tmp_path):
    assert list(DIST.glob("tdist-*.tar.gz")) and list(DIST.glob("tdist_tcp-*.tar.gz")), "make dist builds sdists too"
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # torch and the other dependencies as a user gets them (the test environment's pins) ...
    _run([*pip, "-c", str(ROOT / "constraints.txt"), "torch", "numpy", "pluggy"], INSTALL_TIMEOUT)
    # ... and tdist from the built wheels only: one backend
    _run([*pip, "--no-index", "--find-links", str(DIST), "tdist", "tdist-tcp"], INSTALL_TIMEOUT)
    program = tmp_path / "job.py"
    program.write_text(textwrap.dedent(_PROGRAM))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    job = _run(
        [str(venv / "bin" / "tdistrun"), "--standalone", "--nproc-per-node", "2", str(program)],
        JOB_TIMEOUT,
        cwd=tmp_path,
        env=env,
    )
    reports = [json.loads(line.split("RESULT ", 1)[1]) for line in job.stdout.splitlines() if "RESULT " in line]
    assert len(reports) == 2, job.stdout
    site = str(venv)
    for report in reports:
        assert report["sum"] == [3.0, 3.0, 3.0]
        assert report["tdist"].startswith(site) and report["tdist_tcp"].startswith(site), report
    listed = _run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], 60, cwd=tmp_path)
    names = {p["name"] for p in json.loads(listed.stdout)}
    assert {"tdist", "tdist-tcp"} <= names and not names & {"tdist-gloo", "tdist-mpi", "tdist-nccl"}
    info = _run([str(venv / "bin" / "python"), "-m", "tdist", "info"], 120, cwd=tmp_path)
    assert "torch supported: torch>=" in info.stdout and "tdist-tcp" in info.stdout
