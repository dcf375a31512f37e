"""The ``torch.futures.Future`` of a tdist Work (``Work.get_future`` and the bridge's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ._failure import rank_failure

if TYPE_CHECKING:  # typing only: _work imports this module
    from ._work import Work

__all__ = ["future_of"]


def future_of(work: Work, outputs: Callable[[], list[Any]]) -> Any:
    """A ``torch.futures.Future`` completed with ``outputs()`` once ``work`` succeeds, or
    failed with its error. As torch's, its ``then`` callbacks run in the thread that
    completes ``work`` (a backend's thread, or the caller's when ``work`` is already done).

    The error is one torch's C++ sees too: ``Future.set_exception`` only stores the
    exception as the future's *value* (Python's ``wait`` raises it, but C++ consumers --
    DDP's built-in all-reduce hook -- take it for a result and crash), while an error
    raised in a ``then`` callback fails the future in C++. So the future returned is
    such a callback's; its error is a RuntimeError naming the Work's error (as with
    torch's own backends, whose futures fail with RuntimeErrors). A failure caused by
    other ranks is agreed on first (:func:`tdist._failure.rank_failure`), so that
    :func:`tdist.failed_ranks` knows the verdict when torch's DDP raises."""
    import torch

    signal: Any = torch.futures.Future()

    def _result(_: Any) -> list[Any]:
        error = work.exception()
        if error is not None:
            raise error if work.group is None else rank_failure(work.group, error, work.op)
        return outputs()

    future = signal.then(_result)
    work.add_done_callback(lambda _done: signal.set_result(None))
    if not work.is_completed():
        work._expedite()  # nobody may ever call its wait(): start it if it waits for a waiter
    return future
