"""``Work``: the handle of an operation that may still be running.

Backends create a :class:`Work`, return it at once and later call
:meth:`Work.set_result` or :meth:`Work.set_exception` from any thread. A backend
whose library has its own request objects (MPI, gloo) subclasses :class:`Work`
and overrides :meth:`_wait_impl` / :meth:`is_completed`.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, Union

from ._errors import DistBackendError, DistBackendTimeoutError, DistError

__all__ = ["Work", "Timeout", "seconds"]

Timeout = Union[timedelta, float, int, None]


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

    __slots__ = ("op", "_done", "_event", "_result", "_exc", "_source_rank", "_callbacks", "_lock", "default_timeout")

    def __init__(self, op: str = "op", default_timeout: Optional[float] = None) -> None:
        self.op = op
        self.default_timeout = default_timeout
        self._done = False
        self._event: Optional[threading.Event] = None  # created only if someone blocks before completion
        self._result: Sequence[Any] = ()
        self._exc: Optional[BaseException] = None
        self._source_rank: int = -1
        self._callbacks: list[Callable[["Work"], None]] = []
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- producers
    @classmethod
    def completed(cls, op: str, result: Sequence[Any] = (), source_rank: int = -1) -> "Work":
        """A Work that is already done (for operations that ran synchronously)."""
        work = cls(op)
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
        with self._lock:
            if self._done:
                state = f"failed with {type(self._exc).__name__}" if self._exc is not None else "succeeded"
                raise DistError(f"{self.op}: {how}() on a Work that already {state}; a backend completes "
                                "each Work exactly once")
            self._result, self._source_rank, self._exc = result, source_rank, exc
            self._done = True
            if self._event is not None:
                self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback(self)

    def add_done_callback(self, callback: Callable[["Work"], None]) -> None:
        """Call ``callback(work)`` once the work is done (at once if it already is)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback(self)

    # ----------------------------------------------------------------- consumers
    def _wait_impl(self, timeout: Optional[float]) -> bool:
        """Block until done or ``timeout`` seconds pass; return whether it is done."""
        if self._done:
            return True
        with self._lock:
            if self._done:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def wait(self, timeout: Timeout = None) -> bool:
        """Block until the operation completes; re-raise its error. Returns True."""
        limit = seconds(timeout, self.default_timeout)
        if not self._wait_impl(limit):
            raise DistBackendTimeoutError(f"{self.op}: did not complete within {limit:g} s (Work.wait timeout)")
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        """True once the operation has finished, successfully or not."""
        return self._done

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
                f"{self.op}: this Work completed without a source rank. Only receives have one, and a "
                "backend must complete a receive with set_result(outputs, source_rank=<sender's group rank>)"
            )
        return self._source_rank

    def synchronize(self) -> None:
        """Wait for completion (CPU backends have no streams to synchronise)."""
        self.wait()

    def get_future(self) -> Any:
        """A ``torch.futures.Future`` completed with :meth:`result` (or the error)."""
        import torch

        future: Any = torch.futures.Future()

        def _resolve(work: "Work") -> None:
            if work._exc is not None:
                future.set_exception(work._exc)
            else:
                future.set_result(list(work._result))

        self.add_done_callback(_resolve)
        return future

    def __repr__(self) -> str:
        state = "pending" if not self.is_completed() else ("failed" if self._exc else "done")
        return f"<Work {self.op} {state}>"

