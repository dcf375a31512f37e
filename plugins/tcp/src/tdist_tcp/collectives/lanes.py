"""FIFO execution lanes: where collectives and sends run.

An operation is queued on a :class:`Lane` and its :class:`TcpWork` returned at once.
Whoever waits on the Work first *runs it in the waiting thread* when the lane is idle
(so a blocking collective costs no thread hand-off); otherwise the lane's worker
thread runs it. The worker leaves a freshly queued job alone for a short grace
period (the caller usually waits right away), then runs it, so an ``async_op``
collective that nobody waits on yet still makes progress. Jobs of one lane always
run one at a time, in the order they were queued; a caller that runs a job itself
(:meth:`Lane.claim`, the tcp backend's quick collectives) takes the lane only when
nothing runs or waits in it.

A Work waited for through its future instead (``get_future``: torch's DDP does, for
every bucket) has no waiter to run it: the worker starts it at once (:meth:`Lane.hurry`).
A Work is completed (its done-callbacks run) after its job has given the lane up. A
callback may queue more work on the same lane and wait for it (torch runs a Future's
``then`` callbacks in the completing thread; DDP's PowerSGD hook all-reduces inside
one): a waiter runs its job inline, and when the worker itself is in a callback, the
job that is queued then starts a new worker, which takes the lane over.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from tdist.plugin import DistBackendError, Work

__all__ = ["Lane", "Job", "TcpWork"]


class Job:
    """A function whose result completes a Work (what :meth:`Lane.try_inline` runs; queued
    jobs are the :class:`TcpWork` objects themselves, which saves an object per operation)."""

    __slots__ = ("fn", "work", "queued_at", "eager", "started")

    def __init__(self, fn: Callable[[], Any], work: "TcpWork") -> None:
        self.fn = fn
        self.work = work
        self.queued_at = 0.0
        self.eager = False
        self.started = False

    def run(self) -> None:
        try:
            result = self.fn()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # an interrupt of the thread that runs it inline
                _interrupted(self.work, exc)
                raise
            outcome: tuple = (self.work.set_exception, exc)
        else:
            outcome = (self.work.set_result, result)
        try:  # the Work's done-callbacks run here: their errors are not the lane's
            outcome[0](outcome[1])
        except Exception:
            pass


def _interrupted(work: Work, exc: BaseException) -> None:
    """Fail ``work``, whose job an interrupt (``exc``: KeyboardInterrupt, ...) cut short in
    the thread running it, with a :class:`DistBackendError` (a later ``wait`` raises that);
    the interrupt itself goes on up that thread's stack (the caller waiting inline, who was
    interrupted, gets it as it is)."""
    error = DistBackendError(f"{work.op}: interrupted ({type(exc).__name__}) while it ran")
    error.__cause__ = exc
    try:
        work.set_exception(error)
    except Exception:
        pass


class TcpWork(Work):
    """A :class:`tdist.Work` whose ``wait`` runs its queued job inline when it can.

    A queued TcpWork is its own job: ``fn`` (its result completes the Work), ``queued_at``,
    ``eager`` and ``started`` are what the lane needs to schedule it."""

    __slots__ = ("_job", "_lane", "_on_timeout", "fn", "queued_at", "eager", "started")
    fn: Callable[[], Any]  # set when queued (see Lane)
    queued_at: float
    eager: bool

    def __init__(self, op: str, default_timeout: Optional[float]) -> None:
        super().__init__(op, default_timeout)
        self._job: Optional["TcpWork"] = None  # self, once queued on a lane
        self._lane: Optional["Lane"] = None
        self._on_timeout: Optional[Callable[["TcpWork"], bool]] = None
        self.started = False

    def execute(self) -> Optional[tuple[Callable[[Any], None], Any]]:
        """Run the queued function; return how to complete this Work (:meth:`complete`),
        which the lane does after giving the lane up: a done-callback may then queue and
        wait for more work on the same lane. An interrupt (a non-``Exception``, which
        CPython raises only in the main thread) fails the Work at once and propagates,
        unless this is the lane's own thread (whose loop must go on): then None."""
        try:
            return (self.set_result, self.fn())
        except Exception as exc:
            return (self.set_exception, exc)
        except BaseException as exc:
            _interrupted(self, exc)
            lane = self._lane
            if lane is None or threading.current_thread() is not lane._thread:
                raise
            return None

    @staticmethod
    def complete(outcome: Optional[tuple[Callable[[Any], None], Any]]) -> None:
        """Complete a Work as :meth:`execute` said; its done-callbacks run here, and their
        errors are not the lane's."""
        if outcome is not None:
            try:
                outcome[0](outcome[1])
            except Exception:
                pass

    def _expedite(self) -> None:
        """Waited for through its future (DDP's buckets): no waiter will run it inline, so
        the lane's worker starts it (and whatever is queued before it) without the grace."""
        if self._lane is not None and not self.started and not self._done:
            self._lane.hurry()

    def _block(self, timeout: Optional[float]) -> bool:
        job = self._job
        if job is not None and not job.started and not self._done:
            self._lane.drive(job, timeout)  # type: ignore[union-attr]
        if super()._block(timeout):
            return True
        if self._on_timeout is not None and self._on_timeout(self):
            return True
        return False


class Lane:
    """One FIFO of jobs, one worker thread (started on first use).

    Queueing a job does not wake the worker (in the common blocking case the caller
    runs the job itself, and waking a thread per operation costs more than the
    operation): while the lane is in use the worker polls every ``grace`` seconds
    and takes a job nobody claimed; after ``idle_after`` seconds without jobs it
    sleeps until the next job wakes it.
    """

    def __init__(self, name: str, grace: float, inline_limit: float, idle_after: float = 0.5) -> None:
        self.name = name
        self.grace = grace
        self.idle_after = idle_after
        self.inline_limit = inline_limit  # waits shorter than this never run a job inline
        self._lock = threading.Lock()  # taken directly on hot paths (a Condition's ``with`` runs Python code)
        self._cv = threading.Condition(self._lock)
        self._running = threading.Lock()  # held while a job runs, by whichever thread runs it
        self._queue: deque[TcpWork] = deque()
        self._busy = False
        self._urgent = False
        self._asleep = False
        self._last = 0.0
        self._closed: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._completing: Optional[threading.Thread] = None  # the worker, while it runs done-callbacks

    def submit(self, fn: Callable[[], Any], work: "TcpWork", eager: bool = False) -> None:
        """Queue ``fn`` (its result completes ``work``). ``eager``: the worker starts it at
        once instead of leaving the caller the grace period to run it itself."""
        job = work
        job.fn = fn
        work._job = job
        work._lane = self
        with self._lock:
            if self._closed is not None:
                work.set_exception(self._closed)
                return
            # the worker may be in a done-callback that waits for this very job (torch's
            # Future callbacks, PowerSGD's): a new worker takes the lane over
            replace = self._completing is not None and self._completing is self._thread
            job.eager = eager or self._busy or bool(self._queue) or replace
            job.queued_at = self._last = time.monotonic()
            self._queue.append(job)
            if self._thread is None or replace:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._asleep = False
                self._thread.start()
            elif self._asleep or eager:
                self._asleep = False
                self._cv.notify()

    def hurry(self) -> None:
        """Have the worker run what is queued now, without the grace period (a job is
        waited for by a future, not by a caller that would run it)."""
        with self._cv:
            if self._queue and self._closed is None:
                self._urgent = True
                self._asleep = False
                self._cv.notify()

    def try_inline(self, fn: Callable[[], Any], work: "TcpWork") -> bool:
        """Run ``fn`` now in this thread if the lane is idle (keeps FIFO order); else False."""
        with self._lock:
            if self._closed is not None or self._busy or self._queue:
                return False
            self._busy = True
        try:
            with self._running:
                Job(fn, work).run()
        finally:
            with self._lock:
                self._busy = False
                self._last = time.monotonic()
                if self._queue:
                    self._cv.notify()
        return True

    def run_now(self, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` in this thread if the lane is idle and nothing is queued (FIFO order
        holds), letting its error propagate; False, without running it, otherwise."""
        with self._lock:
            if self._busy or self._queue or self._closed is not None:
                return False
            self._busy = True
        try:
            with self._running:
                fn()
        finally:
            with self._lock:
                self._busy = False
                if self._queue:
                    self._cv.notify()
        return True

    def claim(self) -> bool:
        """Take the idle lane (nothing running or queued) for a job the caller runs itself,
        without the lane's bookkeeping: True, and :meth:`release` gives it back; False,
        taking nothing, otherwise. One atomic test-and-set, no lock held: a job queued
        meanwhile comes after it (FIFO holds) and its runner waits for the release."""
        running = self._running
        if not running.acquire(False):
            return False
        if self._busy or self._queue or self._closed is not None:
            running.release()
            return False
        return True

    def release(self) -> None:
        """Give back a lane taken by :meth:`claim`."""
        self._running.release()

    def drive(self, job: TcpWork, timeout: Optional[float]) -> None:
        """Called by a waiter of ``job``: run the queue up to ``job`` inline if the lane is
        idle (and the wait is long enough), else ask the worker to hurry."""
        if timeout is not None and timeout < self.inline_limit:
            with self._cv:
                self._urgent = True
                self._cv.notify()
            return
        while True:
            with self._lock:
                if job.started or self._closed is not None:
                    return
                if self._busy or not self._queue:
                    self._urgent = True
                    self._cv.notify()
                    return
                head = self._queue.popleft()
                head.started = True
                self._busy = True
            outcome = None
            try:
                with self._running:
                    outcome = head.execute()
            finally:
                with self._lock:
                    self._busy = False
                    if self._queue:
                        self._cv.notify()
            head.complete(outcome)
            if head is job:
                return

    def _loop(self) -> None:
        cv = self._cv
        me = threading.current_thread()
        while True:
            with cv:
                while True:
                    if self._closed is not None:
                        return
                    now = time.monotonic()
                    if self._queue and not self._busy:
                        head = self._queue[0]
                        if head.eager or self._urgent or now - head.queued_at >= self.grace:
                            break
                        cv.wait(self.grace)
                    elif self._queue or now - self._last < self.idle_after:
                        cv.wait(self.grace)
                    else:
                        self._urgent = False
                        self._asleep = True
                        cv.wait()
                        self._asleep = False
                head = self._queue.popleft()
                head.started = True
                self._busy = True
                if not self._queue:
                    self._urgent = False
            outcome = None
            try:
                with self._running:
                    outcome = head.execute()
            finally:
                with cv:
                    self._busy = False
                    self._last = time.monotonic()
                    self._completing = me
            head.complete(outcome)  # outside the lane: see submit
            with cv:
                if self._completing is me:
                    self._completing = None
                if self._thread is not me:
                    return  # a new worker took the lane over while this one ran callbacks

    def close(self, error: Optional[BaseException] = None) -> None:
        """Fail the queued jobs, stop the worker (after its current job). Idempotent."""
        with self._cv:
            if self._closed is not None:
                return
            self._closed = error or DistBackendError(f"{self.name}: the process group was destroyed")
            queued = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for job in queued:
            job.started = True
            job.set_exception(self._closed)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)

    def thread(self) -> Optional[threading.Thread]:
        return self._thread
