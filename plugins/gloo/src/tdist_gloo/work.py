"""Errors and Work of the gloo backend: a tdist :class:`~tdist.Work` over a torch gloo ``Work``."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence

from tdist.plugin import DistBackendError, Work, backend_error

from . import BACKEND_NAME

__all__ = ["GlooWork", "map_error"]


#: Words of gloo's messages when a peer's connection went away (it died or left).
_PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe")


def map_error(exc: BaseException, operation: str) -> BaseException:
    """A tdist error for what gloo/torch raised during ``operation`` (timeouts become
    :class:`DistBackendTimeoutError`); tdist errors pass unchanged. A lost connection to a
    peer is marked as that peer's failure (``failed_peer`` -1: gloo names its address only)."""
    error = backend_error(BACKEND_NAME, operation, exc)
    if isinstance(error, DistBackendError) and error is not exc and error.failed_peer is None:
        if any(words in str(exc).lower() for words in _PEER_GONE):
            error.failed_peer = -1
    return error


# --------------------------------------------------------------------- work
_WATCH_LOCK = threading.Lock()  # guards starting the helper thread of a GlooWork


class GlooWork(Work):
    """A tdist :class:`~tdist.Work` over a torch gloo ``Work``.

    The torch work is waited on exactly once (by ``wait()`` or a helper thread);
    then the optional ``post`` step (copy-back or final arithmetic of an emulated
    operation) runs and the error, if any, is mapped to a tdist error.
    ``wait(timeout)`` does not hand the timeout to gloo (gloo would abort the
    operation and close its connections): it waits for the helper thread instead,
    and the operation goes on after a timed-out wait.
    """

    __slots__ = ("_work", "_post", "_anysource", "_pollable", "_wait_lock", "_watcher", "_owner")

    def __init__(
        self,
        work: Any,
        op: str,
        result: Sequence[Any] = (),
        post: Optional[Callable[[], None]] = None,
        source: int = -1,
        anysource: bool = False,
        pollable: bool = True,
        owner: Any = None,
    ) -> None:
        super().__init__(op)
        self._owner = owner
        self._work = work
        self._result = result
        self._post = post
        self._source_rank = source
        self._anysource = anysource
        self._pollable = pollable
        self._wait_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None

    @classmethod
    def done(cls, op: str, result: Sequence[Any] = ()) -> "GlooWork":
        """A work that completed without communicating (e.g. nothing to send)."""
        work = cls(None, op)
        work.set_result(result)
        return work

    # ------------------------------------------------------------ completion
    def _complete(self) -> None:
        """Block until gloo finished; post-process once; complete the Work."""
        with self._wait_lock:
            if self._done:
                return
            error: Optional[BaseException] = None
            try:
                self._work.wait()
            except Exception as exc:  # noqa: BLE001 - re-raised by wait()
                # (an interrupt, KeyboardInterrupt, goes up as it is: the operation runs on in
                # gloo's threads, and the group stays usable; this Work stays pending)
                error = map_error(exc, self.op)
                self._work = None  # it holds the group's connections open
                if self._owner is not None:
                    self._owner._broken(exc)
            else:
                try:
                    if self._anysource:
                        self._source_rank = int(self._work._source_rank())
                    if self._post is not None:
                        self._post()
                except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                    error = map_error(exc, self.op)
            if error is None:
                self.set_result(self._result, self._source_rank)
            else:
                self.set_exception(error)

    # ------------------------------------------------------- the Work template
    def _poll(self) -> bool:
        work = self._work  # None once a failure released it (then _done follows at once)
        if self._pollable and work is not None and work.is_completed():
            self._complete()
            return True
        # Some gloo works (send/recv, reduce_scatter) only learn of completion inside wait(),
        # and any work may need post-processing: a helper thread waits (started once).
        self._watch()
        return self._done

    def _block(self, timeout: Optional[float]) -> bool:
        if timeout is None:
            self._complete()
            return True
        self._watch()
        return Work._block(self, max(float(timeout), 0.0))

    def _watch(self) -> None:
        """Make sure a helper thread is waiting for completion."""
        with _WATCH_LOCK:
            if self._watcher is None and not self._done:
                self._watcher = threading.Thread(target=self._complete, name=f"tdist-gloo-{self.op}", daemon=True)
                self._watcher.start()
