"""The flight recorder and its analyser on real jobs that go wrong: a skipped
collective and a stopped rank (tcp, under tdistrun --debug-dump), a broadcast whose
root differs between ranks (gloo under tdistrun, mpi under mpirun); plus the recorder
being off unless asked, SIGUSR1 dumps and the Chrome trace."""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
from tdist.testing.processes import base_env, python_job, run_job

import tdist
from tdist._local import find_mpirun, mpirun_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FAULTY = str(Path(__file__).parent / "programs" / "faulty.py")
TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]


def tdistrun(nproc: int, dump_dir: Path, *args: str, launcher=TDISTRUN):
    [result] = run_job(
        [[*launcher, "--nproc-per-node", str(nproc), "--grace-period", "1", "--debug-dump", str(dump_dir), *args]],
        [base_env()],
        timeout=120,
    )
    return result


def test_skipped_all_reduce_verdict_names_rank_and_sequence_number(tmp_path):
    result = tdistrun(4, tmp_path, FAULTY, "tcp", "skip", "10")
    assert result.returncode != 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}.json" for r in range(4)]
    assert "rank(s) [0, 1, 3] are in all_reduce #5 of group pg0" in result.stderr, result.stderr[-3000:]
    assert "rank 2 NEVER ENTERED collective #5 of group pg0" in result.stderr, result.stderr[-3000:]
    assert result.stderr.index("failed with") < result.stderr.index("NEVER ENTERED")  # after the failure


def test_stopped_rank_left_no_dump_and_is_named(tmp_path):
    result = tdistrun(3, tmp_path, FAULTY, "tcp", "stop", "4")
    assert result.returncode != 0, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["rank0.json", "rank2.json"]
    dump = json.loads((tmp_path / "rank0.json").read_text())
    assert dump["entries"][-1]["state"] == "failed" and "rank 1" in dump["entries"][-1]["error"], dump["entries"][-1]
    assert "rank(s) [1] left no dump" in result.stderr, result.stderr[-3000:]
    assert "rank 1 NEVER ENTERED collective #3 of group pg0" in result.stderr, result.stderr[-3000:]


def test_mismatched_broadcast_root_on_gloo_names_both_roots(tmp_path):
    result = tdistrun(2, tmp_path, FAULTY, "gloo", "root", "4")
    assert result.returncode != 0, result.stderr[-3000:]
    assert (
        "DIVERGED at collective #2 of group pg0: the ranks disagree on the root: "
        "rank(s) [0] used root 0; rank(s) [1] used root 1"
    ) in result.stderr, result.stderr[-3000:]


@pytest.mark.skipif(not find_mpirun() or not tdist.is_backend_available("mpi"), reason="mpirun or tdist-mpi missing")
def test_mismatched_broadcast_root_on_mpi_under_mpirun(tmp_path):
    session = tempfile.mkdtemp(dir=tmp_path)
    env = mpirun_env(
        base_env(
            TDIST_DEBUG_RECORDER="100", TDIST_DEBUG_DUMP_DIR=str(tmp_path / "dumps"), TDIST_DEBUG_DUMP_AT_EXIT="1"
        ),
        session,
    )
    run_job(
        [
            [
                find_mpirun(),
                "-n",
                "2",
                "--oversubscribe",
                "--bind-to",
                "none",
                "-x",
                "TDIST_DEBUG_RECORDER",
                "-x",
                "TDIST_DEBUG_DUMP_DIR",
                "-x",
                "TDIST_DEBUG_DUMP_AT_EXIT",
                sys.executable,
                FAULTY,
                "mpi",
                "root",
                "4",
            ]
        ],
        [env],
        timeout=90,
    )
    [analysis] = run_job([[sys.executable, "-m", "tdist_debug", "analyze", str(tmp_path / "dumps")]], [base_env()], 60)
    assert analysis.returncode == 0, analysis.stderr
    assert "rank(s) [0] used root 0; rank(s) [1] used root 1" in analysis.stdout, analysis.stdout


RECORDER_PROBE = """
import json, os, signal, sys, time
from datetime import timedelta
import torch
import tdist as dist
from tdist._plugins import plugins
dist.init_process_group("tcp", timeout=timedelta(seconds=20))
t = torch.ones(3)
for _ in range(3):
    dist.all_reduce(t)
observing = plugins().observes_work
if observing:
    os.kill(os.getpid(), signal.SIGUSR1)
print(json.dumps({"observing": observing}))
dist.destroy_process_group()
"""


def test_recorder_off_unless_enabled_sigusr1_dump_and_chrome_trace(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(RECORDER_PROBE)
    ignoring = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # inherited by the ranks: the recorder still dumps
    try:
        _probe_jobs(tmp_path, probe)
    finally:
        signal.signal(signal.SIGUSR1, ignoring)


def _probe_jobs(tmp_path: Path, probe: Path) -> None:
    [off] = python_job([str(probe)], 1, timeout=60)
    assert off.returncode == 0 and json.loads(off.stdout)["observing"] is False, off.stderr  # installed, not enabled
    on = python_job(
        [str(probe)],
        2,
        timeout=60,
        TDIST_DEBUG_RECORDER="2",
        TDIST_DEBUG_DUMP_DIR=str(tmp_path / "d"),
        TDIST_DEBUG_TRACE="1",
    )
    assert all(r.returncode == 0 and json.loads(r.stdout)["observing"] for r in on), [r.stderr for r in on]
    dump = json.loads((tmp_path / "d" / "rank1.json").read_text())
    assert dump["reason"] == "SIGUSR1" and dump["groups"]["pg0"]["ranks"] == [0, 1]
    assert [(e["op"], e["seq"], e["state"]) for e in dump["entries"]] == [
        ("all_reduce", 2, "completed"),
        ("all_reduce", 3, "completed"),
    ]  # last 2 kept
    [merged] = run_job(
        [[sys.executable, "-m", "tdist_debug", "trace", str(tmp_path / "d"), "-o", str(tmp_path / "trace.json")]],
        [base_env()],
        60,
    )
    assert merged.returncode == 0, merged.stderr
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert sorted((e["pid"], e["name"]) for e in events) == [(r, f"all_reduce #{s}") for r in (0, 1) for s in (1, 2, 3)]


def test_debug_dump_without_tdist_debug_is_a_clear_error(tmp_path):
    hidden = [
        sys.executable,
        "-c",
        "import sys; sys.modules['tdist_debug'] = None; from tdist.launch import main; sys.exit(main())",
    ]
    result = tdistrun(1, tmp_path, FAULTY, "tcp", "skip", "5", launcher=hidden)
    assert result.returncode == 2, result.stderr
    assert "--debug-dump needs the flight recorder, which is not installed: pip install tdist-debug" in result.stderr
