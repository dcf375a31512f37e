"""``NcclWork``: a tdist Work that completes on CUDA events.

- ``is_completed()`` queries the events (never blocks);
- ``wait()`` (no timeout) does what torch's NCCL ``Work.wait()`` does: it makes the
  *current stream* of each device wait for the operation and returns without
  blocking the host (host-blocking for ``barrier``);
- ``wait(timeout)`` blocks the host, polling the events until the deadline, then
  raises :class:`tdist.DistBackendTimeoutError`;
- ``synchronize()`` blocks the host until the GPU has finished the operation.

A point-to-point Work may not be issued yet (the backend batches sends and
receives, see :mod:`.backend`): every method above first asks the backend to
issue what is pending. Done-callbacks (``get_future``, work hooks) are run by a
daemon thread that waits for the events.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

from tdist.plugin import DistBackendError, Work, backend_error

from .cuda import CudaEvent

__all__ = ["NcclWork"]

_POLL_MIN = 1e-4
_POLL_MAX = 1e-2
_WATCH_LOCK = threading.Lock()  # guards starting the watcher thread of a NcclWork


class NcclWork(Work):
    """One NCCL operation (or group of them) queued on one or more CUDA streams."""

    __slots__ = ("_blocking", "_cuda_events", "_flush", "_issued", "_watcher")

    def __init__(
        self,
        op: str,
        result: Sequence[Any] = (),
        *,
        source_rank: int = -1,
        blocking: bool = False,
        flush: Optional[Callable[[], None]] = None,
        events: Optional[Sequence[CudaEvent]] = None,
    ) -> None:
        super().__init__(op)
        self._result = list(result)
        self._source_rank = source_rank
        self._cuda_events: list[CudaEvent] = []
        self._issued = threading.Event()
        self._blocking = blocking
        self._flush = flush
        self._watcher: Optional[threading.Thread] = None
        if events is not None:
            self.attach(events)

    # ------------------------------------------------------------------ backend side
    def attach(self, events: Sequence[CudaEvent]) -> None:
        """The operation has been queued; ``events`` complete with it."""
        self._cuda_events = list(events)
        self._issued.set()

    def fail(self, exc: BaseException) -> None:
        """The operation could not be issued."""
        self._issued.set()
        if not self._done:
            self.set_exception(exc)

    @property
    def issued(self) -> bool:
        return self._issued.is_set()

    # ------------------------------------------------------------------ helpers
    def _issue(self) -> None:
        if not self._issued.is_set() and self._flush is not None:
            self._flush()
        if not self._issued.is_set():
            raise DistBackendError(f"nccl {self.op}: the operation was never issued")

    def _gpu_done(self) -> bool:
        return all(event.query() for event in self._cuda_events)

    def _mark_done(self) -> None:
        if not self._done:
            Work.set_result(self, self._result, self._source_rank)

    def _raise_if_failed(self) -> None:
        if self._exc is not None:
            raise self._exc

    # ------------------------------------------------------- the Work template
    def _poll(self) -> bool:
        """True once the GPU has finished (or the operation failed); never blocks."""
        try:
            self._issue()
        except BaseException as exc:
            self.fail(exc)
            return True
        if self._exc is None and self._gpu_done():
            self._mark_done()
        return self._done

    def _block(self, timeout: Optional[float]) -> bool:
        """Without ``timeout``: order the current stream(s) after the operation (host-blocking
        for ``barrier``) and return; with one, block the host until the GPU has finished.
        Raises an issue error."""
        self._issue()
        if self._exc is not None:
            return True
        if timeout is None:
            if self._blocking:
                self.synchronize()
                return True
            for event in self._cuda_events:
                event.block_current_stream()
            if self._gpu_done():
                self._mark_done()
            return True
        deadline = time.monotonic() + timeout
        pause = _POLL_MIN
        while not self._gpu_done():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _POLL_MAX)
        self._mark_done()
        return True

    def _watch(self) -> None:
        """A done-callback waits: a daemon thread waits for the events (started once)."""
        with _WATCH_LOCK:
            if self._done or self._watcher is not None:
                return
            self._watcher = threading.Thread(target=self._wait_for_events, name=f"tdist-nccl-{self.op}", daemon=True)
        self._watcher.start()

    # ------------------------------------------------------------------ consumers
    def synchronize(self) -> None:
        """Block the host until the GPU has finished the operation."""
        self._issue()
        self._raise_if_failed()
        for event in self._cuda_events:
            event.synchronize()
        self._mark_done()

    def _wait_for_events(self) -> None:
        self._issued.wait()
        if self._done:
            return
        try:
            for event in self._cuda_events:
                event.synchronize()
        except BaseException as exc:  # pragma: no cover - CUDA errors surface here
            self.fail(backend_error("nccl", self.op, exc))
            return
        self._mark_done()
