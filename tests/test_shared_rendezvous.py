"""Several jobs on one rendezvous (``group_name``): one ``tcp://`` address or one
``file://`` path shared by jobs that run at the same time, run again, outlive the job
that served the address, or follow a job that crashed (SIGKILL). Every process runs
tests/shared_rendezvous_job.py in its own session and is killed if the test fails."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Optional

import pytest

from repo_paths import TESTS
from tdist.testing import free_port
from tdist.testing.processes import base_env, kill_session
from tdist import TCPStore

pytestmark = pytest.mark.timeout(240)

JOB = os.path.join(TESTS, "shared_rendezvous_job.py")


class Jobs:
    """The processes a test started (all killed at the end) and their shared state directory."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: list[subprocess.Popen] = []

    def start(
        self, init_method: str, group: str, world_size: int = 2, rank: Optional[int] = None, hold: bool = False
    ) -> subprocess.Popen:
        args = [sys.executable, JOB, init_method, group, str(world_size), str(self.state)]
        args += [] if rank is None else [str(rank)]
        proc = subprocess.Popen(
            args,
            env=base_env(TDIST_TEST_HOLD="1" if hold else "0"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def job(self, init_method: str, group: str, ranks: tuple = (None, None), hold: bool = False) -> list:
        return [self.start(init_method, group, len(ranks), r, hold) for r in ranks]

    def ready(self, procs: list, group: str, timeout: float = 120) -> None:
        """Wait until every process of job ``procs`` has initialised (and waits to go on)."""
        deadline = time.monotonic() + timeout
        while not all((self.state / f"{group}-{r}.ready").exists() for r in range(len(procs))):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                self.fail(f"job {group!r} did not get ready")
            time.sleep(0.05)

    def go(self, group: str) -> None:
        (self.state / f"{group}.go").touch()

    def finish(self, procs: list, group: str, timeout: float = 120) -> None:
        """Wait for ``procs`` (one job): each exits 0 having summed ranks 1..n twice."""
        n = len(procs)
        total = f"{n * (n + 1) // 2}"
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.fail(f"job {group!r} did not finish")
            outputs.append(out)
        results = sorted(line for out in outputs for line in out.splitlines() if line.startswith("RESULT"))
        expected = [f"RESULT {group} {r} {total} {total}" for r in range(n)]
        assert results == expected and all(p.returncode == 0 for p in procs), "\n".join(outputs)
        for r in range(n):
            (self.state / f"{group}-{r}.ready").unlink(missing_ok=True)

    def kill(self, procs: list) -> None:
        for proc in procs:
            kill_session(proc.pid)
            proc.wait(timeout=30)

    def fail(self, what: str) -> None:
        self.kill(self.procs)
        outputs = "\n".join(
            f"--- pid {p.pid} rc {p.returncode}\n{p.stdout.read() if p.stdout and not p.stdout.closed else ''}"
            for p in self.procs
        )
        pytest.fail(f"{what}\n{outputs}")


@pytest.fixture
def jobs(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    started = Jobs(state)
    yield started
    for proc in started.procs:
        kill_session(proc.pid)
        if proc.poll() is None:
            proc.wait(timeout=30)


def _wait_for_bytes(jobs: Jobs, proc: subprocess.Popen, path: Path, needle: bytes, timeout: float = 120) -> None:
    """Until ``proc`` wrote ``needle`` into ``path``; a failure if it ended first or never did."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and needle in path.read_bytes()):
        ended = proc.poll() is not None
        if ended or time.monotonic() > deadline:
            jobs.fail(f"{needle!r} never appeared in {path} (the process {'ended' if ended else 'runs'})")
        time.sleep(0.05)


def test_file_path_shared_by_jobs_at_once_again_and_after_a_crash(jobs, tmp_path):
    path = tmp_path / "shared"
    url = f"file://{path}"
    b = jobs.job(url, "b", ranks=(0, 1), hold=True)  # runs throughout: the path stays in use
    jobs.ready(b, "b")  # (else "a" may come and go first: the path's last user removes its files)
    jobs.finish(jobs.job(url, "a"), "a")
    alone = jobs.start(url, "a")  # the same job again: one process of two, killed while it gathers
    _wait_for_bytes(jobs, alone, path, b"tdist/jobs/a/1/member/0")
    jobs.kill([alone])
    jobs.finish(jobs.job(url, "a"), "a")  # and again, past the crashed run
    jobs.go("b")
    jobs.finish(b, "b")
    assert not path.exists() and not Path(f"{path}.tdist-lock").exists(), "the last process left its files behind"


def _wait_for_entry(port: int, group: str) -> None:
    """Until the directory served at ``port`` holds ``group``'s entry (a job published there)."""
    probe = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60), wait_for_workers=False)
    try:
        probe.wait([f"tdist/jobs/{group}"])
    finally:
        probe.close()


def test_tcp_address_shared_by_jobs_that_outlive_its_server_and_follow_a_crash(jobs):
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    a = jobs.job(url, "a", hold=True)  # the first job: one of its processes serves the address
    jobs.ready(a, "a")
    b = jobs.job(url, "b", ranks=(0, 1), hold=True)
    c0 = jobs.start(url, "c")  # gathers while the job serving the address ends
    gone = jobs.start(url, "d")  # one process of two, killed while it gathers: its entry stays
    _wait_for_entry(port, "d")
    jobs.kill([gone])
    jobs.finish(jobs.job(url, "d"), "d")  # the same job again, past the crashed run's entry
    jobs.ready(b, "b")
    jobs.go("a")
    jobs.finish(a, "a")
    c1 = jobs.start(url, "c")
    jobs.go("b")
    jobs.finish(b, "b")  # uses its store after the process that served the address has ended
    jobs.finish([c0, c1], "c")
