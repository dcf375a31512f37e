"""Telling the work hooks about operations: the one place the core fires them.

:func:`describe` builds the :class:`WorkInfo` of an operation; :func:`issued` fires
``tdist_work_issued``; :func:`completed` fires ``tdist_work_completed`` (a blocking call
that returned); :func:`watch` fires either completion hook once an asynchronous Work is
done; :func:`run_observed` fires them around an operation the core runs itself; :func:`failed` reports an operation that failed outside its Work (the backend
raised while issuing it, or a blocking wait timed out); :func:`rejected` wraps a public
operation so that an error raised before the operation was issued (bad arguments)
reaches ``tdist_work_failed`` too. With no plugin observing work, none of this costs
more than one attribute test.
"""

from __future__ import annotations

import functools
import inspect
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeVar

from ._plugins import WorkInfo, plugins

if TYPE_CHECKING:
    import torch

    from ._groups import ProcessGroup
    from ._work import Work

__all__ = ["describe", "issued", "completed", "run_observed", "watch", "failed", "rejected"]

_F = TypeVar("_F", bound=Callable[..., Any])
#: Set on an error the hooks have seen, so that :func:`rejected` does not report it again.
_SEEN = "_tdist_observed"


def describe(
    pg: "ProcessGroup",
    operation: str,
    seq: int,
    tensors: Sequence["torch.Tensor"],
    reduction: Any = None,
    root: Optional[int] = None,
    peer: Optional[int] = None,
    tag: Optional[int] = None,
) -> WorkInfo:
    """The WorkInfo of ``operation`` on ``pg``; ``root`` and ``peer`` are group ranks."""
    ranks = pg.ranks_tuple
    if len(tensors) == 1:  # the common case, without the generators' cost
        tensor = tensors[0]
        shapes, dtype, nbytes = [tensor.shape], _dtype_name(tensor.dtype), tensor.nbytes
    else:
        shapes = [t.shape for t in tensors]
        dtype, nbytes = _dtype_name(tensors[0].dtype) if tensors else "", sum(t.nbytes for t in tensors)
    return WorkInfo(
        operation,
        pg.name,
        seq,
        shapes,
        dtype,
        nbytes,
        pg.backend_name,
        time.perf_counter(),
        ranks[pg.rank],
        ranks,
        None if reduction is None else reduction.op.name,
        None if root is None else ranks[root],
        None if peer is None else ranks[peer],
        tag,
        time.time(),
    )


_DTYPE_NAMES: dict = {}


def _dtype_name(dtype: Any) -> str:
    """``str(dtype)`` ("torch.float32"), remembered."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _mark(error: BaseException) -> None:
    try:
        setattr(error, _SEEN, True)
    except AttributeError:  # an exception type with __slots__: it may be reported twice
        pass


def failed(info: WorkInfo, error: BaseException) -> None:
    """Report ``error`` for the operation ``info`` describes (once per error)."""
    if getattr(error, _SEEN, False):
        return
    _mark(error)
    plugins().work_failed(info, error, time.perf_counter() - info.issued_at)


def issued(info: WorkInfo) -> None:
    """Fire ``tdist_work_issued`` (before the backend is called)."""
    plugins().work_issued(info)


def completed(info: WorkInfo) -> None:
    """Fire ``tdist_work_completed`` for an operation that has just succeeded."""
    plugins().work_completed(info, time.perf_counter() - info.issued_at)


def run_observed(pg: "ProcessGroup", operation: str, seq: int, run: Callable[[], None]) -> None:
    """Run ``operation``, which the core performs itself (no backend, no tensors: e.g.
    ``monitored_barrier`` through the store), firing the work hooks around it."""
    if not plugins().observes_work:
        run()
        return
    info = describe(pg, operation, seq, ())
    issued(info)
    try:
        run()
    except Exception as error:
        failed(info, error)
        raise
    completed(info)


def watch(work: "Work", info: WorkInfo) -> None:
    """Fire the completion hook (or the failure one) when ``work`` is done."""
    hooks = plugins()

    def _done(done: "Work") -> None:
        error = done.exception()
        if error is None:
            hooks.work_completed(info, time.perf_counter() - info.issued_at)
        else:
            failed(info, error)

    work.add_done_callback(_done)


def _rejected_info(operation: str, kwargs: dict) -> WorkInfo:
    """What is known of an operation refused before it was issued (no seq, no tensors)."""
    from ._groups import STATE, ProcessGroup

    world = STATE.world
    pg = kwargs.get("group")
    pg = getattr(pg, "tdist_group", pg)
    if not isinstance(pg, ProcessGroup):
        pg = world
    if pg is None:
        return WorkInfo(op=operation, group="", seq=0, shapes=[], dtype="", nbytes=0, backend="")
    return WorkInfo(
        op=operation,
        group=pg.name,
        seq=0,
        shapes=[],
        dtype="",
        nbytes=0,
        backend=pg.backend_name,
        rank=pg.ranks[pg.rank],
        group_ranks=tuple(pg.ranks),
    )


def rejected(operation: str) -> Callable[[_F], _F]:
    """Decorate the public function of ``operation``: an error it raises that the hooks
    have not seen (argument checks, before any communication) reaches ``tdist_work_failed``.

    The wrapper has the function's own parameters (it is on every call's path, and
    ``*args, **kwargs`` forwarding costs as much as a third of the core's own work)."""

    def decorate(function: _F) -> _F:
        def report(error: Exception, group: Any) -> None:
            if plugins().observes_work and not getattr(error, _SEEN, False):
                _mark(error)
                plugins().work_failed(_rejected_info(operation, {"group": group}), error, 0.0)

        return functools.wraps(function)(_forwarding(function, report))  # type: ignore[return-value]

    return decorate


def _forwarding(function: Callable[..., Any], report: Callable[[Exception, Any], None]) -> Callable[..., Any]:
    """``function`` behind a wrapper of the same parameters and defaults that calls
    ``report(error, group)`` for an exception it raises, then lets the exception go on."""
    params, args = [], []
    namespace: dict[str, Any] = {"_function": function, "_report": report}
    keyword_only = False
    parameters = inspect.signature(function).parameters
    for p in parameters.values():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            raise TypeError(f"rejected: {function.__name__} has a parameter {p.name} of kind {p.kind}")
        if p.kind is p.KEYWORD_ONLY and not keyword_only:
            params.append("*")
            keyword_only = True
        default = ""
        if p.default is not p.empty:
            namespace[f"_default_{p.name}"] = p.default
            default = f"=_default_{p.name}"
        params.append(p.name + default)
        args.append(f"{p.name}={p.name}" if keyword_only else p.name)
    group = "group" if "group" in parameters else "None"
    source = (
        f"def {function.__name__}({', '.join(params)}):\n"
        f"    try:\n"
        f"        return _function({', '.join(args)})\n"
        f"    except Exception as error:\n"
        f"        _report(error, {group})\n"
        f"        raise\n"
    )
    exec(source, namespace)  # noqa: S102  (the source is built above from the signature alone)
    return namespace[function.__name__]
