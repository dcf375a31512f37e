"""The ``torch.futures.Future`` of a tdist Work (``Work.get_future`` and the bridge's)."""

from __future__ import annotations

from typing import Any, Callable

from ._work import Work

__all__ = ["future_of"]


def future_of(work: Work, outputs: Callable[[], list[Any]]) -> Any:
    """A ``torch.futures.Future`` completed with ``outputs()`` once ``work`` succeeds, or
    with its error. As torch's, its ``then`` callbacks run in the thread that completes
    ``work`` (a backend's thread, or the caller's when ``work`` is already done)."""
    import torch

    future: Any = torch.futures.Future()

    def _resolve(done: Work) -> None:
        error = done.exception()
        if error is None:
            future.set_result(outputs())
        else:
            future.set_exception(error)

    work.add_done_callback(_resolve)
    return future
