"""``Work``: the handle of an operation that may still be running.

Backends create a :class:`Work`, return it at once and later call
:meth:`Work.set_result` or :meth:`Work.set_exception` from any thread.

A backend whose library has its own request objects (MPI, gloo, CUDA events)
subclasses :class:`Work` as a template and implements at most five hooks:

- :meth:`Work._poll`: without blocking, whether the operation has finished (completing
  the Work when it has);
- :meth:`Work._block`: block until it has finished or a timeout passes;
- :meth:`Work._watch`: a done-callback waits on a pending Work: make sure something
  notices completion (a poller thread) when nothing else would;
- :meth:`Work._expire`: the group's timeout passed in ``wait()``: give the operation up
  (fail the Work) or leave it pending;
- :meth:`Work._expedite`: someone waits for the pending Work through its future, not
  ``wait()``: start an operation that was left for its waiter to run.

``wait``, ``is_completed``, callbacks and futures are the base class's. A done-callback
(a work hook, a future) that raises is logged and ignored: it never reaches the
backend's thread that completed the Work, and the remaining callbacks still run.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

from ._failure import rank_failure
from ._futures import future_of
from ._errors import DistBackendError, DistBackendTimeoutError, DistError

__all__ = ["Work", "Timeout", "seconds"]

Timeout = Union[timedelta, float, int, None]

_log = logging.getLogger("tdist")

#: Guards the short state changes of every Work (publishing a result, adding a callback,
#: creating the Event): one lock for all of them keeps a Work as cheap as a plain object.
_STATE_LOCK = threading.Lock()


def seconds(timeout: Timeout, default: Optional[float] = None) -> Optional[float]:
    """Convert a ``timedelta`` or number of seconds to float seconds (``None`` passes ``default``)."""
    if timeout is None:
        return default
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return float(timeout)


class Work:
    """An asynchronous operation's handle, as ``isend``/``irecv``/``async_op=True`` return it.

    ``wait`` blocks until the operation is done and re-raises its error; a
    ``timeout`` that passes raises :class:`DistBackendTimeoutError`.
    ``is_completed`` is True once ``wait`` has returned.
    """

    __slots__ = ("op", "_done", "_event", "_result", "_exc", "_source_rank", "_callbacks", "default_timeout", "group")

    def __init__(self, op: str = "op", default_timeout: Optional[float] = None) -> None:
        self.op = op
        self.default_timeout = default_timeout
        self._done = False
        self._event: Optional[threading.Event] = None  # created only if someone blocks before completion
        self._result: Sequence[Any] = ()
        self._exc: Optional[BaseException] = None
        self._source_rank: int = -1
        self._callbacks: Optional[list[Callable[["Work"], None]]] = None
        #: the group it runs on (set when issued): a failure caused by another rank is agreed on it
        self.group: Any = None

    # ----------------------------------------------------------------- producers
    @classmethod
    def completed(cls, op: str, result: Sequence[Any] = (), source_rank: int = -1) -> "Work":
        """A Work that is already done (for operations that ran synchronously)."""
        work = Work(op)
        work.set_result(result, source_rank)
        return work

    def set_result(self, result: Sequence[Any] = (), source_rank: int = -1) -> None:
        """Mark the operation done with ``result`` (its output tensors); a receive also
        passes ``source_rank``, the sender's group rank. A Work completes exactly once:
        completing it again raises :class:`DistError`."""
        self._finish("set_result", result, source_rank, None)

    def set_exception(self, exc: BaseException) -> None:
        """Mark the operation failed with ``exc``; ``wait`` will raise it. Raises
        :class:`DistError` if the Work is already complete."""
        self._finish("set_exception", (), -1, exc)

    def _finish(self, how: str, result: Sequence[Any], source_rank: int, exc: Optional[BaseException]) -> None:
        with _STATE_LOCK:
            if self._done:
                state = f"failed with {type(self._exc).__name__}" if self._exc is not None else "succeeded"
                raise DistError(
                    f"{self.op}: {how}() on a Work that already {state}; a backend completes each Work exactly once"
                )
            self._result, self._source_rank, self._exc = result, source_rank, exc
            self._done = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, None
        if event is not None:
            event.set()
        if callbacks:
            for callback in callbacks:
                self._call(callback)

    def _call(self, callback: Callable[["Work"], None]) -> None:
        """Run one done-callback; its error is logged, never raised into the completing thread."""
        try:
            callback(self)
        except Exception:
            _log.exception("tdist: a done-callback of Work %r raised; ignored", self.op)

    def add_done_callback(self, callback: Callable[["Work"], None]) -> None:
        """Call ``callback(work)`` once the work is done (at once if it already is). An
        exception ``callback`` raises is logged and ignored."""
        with _STATE_LOCK:
            pending = not self._done
            if pending:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
        if pending:
            self._watch()
        else:
            self._call(callback)

    # ------------------------------------------------------------ template hooks
    def _poll(self) -> bool:
        """Without blocking: whether the operation has finished. A subclass over a library
        request checks it here and completes the Work when it has finished."""
        return self._done

    def _block(self, timeout: Optional[float]) -> bool:
        """Block until the operation has finished or ``timeout`` seconds (None: no limit)
        pass; return whether it finished. The default waits for ``set_result`` /
        ``set_exception``."""
        with _STATE_LOCK:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def _watch(self) -> None:
        """A done-callback now waits on this pending Work. A subclass that notices completion
        only when polled starts a poller here; the default does nothing (``set_result``
        runs the callbacks)."""

    def _expire(self, limit: float) -> bool:
        """``wait()`` (no timeout of its own) waited the group's timeout, ``limit`` seconds,
        in vain. A backend that gives the operation up here fails the Work
        (``set_exception``, e.g. a collective's timeout naming what it knows) and returns
        True; the default returns False: ``wait`` raises a local timeout and the operation
        stays pending."""
        return False

    def _expedite(self) -> None:
        """Someone waits for this pending Work without calling :meth:`wait` -- through its
        future (:meth:`get_future`; torch's DDP does, for every bucket) -- so no waiter will
        run it: a backend that leaves a queued operation for the thread that waits on it
        (to save a thread hand-off) starts it now. The default does nothing."""

    # ----------------------------------------------------------------- consumers
    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation completes; re-raise its error. Returns True."""
        if not self._done:
            limit = seconds(timeout, self.default_timeout)
            if not self._block(limit) and not (timeout is None and limit is not None and self._expire(limit)):
                late = DistBackendTimeoutError(f"{self.op}: did not complete within {limit:g} s (Work.wait timeout)")
                late.local_wait = True  # type: ignore[attr-defined]  # the operation goes on: not a rank failure
                raise late
        if self._exc is not None:
            if self.group is not None:
                error = rank_failure(self.group, self._exc, self.op)
                if error is not self._exc:
                    raise error
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._done or self._poll()

    def is_success(self) -> bool:
        """True if the operation finished without error."""
        return self.is_completed() and self._exc is None

    def exception(self) -> Optional[BaseException]:
        """The error the operation failed with, or None."""
        return self._exc if self.is_completed() else None

    def result(self) -> list[Any]:
        """The output tensors, once complete (waits)."""
        self.wait()
        return list(self._result)

    def source_rank(self) -> int:
        """For a ``recv``/``irecv``: the group rank the message came from (waits)."""
        self.wait()
        if self._source_rank < 0:
            raise DistBackendError(
                f"{self.op}: source_rank() is only defined for receives: this Work completed without a source "
                "rank (a backend completes a receive with set_result(outputs, source_rank=<sender's group rank>))"
            )
        return self._source_rank

    def synchronize(self) -> None:
        """Wait for completion (CPU backends have no streams to synchronise)."""
        self.wait()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with :meth:`result` (or the error)."""
        return future_of(self, lambda: list(self._result))

    def __repr__(self) -> str:
        state = "pending" if not self.is_completed() else ("failed" if self._exc else "done")
        return f"<Work {self.op} {state}>"
