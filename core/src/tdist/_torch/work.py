"""``BridgeWork``: a tdist :class:`~tdist.Work` as torch.distributed's ``Work``.

torch's Python code calls the methods below directly; torch's C++ callers (the DDP
reducer, functional collectives) reach ``wait`` and ``get_future`` through pybind's
trampoline. Errors are tdist's (every one a ``RuntimeError``, as torch's are).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Optional, Sequence

import torch
import torch.distributed as torch_dist

from .._futures import future_of
from .._work import Work

__all__ = ["BridgeWork", "all_of"]


class BridgeWork(torch_dist._Work):
    """torch's view of the tdist ``work`` whose results are ``outputs`` (what torch's
    backends put in ``result()`` and the future: the output tensors of the operation)."""

    def __init__(self, work: Work, outputs: Sequence[Any]) -> None:
        super().__init__()
        self.tdist_work = work
        self._outputs = outputs

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        # torch's C++ passes timedelta(0) for "no timeout"; its Python default is None.
        self.tdist_work.wait(timeout if timeout else None)
        return True

    def is_completed(self) -> bool:
        return self.tdist_work.is_completed()

    def is_success(self) -> bool:
        return self.tdist_work.is_success()

    def exception(self) -> Optional[BaseException]:
        return self.tdist_work.exception()

    def source_rank(self) -> int:
        """The group rank a ``recv`` received from."""
        return self.tdist_work.source_rank()

    _source_rank = source_rank

    def result(self) -> list[Any]:
        self.wait()
        return list(self._outputs)

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A future completed with the output tensors (or the error) once the work is done."""
        outputs = self._outputs
        return future_of(self.tdist_work, lambda: list(outputs))

    def __repr__(self) -> str:
        return f"<BridgeWork {self.tdist_work!r}>"


class _AllOf(Work):
    """A Work that completes when its ``parts`` all have (see :func:`all_of`)."""

    __slots__ = ("parts",)

    def __init__(self, op: str, parts: Sequence[Work]) -> None:
        super().__init__(op)
        self.parts = list(parts)

    def _expedite(self) -> None:
        for part in self.parts:
            part._expedite()


def all_of(works: Sequence[Work], op: str) -> Work:
    """One tdist Work that completes when every one of ``works`` has (with the first error)."""
    combined = _AllOf(op, works)
    if not works:
        combined.set_result(())
        return combined
    remaining = [len(works)]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def _one_done(done: Work) -> None:
        error = done.exception()
        with lock:
            if error is not None:
                errors.append(error)
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            if errors:
                combined.set_exception(errors[0])
            else:
                combined.set_result(())

    for work in works:
        work.add_done_callback(_one_done)
    return combined
