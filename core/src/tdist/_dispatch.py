"""Issuing an operation: pick the backend, stage non-contiguous tensors, notify the
work hooks, and wait unless the caller asked for ``async_op``."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ._backend import Backend
from ._errors import DistBackendError, DistBackendTimeoutError, DistError
from ._failure import known_failure, rank_failure
from ._groups import ProcessGroup
from ._mismatch import check_collective
from ._observe import completed, describe, failed, issued, watch
from ._plugins import plugins
from ._work import Timeout, Work, seconds

if TYPE_CHECKING:
    import torch

__all__ = ["issue", "contiguous_view", "device_of", "device_type", "POINT_TO_POINT"]

#: The operations numbered by the group's point-to-point counter (the others are collectives).
POINT_TO_POINT = frozenset({"send", "recv"})


def device_type(tensor: "torch.Tensor") -> str:
    """``tensor.device.type``, without building a device object for CPU tensors."""
    return "cpu" if tensor.is_cpu else tensor.device.type


def device_of(tensors: Sequence["torch.Tensor"], operation: str) -> str:
    """The device type shared by ``tensors``; an error if they are on different kinds."""
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{operation}: tensors must all be on one device type, got {sorted(devices)}")
    return devices.pop()


class StagedWork(Work):
    """Wraps a backend's Work; when it completes, copies staged outputs back into
    the caller's non-contiguous tensors, then completes itself (before ``wait`` returns)."""

    __slots__ = ("_inner", "_copies", "_adopt_lock", "_watching")

    def __init__(self, inner: Work, copies: list[tuple["torch.Tensor", "torch.Tensor"]]) -> None:
        super().__init__(inner.op, inner.default_timeout)
        self._inner = inner
        self._copies = copies
        self._adopt_lock = threading.Lock()
        self._watching = False

    def _adopt(self, inner: Work) -> None:
        """The inner Work is done: copy back (on success) and complete with its outcome, once."""
        with self._adopt_lock:
            if self._done:
                return
            error = inner._exc
            if error is None:
                try:
                    for target, staged in self._copies:
                        target.copy_(staged)
                except Exception as exc:
                    error = exc
            if error is None:
                self.set_result(inner._result, inner._source_rank)
            else:
                self.set_exception(error)

    def _poll(self) -> bool:
        if self._inner.is_completed():
            self._adopt(self._inner)
            return True
        return False

    def _block(self, timeout: Optional[float]) -> bool:
        try:
            self._inner.wait(timeout)
        except Exception as exc:
            if not self._inner.is_completed():
                if isinstance(exc, DistBackendTimeoutError):
                    return False  # the inner wait timed out
                raise
        self._adopt(self._inner)
        return True

    def _expedite(self) -> None:
        self._inner._expedite()

    def _watch(self) -> None:
        with self._adopt_lock:
            if self._watching:
                return
            self._watching = True
        self._inner.add_done_callback(self._adopt)


def contiguous_view(tensor: "torch.Tensor", copies: Optional[list], output: bool) -> "torch.Tensor":
    """``tensor`` itself when contiguous, else a contiguous copy; for an output
    tensor the copy is recorded in ``copies`` to be written back on completion."""
    if tensor.is_contiguous():
        return tensor
    staged = tensor.contiguous()
    if output and copies is not None:
        copies.append((tensor, staged))
    return staged


#: The groups inside ``_coalescing_manager`` (:mod:`tdist._torch_names`), each with the
#: Works issued on it there: they run at once, asynchronously, and the manager waits.
coalescing: dict[ProcessGroup, list[Work]] = {}


def issue(
    pg: ProcessGroup,
    operation: str,
    device: str,
    call: Callable[[Backend], Work],
    async_op: bool,
    copies: Sequence[tuple["torch.Tensor", "torch.Tensor"]] = (),
    tensors: Sequence["torch.Tensor"] = (),
    reduction: Any = None,
    root: Optional[int] = None,
    peer: Optional[int] = None,
    tag: Optional[int] = None,
    wait_timeout: Timeout = None,
) -> Optional[Work]:
    """Run ``call(backend)`` on ``pg``'s backend for ``device``; wait unless ``async_op``.

    ``copies`` are (caller tensor, staged tensor) pairs written back on completion;
    ``wait_timeout`` bounds a blocking call's wait instead of the Work's default.
    ``tensors``, ``reduction``, ``root``/``peer`` (group ranks) and ``tag`` describe the
    operation to the work hooks (ignored when none observe).
    """
    collect = coalescing.pop(pg, None) if coalescing else None
    if collect is not None:  # inside _coalescing_manager: issue asynchronously, the manager waits
        try:
            work = issue(pg, operation, device, call, True, copies, tensors, reduction, root, peer, tag)
        finally:
            coalescing[pg] = collect
        assert work is not None
        collect.append(work)
        return work if async_op else None
    backend = pg.backend_for(device, operation)
    p2p = operation in POINT_TO_POINT
    if pg.check_collectives and not p2p:
        check_collective(pg, backend, operation, device, tensors, reduction, root)
    if pg.agreement is not None:  # a failure was agreed on: raise it, nothing goes out
        failure = known_failure(pg)
        if failure is not None:
            raise failure
    seq = pg.next_p2p_seq() if p2p else pg.next_seq()
    if not plugins().observes_work:
        if async_op:
            return _start(pg, operation, call, backend, copies)
        _run_blocking(pg, operation, backend, call, wait_timeout)
        if copies:
            _copy_back(copies)
        return None
    info = describe(pg, operation, seq, tensors, reduction, root, peer, tag)
    issued(info)
    try:
        if async_op:
            work = _start(pg, operation, call, backend, copies)
            watch(work, info)
            return work
        _run_blocking(pg, operation, backend, call, wait_timeout)
        _copy_back(copies)
    except Exception as error:  # raised while issuing, failed, or a blocking wait that timed out
        failed(info, error)
        raise
    completed(info)
    return None


def _run_blocking(
    pg: ProcessGroup, operation: str, backend: Backend, call: Callable[[Backend], Work], wait_timeout: Timeout
) -> None:
    """Run a blocking operation; a failure caused by other ranks becomes the members' agreed
    :class:`~tdist._failure.DistRankFailureError` (a caller's own ``wait_timeout`` does not)."""
    try:
        backend.run_blocking(call, None if wait_timeout is None else seconds(wait_timeout))
    except DistBackendError as exc:
        error = exc if wait_timeout is not None else rank_failure(pg, exc, operation)
        if error is exc:
            raise
        raise error from exc


def _copy_back(copies: Sequence[tuple["torch.Tensor", "torch.Tensor"]]) -> None:
    """Write staged outputs back into the caller's tensors (a blocking call's are done)."""
    for target, staged in copies:
        target.copy_(staged)


def _start(
    pg: ProcessGroup,
    operation: str,
    call: Callable[[Backend], Work],
    backend: Backend,
    copies: Sequence[tuple["torch.Tensor", "torch.Tensor"]],
) -> Work:
    """Call the backend; its Work (wrapped to copy staged outputs back when needed)."""
    work = call(backend)
    if not isinstance(work, Work):
        raise DistError(f"{operation}: backend {pg.backend_name!r} returned {type(work).__name__}, not a tdist.Work")
    if copies:
        work = StagedWork(work, list(copies))
    work.group = pg
    return work
