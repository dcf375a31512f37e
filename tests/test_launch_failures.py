"""Real tdist programs (tcp backend) failing under tdistrun:

- the launcher names the rank that failed first on its own (the root cause), with its
  traceback's last lines, and the ranks that failed because it did -- also when they
  exit before it (a rank that raises is still shutting down when its peers, blocked in
  all_reduce, have already failed) and across a restart;
- Ctrl-C (SIGINT to the launcher, which forwards it) reaches every rank's program as the
  KeyboardInterrupt itself, never as a backend error.

Each launcher runs in its own session, killed when the test ends.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

from tdist._errorfile import Failure  # noqa: E402
from tdist.testing.processes import base_env, kill_session, run_job  # noqa: E402

LAUNCH_TIMEOUT = 120
pytestmark = pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30)

TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]

CRASH = """
import os, signal, sys, time
from datetime import timedelta
import torch
import tdist as dist

dist.init_process_group("tcp", timeout=timedelta(seconds=60))
t = torch.ones(1024)
for _ in range(20):
    dist.all_reduce(t)


def train_step():
    raise ValueError("boom on rank 1")


if dist.get_rank() == 1:
    time.sleep(0.5)  # rank 0 waits in the all_reduce below by now
    if "--kill" in sys.argv:
        os.kill(os.getpid(), signal.SIGKILL)
    train_step()
dist.all_reduce(t)
"""

TRAIN_UNTIL_INTERRUPTED = """
import sys
from datetime import timedelta
import torch
import tdist as dist

dist.init_process_group("tcp", timeout=timedelta(seconds=60))
t = torch.ones(1024)
steps = 0
try:
    while True:
        dist.all_reduce(t)
        t.fill_(1.0)
        steps += 1
        if steps == 200:
            print("training", flush=True)
except KeyboardInterrupt:
    print(f"KeyboardInterrupt handler ran on rank {dist.get_rank()}", flush=True)
"""


@pytest.mark.parametrize(
    "options",
    [[], ["--max-restarts", "1"], ["--kill"]],
    ids=["raise", "raise-with-a-restart", "killed"],
)
def test_root_cause_is_the_rank_that_failed_first(tmp_path, options):
    """rank 1 raises (or is SIGKILLed) while rank 0 waits for it in all_reduce: rank 0
    fails at once with a peer-gone DistBackendError, often before rank 1 has exited;
    the launcher still names rank 1 as the root cause, with the end of its traceback, and
    rank 0 as failing because rank 1 did (torchrun's "Root Cause"). Before the workers'
    error records, the launcher named rank 0 in most runs."""
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    restarts = [o for o in options if o != "--kill"]
    args = [*TDISTRUN, "--nproc-per-node", "2", *restarts, str(script), *(o for o in options if o == "--kill")]
    res = run_job([args], [base_env()], timeout=LAUNCH_TIMEOUT)[0]
    err = res.stderr
    lines = [line for line in err.splitlines() if line.startswith("tdistrun: ")]
    where = "the launcher said:\n" + "\n".join(lines)
    after = " after 1 restart(s)" if restarts else ""
    if "--kill" in options:
        assert res.returncode == 128 + signal.SIGKILL, where
        assert f"tdistrun: root cause: rank 1 failed with signal SIGKILL (exit status 137){after}" in err, where
    else:
        assert res.returncode == 1, where
        assert any(
            line.startswith("tdistrun: root cause: rank 1 failed") and f"{after}: ValueError: boom on rank 1" in line
            for line in lines
        ), where
        assert 'tdistrun:       raise ValueError("boom on rank 1")' in lines, where  # the traceback's end
        assert "tdistrun:   ValueError: boom on rank 1" in lines, where
    # rank 0's error: the agreed rank failure naming rank 1 (a DistBackendError)
    assert any(line.startswith("tdistrun: rank 0 failed because rank 1 did: DistRankFailureError") for line in lines), (
        where
    )
    assert not any("root cause: rank 0" in line for line in lines), where


def test_ctrl_c_is_a_keyboard_interrupt_on_every_rank(tmp_path):
    """SIGINT to tdistrun while the ranks loop over all_reduce: the launcher forwards it,
    and every rank's ``except KeyboardInterrupt`` handler runs -- the collective a rank
    was in does not turn the interrupt into a DistBackendError (on itself or its peer)."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN_UNTIL_INTERRUPTED)
    proc = subprocess.Popen(
        [*TDISTRUN, "--nproc-per-node", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=base_env(),
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while time.monotonic() < deadline and sum(line.endswith("] training\n") for line in lines) < 2:
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.05)
        assert sum(line.endswith("] training\n") for line in lines) == 2, "".join(lines)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        reader.join(10)
    finally:
        kill_session(proc.pid)
        if proc.poll() is None:
            proc.wait(10)
    out = "".join(lines)
    assert proc.returncode == 128 + signal.SIGINT, out
    for rank in (0, 1):
        assert f"[rank {rank}] KeyboardInterrupt handler ran on rank {rank}" in out, out
    assert "DistBackendError" not in out and "Traceback" not in out, out


# --------------------------------------------------------------------------- the error records
def _failure(rank: int, at: float, consequence: bool = False, record: bool = True) -> Failure:
    rec = {"type": "E", "message": "m", "consequence": consequence, "peer": None, "traceback": [], "time": at}
    return Failure(rank=rank, local_rank=rank, pid=100 + rank, exitcode=1, at=at, record=rec if record else None)


def test_root_cause_is_the_earliest_failure_of_its_own():
    from tdist._errorfile import root_cause

    own, follower = _failure(1, at=2.0), _failure(0, at=1.0, consequence=True)
    assert root_cause([follower, own]) is own  # earlier, but only because rank 1 failed
    silent = _failure(2, at=3.0, record=False)  # killed: no record, so not known to follow anyone
    assert root_cause([follower, silent]) is silent
    assert root_cause([_failure(3, at=5.0, consequence=True), follower]) is follower  # all follow: the earliest
    assert root_cause([]) is None


def test_failed_peer_is_found_among_the_causes():
    from tdist import DistBackendError
    from tdist._errors import failed_peer

    gone = DistBackendError("rank 3 went away")
    gone.failed_peer = 3
    try:
        try:
            raise gone
        except DistBackendError as exc:
            raise RuntimeError("the step failed") from exc
    except RuntimeError as wrapped:
        assert failed_peer(wrapped) == 3
    assert failed_peer(DistBackendError("a mismatch")) is None
    assert failed_peer(ValueError("boom")) is None


def test_a_record_is_written_once_privately_and_read_back(tmp_path):
    import os

    from tdist._errorfile import read_record, write_record

    path = str(tmp_path / "rank1.json")
    try:
        raise ValueError("boom")
    except ValueError as exc:
        write_record(exc, path)
        with pytest.raises(FileExistsError):
            write_record(exc, path)
        link = tmp_path / "link.json"
        link.symlink_to(tmp_path / "elsewhere.json")
        with pytest.raises(OSError):
            write_record(exc, str(link))
        assert not (tmp_path / "elsewhere.json").exists()
    assert os.stat(path).st_mode & 0o777 == 0o600
    record = read_record(path)
    assert record is not None
    assert record["type"] == "ValueError" and record["message"] == "boom" and not record["consequence"]
    assert record["traceback"][-1] == "ValueError: boom"
    assert read_record(str(tmp_path / "missing.json")) is None


HOOKED = """
import os, subprocess, sys
import tdist
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('TDIST_ERROR_FILE'))"],
                       capture_output=True, text=True)
print("child sees", child.stdout.strip(), flush=True)
gone = tdist.DistBackendError("tcp backend: rank 0 lost its connection to rank 1")
gone.failed_peer = 1
raise gone
"""


def test_import_tdist_records_an_uncaught_exception(tmp_path):
    """A program that imports tdist, under a launcher that sets TDIST_ERROR_FILE, records
    the exception that ends it (a peer's failure, naming the peer) and still prints its
    traceback; its children do not inherit the variable."""
    from tdist._errorfile import read_record

    path = tmp_path / "rank0.json"
    res = run_job(
        [[sys.executable, "-c", HOOKED]], [base_env(TDIST_ERROR_FILE=str(path), RANK="0")], timeout=LAUNCH_TIMEOUT
    )[0]
    assert res.returncode == 1, res.output
    assert "child sees None" in res.stdout
    assert "DistBackendError: tcp backend: rank 0 lost its connection to rank 1" in res.stderr  # the usual traceback
    record = read_record(str(path))
    assert record is not None, res.output
    assert record["consequence"] is True and record["peer"] == 1 and record["rank"] == 0
    assert record["type"] == "DistBackendError"
