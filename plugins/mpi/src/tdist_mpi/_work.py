"""``MPIWork``: a tdist Work backed by one MPI request, completed by polling ``Test()``.

``wait(timeout)`` tests the request until it completes or the deadline passes,
then raises :class:`tdist.DistBackendTimeoutError`. A caller's own ``timeout`` leaves the
request pending (a later wait may still see it complete); the group's timeout (``wait()``)
fails the operation: its request is given up (a receive is cancelled), its buffers stay
referenced, and the error is a collective's timeout, from which the core's failure
agreement finds a stopped or lost rank. Polling: batches of 64 back-to-back ``Test()`` calls (with
Open MPI each one also moves transfers on), for the first 10 ms without pause, then
with a ``sleep(0)`` yield between batches until 1 s, then one test per 200 µs nap, so
a rank waiting long for a slow peer does not hog a core. ``is_completed`` tests once.
Done-callbacks (``add_done_callback``, ``get_future``) on a pending work are
driven by one shared daemon thread that polls while such works exist.

With MPI's fault tolerance a pending request whose communicator a peer revoked fails
with ``MPI_ERR_REVOKED`` as soon as a poll past the spinning phase sees the revocation:
Open MPI's non-blocking collectives do not always complete a request the revocation
caught in flight (its schedule waits on a message the peer that revoked never sends),
and the survivors must not wait for the group's timeout before they shrink.

Per-call cost matters here (a 4-byte all_reduce is ~1 µs of MPI): the core's Work
creates no ``threading.Event`` unless a second thread blocks on a pending work.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from tdist import DistBackendTimeoutError, Work

from ._runtime import mpi_error, runtime

__all__ = ["MPIWork", "SPIN_S", "YIELD_S", "NAP_S"]

SPIN_S = 0.010
YIELD_S = 1.0
NAP_S = 0.0002

_monotonic = time.monotonic
_sleep = time.sleep
_Lock = threading.Lock

_PENDING, _DONE, _OTHER = 0, 1, 2
#: Requests abandoned at destroy and the buffers they may still write (never freed under MPI's feet).
_ABANDONED: list = []
_SPIN_TRIES = 64  # Test() calls per lock hold and clock check while spinning


class MPIWork(Work):
    """One MPI request; ``finalize`` (copy staged results out, divide for AVG) runs once,
    in the thread that sees the request complete, before the work is marked done;
    ``convert(operation, exc)`` makes the tdist error of an ``MPI.Exception`` the request
    completed with (default :func:`mpi_error`; the backend's names a lost rank);
    ``revoked()`` (with fault tolerance) says whether the communicator was revoked."""

    __slots__ = (
        "_req",
        "_status",
        "_finalize",
        "_outputs",
        "_keep",
        "_mpilock",
        "_convert",
        "_test_lock",
        "_revoked",
        "__weakref__",
    )

    def __init__(
        self,
        op: str,
        req: Any,
        timeout: Optional[float],
        outputs: Sequence[Any] = (),
        finalize: Optional[Callable[[], None]] = None,
        keep: Any = None,
        status: Any = None,
        mpilock: Any = None,
        convert: Optional[Callable[[str, BaseException], BaseException]] = None,
        revoked: Optional[Callable[[], bool]] = None,
    ) -> None:
        Work.__init__(self, op, timeout)
        self._test_lock = _Lock()
        self._req = req
        self._status = status
        self._finalize = finalize
        self._outputs = outputs
        self._keep = keep  # tensors MPI may still read or write (buffers are bare addresses)
        self._mpilock = mpilock  # None with MPI_THREAD_MULTIPLE
        self._convert = convert or mpi_error  # an MPI.Exception as the tdist error to raise
        self._revoked = revoked

    # --------------------------------------------------------------- polling
    def _test(self, tries: int = 1) -> int:
        """Test the request up to ``tries`` times: _DONE (finished, by this call or
        before), _PENDING, or _OTHER (another thread saw it complete and is finishing it).

        The tries run back to back in one tight loop: with Open MPI each Test() moves
        the transfer on by a step, so the cost of an iteration bounds the bandwidth."""
        if self._done:
            return _DONE
        with self._test_lock:  # one thread tests a request at a time; released before finishing
            req = self._req
            if req is None:
                return _OTHER
            status = self._status
            lock = self._mpilock
            test = req.Test
            try:
                if lock is None and status is None:
                    for _ in range(tries):
                        if test():
                            break
                    else:
                        return _PENDING
                elif lock is None:
                    for _ in range(tries):
                        if test(status):
                            break
                    else:
                        return _PENDING
                else:
                    for _ in range(tries):
                        with lock:
                            flag = test(status) if status is not None else test()
                        if flag:
                            break
                    else:
                        return _PENDING
            except runtime().MPI.Exception as exc:  # evaluated only when Test() raised (MPI is loaded)
                self._req = None
                error: Optional[BaseException] = self._convert(self.op, exc)
            else:
                self._req = None
                error = None
        self._complete(error)
        return _DONE

    def _complete(self, error: Optional[BaseException]) -> None:
        self._keep = None
        if error is None and self._finalize is not None:
            try:
                self._finalize()
            except BaseException as exc:  # noqa: BLE001 - reported through wait()
                error = exc
            self._finalize = None
        if error is not None:
            _progress.run_callbacks(self.set_exception, error)
            return
        status = self._status
        _progress.run_callbacks(self.set_result, self._outputs, status.Get_source() if status is not None else -1)

    def _fail_if_revoked(self) -> bool:
        """Whether the work is done after failing it with MPI_ERR_REVOKED when its
        communicator was revoked and one more Test() leaves the request pending."""
        revoked = self._revoked
        if revoked is None or self._done or not revoked():
            return self._done
        state = self._test()
        if state != _PENDING:
            return state == _DONE
        if self._drop_request() is None:  # another thread saw it complete meanwhile
            return False
        MPI = runtime().MPI
        self._complete(self._convert(self.op, MPI.Exception(MPI.ERR_REVOKED)))
        return True

    def abandon(self, error: BaseException) -> None:
        """The group is being destroyed: cancel the request if it is still pending (MPI can
        cancel a receive; a collective runs on) and fail this Work with ``error``. The
        buffers MPI may still touch stay referenced for the life of the process."""
        req = self._drop_request()
        if req is None:
            return
        try:
            if self._mpilock is None:
                req.Cancel()
            else:
                with self._mpilock:
                    req.Cancel()
        except Exception:  # noqa: BLE001 - the request may have completed or be uncancellable
            pass
        self.set_exception(error)

    def _drop_request(self) -> Any:
        """Take the pending request from the polling (None: it completed or is being
        completed); it and the buffers MPI may still touch stay referenced for good."""
        with self._test_lock:
            req, self._req = self._req, None
        if req is None or self._done:
            return None
        _ABANDONED.append((req, self._keep, self._outputs))
        self._keep = self._finalize = None
        return req

    # ------------------------------------------------------- the Work template
    def _poll(self) -> bool:
        return self._test() == _DONE or self._fail_if_revoked()

    def _block(self, timeout: Optional[float]) -> bool:
        if self._done:
            return True
        test = self._test
        state = test()
        if state == _DONE:
            return True
        start = _monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            if state == _OTHER:
                return Work._block(self, None if deadline is None else max(0.0, deadline - _monotonic()))
            now = _monotonic()
            if deadline is not None and now >= deadline:
                return False
            waited = now - start
            if waited < SPIN_S:
                state = test(_SPIN_TRIES)
            elif waited < YIELD_S:
                _sleep(0)  # give the core away once per batch, keep testing (progress) in between
                state = test(_SPIN_TRIES)
            else:
                _sleep(NAP_S)
                state = test()
            if state == _DONE or (state == _PENDING and waited >= SPIN_S and self._fail_if_revoked()):
                return True

    def _watch(self) -> None:
        _progress.watch(self)

    def _expire(self, limit: float) -> bool:
        self.abandon(
            DistBackendTimeoutError(
                f"mpi backend: {self.op} did not complete within the group's timeout ({limit:g} s): "
                "a member has not taken part (MPI does not say which)"
            )
        )
        return self._done


class _Progress:
    """Polls works that have done-callbacks until they complete (one daemon thread).

    A done-callback may issue another operation and wait for its Future (torch runs a
    Future's ``then`` callbacks in the completing thread; DDP's PowerSGD hook
    all-reduces inside one): a work watched while the polling thread is in a callback
    starts a new polling thread, which takes the role over."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._works: list[MPIWork] = []
        self._thread: Optional[threading.Thread] = None
        self._in_callbacks: Optional[threading.Thread] = None  # the polling thread, while in done-callbacks
        self._stopping = False
        self._atexit = False

    def run_callbacks(self, complete: Callable[..., None], *args: Any) -> None:
        """``complete(*args)`` (a Work's set_result/set_exception, which runs its
        done-callbacks), noting when the polling thread is the one running them."""
        me = threading.current_thread()
        if self._thread is not me:
            complete(*args)
            return
        self._in_callbacks = me
        try:
            complete(*args)
        finally:
            with self._lock:
                if self._in_callbacks is me:
                    self._in_callbacks = None

    def watch(self, work: MPIWork) -> None:
        with self._lock:
            if self._stopping:
                return
            self._works.append(work)
            if self._thread is None or self._in_callbacks is self._thread:
                if not self._atexit:  # stop polling before mpi4py's MPI_Finalize at exit
                    import atexit

                    atexit.register(self.stop)
                    self._atexit = True
                self._thread = threading.Thread(target=self._run, name="tdist-mpi-progress", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        if thread is not None:
            thread.join(1.0)

    def _run(self) -> None:
        me = threading.current_thread()
        idle = 0
        while True:
            with self._lock:
                if self._thread is not me:
                    return  # a new polling thread took over while this one ran callbacks
                if self._stopping:
                    self._thread = None
                    return
                works = list(self._works)
            finished = [w for w in works if w.is_completed()]
            with self._lock:
                if finished:
                    gone = {id(w) for w in finished}
                    self._works = [w for w in self._works if id(w) not in gone]
                if not self._works and self._thread is me:
                    self._thread = None
                    return
            idle = 0 if finished else idle + 1
            _sleep(0 if idle < 1000 else NAP_S)


_progress = _Progress()
