"""An interrupt (KeyboardInterrupt: any non-``Exception``) in a job of a tcp lane reaches
the thread that ran the job inline as it is, never as a DistBackendError; the job's Work
fails with a DistBackendError saying it was interrupted; the lane's own thread survives
one. (Across processes, with SIGINT in a blocking collective: the conformance kit's
``interrupt_during_collective`` and tests/test_launch_failures.py.)"""

from __future__ import annotations

import threading
import time

import pytest
from tdist import DistBackendError
from tdist_tcp.collectives.lanes import Lane, TcpWork

pytestmark = pytest.mark.timeout(60)


class _Interrupt(BaseException):
    """Stands for KeyboardInterrupt (pytest itself reacts to a real one)."""


def _interrupt() -> None:
    raise _Interrupt("Ctrl-C")


def test_waiter_running_the_job_inline_gets_the_interrupt_itself():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    try:
        work = TcpWork("all_reduce", 10.0)
        lane.submit(_interrupt, work)
        with pytest.raises(_Interrupt):
            work.wait()  # the waiting thread runs the job (the lane is idle)
        assert work.is_completed()
        with pytest.raises(DistBackendError, match="interrupted"):
            work.wait()  # later waits: the Work failed
        after = TcpWork("next", 10.0)
        lane.submit(lambda: [1], after)
        assert after.result() == [1]
    finally:
        lane.close()


def test_interrupt_in_an_earlier_job_run_by_the_waiter_is_raised_to_it():
    """The waiter of job 2 runs job 1 first (FIFO): job 1's interrupt reaches the waiter,
    which is the thread that was interrupted; job 1's Work fails."""
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    try:
        first, second = TcpWork("first", 10.0), TcpWork("second", 10.0)
        lane.submit(_interrupt, first)
        lane.submit(lambda: [2], second)
        with pytest.raises(_Interrupt):
            second.wait()
        with pytest.raises(DistBackendError, match="interrupted"):
            first.wait()
        assert second.wait(5) and second.result() == [2]  # run by the lane (or a later waiter)
    finally:
        lane.close()


def test_send_run_inline_by_the_caller_gets_the_interrupt():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    try:
        work = TcpWork("send", 10.0)
        with pytest.raises(_Interrupt):
            lane.try_inline(_interrupt, work)
        with pytest.raises(DistBackendError, match="interrupted"):
            work.wait()
    finally:
        lane.close()


def test_lane_thread_survives_an_interrupt_in_a_job():
    lane = Lane("test-lane", grace=0.01, inline_limit=1.0)
    try:
        bad, good = TcpWork("bad", 10.0), TcpWork("good", 10.0)
        lane.submit(_interrupt, bad, eager=True)
        deadline = time.monotonic() + 10
        while not bad.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert lane.thread() is not None and lane.thread() is not threading.current_thread()
        with pytest.raises(DistBackendError, match="interrupted"):
            bad.wait(5)
        lane.submit(lambda: [3], good, eager=True)
        deadline = time.monotonic() + 10
        while not good.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert good.is_completed() and good.result() == [3]
        assert lane.thread().is_alive()
    finally:
        lane.close()
