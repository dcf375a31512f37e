"""A tdist backend as torchft's reconfigurable process group.

torchft (``pip install torchft``) makes training fault tolerant per step: a lighthouse
computes a quorum of the live replica groups, and on every change of quorum torchft's
``Manager`` calls ``pg.configure(store_addr, replica_id, rank, world_size, ...)`` on its
process group, which must tear the previous communicator down and build a new one through
the store at ``store_addr`` (``host:port/prefix``, a fresh prefix each time).
:class:`ProcessGroupTdist` is that process group over a tdist backend (tdist-tcp by
default; ``backend="gloo"`` or any installed one whose groups are built through the store:
not ``"mpi"``, whose ranks must share one ``mpirun``)::

    from torchft import DistributedDataParallel, Manager, Optimizer
    from tdist.integrations.torchft import ProcessGroupTdist

    pg = ProcessGroupTdist(timeout=timedelta(seconds=5))      # was: ProcessGroupGloo(...)
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=..., state_dict=..., ...)
    model = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, optim.AdamW(model.parameters()))

Each ``configure`` aborts the current group (:meth:`ProcessGroupTdist.abort`: the
backend's ``shutdown``, which fails its pending operations, run in the background so that
the new group does not wait for it), connects to the
store torchft names, and builds a new tdist group of ``world_size`` ranks under that
store's prefix (the join, then the backend's factory, as ``tdist.new_group`` does). torchft
calls the group through torch's ``ProcessGroup`` API; the group it gets is tdist's torch
bridge for that tdist group (``TorchProcessGroup``), so torchft's collectives and
send/recv run on the tdist backend. The group is not tdist's default group and is not
registered with tdist's or torch.distributed's state (no ``init_process_group`` needed).

Errors follow torchft's contract for asynchronous errors (the one its NCCL groups keep):
an operation that fails -- a peer died (tcp notices at once when the peer's connections
close), or the timeout passed -- does not raise from its ``Work``: ``wait()`` returns,
the future completes with the tensors as they are, and :meth:`errored` returns
the failure until the next ``configure``; torchft's ``Manager`` reads it before it commits
the step, so the step is dropped and the next quorum rebuilds the group. The same holds
for an operation that cannot start (a backend error, or no group since an abort): it
gives a failed ``Work`` instead of raising, as torchft 0.2's ``DistributedDataParallel``
survives no raising operation (its comm hook fails an assertion on it; torchft's
``ProcessGroupGloo`` raises from ``wait()`` when a peer dies, so a survivor of a
mid-step kill crashes there). Only argument errors (``ValueError``, ``TypeError``) raise.
An abort counts as an error too. Waiting for a failed operation does not run tdist's
failure agreement (torchft agrees through its quorum).

This module imports torchft; ``import tdist`` does not import it.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, Optional

try:
    from torchft.process_group import ProcessGroupWrapper
except ImportError as exc:  # pragma: no cover - exercised where torchft is missing
    raise ImportError(
        f"tdist.integrations.torchft needs torchft ({exc}); install it with: pip install torchft"
    ) from exc

from .._errors import DistBackendTimeoutError, DistError
from .._groups import ProcessGroup
from .._init import _build_group, _parse_backend, get_backend_spec
from .._join import join
from .._store.torch_adapters import from_torch_store
from .._torch.registry import mirror
from .._torch.work import BridgeWork
from .._work import Work

__all__ = ["ProcessGroupTdist"]

_log = logging.getLogger(__name__)


class ProcessGroupTdist(ProcessGroupWrapper):
    """torchft's reconfigurable process group over the tdist backend ``backend`` (a name,
    or a per-device map such as ``"cpu:tcp,cuda:nccl"``). ``timeout`` bounds the store
    connection, the group's creation and every operation (torchft's ``set_timeout``
    changes it, for the current group too). ``pg_options`` are the backend's options,
    passed to its factory on every ``configure``."""

    _pg: Any  # torchft's: the current group as torch's ProcessGroup, None when there is none

    def __init__(
        self,
        backend: str = "tcp",
        timeout: timedelta = timedelta(seconds=60),
        pg_options: Optional[dict[str, Any]] = None,
    ) -> None:
        super().__init__(timeout=timeout)
        display, devices = _parse_backend(backend)  # a backend that is not installed fails here, not mid-training
        for name in sorted(set(devices.values())):
            _check_rebuildable(name)
        self._backend = display
        self._devices = devices
        self._options = dict(pg_options or {})
        self._tdist_group: Optional[ProcessGroup] = None
        self._errored: Optional[Exception] = None
        self._generation = 0  # configures so far: errors of an older group's work are not this one's

    @property
    def backend(self) -> str:
        """The tdist backend (as given: ``"tcp"``, ``"cpu:tcp,cuda:nccl"``)."""
        return self._backend

    @property
    def tdist_group(self) -> Optional[ProcessGroup]:
        """The tdist group of the current configuration (None before the first ``configure``
        and after an abort)."""
        return self._tdist_group

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return f"torchft-tdist-{self._backend}"

    def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
        """torchft's hook, called by ``configure`` after the abort with a client of the
        store it named: the new tdist group, as torch's ProcessGroup."""
        self._generation += 1
        self._errored = None
        timeout = self._timeout
        tdist_store = from_torch_store(store, timeout)
        ranks = list(range(world_size))
        join(tdist_store, "tdist/join", rank, ranks, timeout, backend=self._backend)
        group = _build_group(
            "torchft", ranks, rank, self._devices, self._backend, tdist_store, timeout, dict(self._options)
        )
        self._tdist_group = group
        return mirror(group)

    def _wrap_work(self, work: Any, opts: object) -> Any:
        """torchft's error contract: a failed operation's Work does not raise -- ``wait``
        returns and the future completes with the (unreliable) tensors -- and the
        failure is reported by :meth:`errored`, which torchft's Manager reads before it
        commits the step (as torchft's NCCL groups report theirs)."""
        if not isinstance(work, BridgeWork):
            return work
        return BridgeWork(_Tolerant(self, work.tdist_work, self._generation), work._outputs)

    @property
    def parent(self) -> Any:
        """The group torchft's wrapper methods call: the current group, whose operations
        never raise (torchft's ``DistributedDataParallel`` does not survive an operation
        that raises: its comm hook then fails an assertion). An operation that cannot
        start -- a backend error, or no group since an abort -- gives a failed Work,
        which :meth:`_wrap_work` reports through :meth:`errored`."""
        return _Guarded(self._pg, self.getBackendName())

    @contextmanager
    def _run_context(self) -> Iterator[None]:
        """An operation that still raises (an argument error: see :attr:`parent`) is
        noted as the group's failure too."""
        try:
            yield
        except Exception as exc:
            self._note(exc, self._generation)
            raise

    def _note(self, exc: Optional[BaseException], generation: int) -> None:
        """Record ``exc`` as the current group's failure (the first one counts); failures
        of an earlier configuration's work are not the current group's."""
        if exc is not None and self._errored is None and generation == self._generation:
            self._errored = exc if isinstance(exc, Exception) else DistError(str(exc))

    def abort(self, errored: bool = True) -> None:
        """Drop the current group and shut it down in the background: its pending
        operations fail and its connections close without ``configure`` waiting for that
        (tcp's shutdown lingers about 50 ms for its goodbyes to go out, about 1 s when a
        peer is stopped rather than dead). With ``errored`` (torchft's default),
        :meth:`errored` reports the abort until the next ``configure``."""
        if errored and self._errored is None and self._pg is not None:
            self._errored = DistError(f"{self.getBackendName()}: the process group was aborted")
        old, self._pg, self._tdist_group = self._pg, None, None
        super().abort(errored=errored)  # torchft's error log; it has no group left to abort
        if old is not None:
            # Not a daemon: the interpreter's exit waits for it (a backend torn down during
            # the interpreter's own teardown may crash the process).
            thread = threading.Thread(target=_shut_down, args=(old,), name="tdist-torchft-abort")
            with _aborting_lock:
                _aborting.add(thread)
            thread.start()

    def shutdown(self) -> None:
        """Shut the current group down now, and wait for the groups aborts are still
        shutting down (torchft's own ``shutdown`` only drops the group)."""
        old, self._pg, self._tdist_group = self._pg, None, None
        if old is not None:
            _shut_down(old)
        with _aborting_lock:
            pending = list(_aborting)
        for thread in pending:
            thread.join()

    def errored(self) -> Optional[Exception]:
        """The first failure of the current group's operations, or its abort; None while
        it is healthy."""
        return self._errored

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of the next groups and, from now on, of the current one's operations."""
        super().set_timeout(timeout)
        group = self._tdist_group
        if group is not None:
            group.timeout = timeout
            for backend in group.distinct_backends():
                backend.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"ProcessGroupTdist(backend={self._backend!r}, pg={self._pg!r})"


#: The operations of torchft's ProcessGroupWrapper that reach the group through ``parent``.
_OPERATIONS = frozenset(
    {
        "allgather",
        "allgather_into_tensor_coalesced",
        "allreduce",
        "allreduce_coalesced",
        "alltoall_base",
        "barrier",
        "broadcast",
        "recv",
        "reduce_scatter",
        "reduce_scatter_tensor_coalesced",
        "send",
    }
)


class _Guarded:
    """The current group (None: none) as ``ProcessGroupTdist.parent``: its operations give
    a failed Work instead of raising a RuntimeError (tdist's errors are RuntimeErrors;
    argument errors -- ValueError, TypeError -- still raise)."""

    __slots__ = ("_pg", "_name")

    def __init__(self, pg: Any, name: str) -> None:
        self._pg = pg
        self._name = name

    def __getattr__(self, name: str) -> Any:
        pg = self._pg
        if name not in _OPERATIONS:
            if pg is None:
                raise DistError(f"{self._name}: the process group is not configured (call configure first)")
            return getattr(pg, name)

        def operation(*args: Any, **kwargs: Any) -> Any:
            if pg is None:
                error: BaseException = DistError(f"{self._name}: {name} on a process group that was aborted")
            else:
                try:
                    return getattr(pg, name)(*args, **kwargs)
                except RuntimeError as exc:
                    error = exc
            failed = Work(name)
            failed.set_exception(error)
            outputs = args[0] if args and isinstance(args[0], list) else []
            return BridgeWork(failed, outputs)

        return operation


#: The threads shutting down groups that aborts dropped.
_aborting: set[threading.Thread] = set()
_aborting_lock = threading.Lock()


def _shut_down(group: Any) -> None:
    """Shut a dropped group down (its torch side's ``abort``: the tdist group's backends)."""
    try:
        group.abort()
    except Exception:  # noqa: BLE001 - a group being dropped: nothing left to tell its user
        _log.exception("tdist.integrations.torchft: shutting down a dropped process group failed")
    finally:
        with _aborting_lock:
            _aborting.discard(threading.current_thread())


def _check_rebuildable(name: str) -> None:
    """Refuse a backend torchft cannot use: one that cannot serve torch.distributed, or
    whose ranks must share one ``mpirun`` (torchft starts and restarts replica groups on
    their own, and numbers them itself)."""
    spec = get_backend_spec(name)
    if spec.torch_bridge is not None:
        raise DistError(f"ProcessGroupTdist: backend {name!r} cannot serve torch.distributed: {spec.torch_bridge}")
    if spec.launcher == "mpirun":
        raise DistError(
            f"ProcessGroupTdist: backend {name!r} cannot serve torchft: its ranks must share one mpirun, while "
            "torchft starts and restarts replica groups on their own and rebuilds the group through a store; "
            "use a backend whose groups are built through the store (tcp, gloo)"
        )


class _Tolerant(Work):
    """A tdist Work that succeeds when ``inner`` completes, successfully or not, and tells
    ``owner`` about a failure (or a wait that ran out of time) instead of raising it."""

    def __init__(self, owner: ProcessGroupTdist, inner: Work, generation: int) -> None:
        super().__init__(inner.op)
        self._owner = owner
        self._inner = inner
        self._generation = generation
        self._lock = threading.Lock()
        inner.add_done_callback(self._settle)

    def _settle(self, inner: Work) -> None:
        self._owner._note(inner.exception(), self._generation)
        self._complete()

    def _complete(self) -> None:
        with self._lock:
            if self._done:
                return
            self.set_result(())

    def _block(self, timeout: Optional[float]) -> bool:
        # Waits for the done-callback, not on ``inner.wait()``: that would first run tdist's
        # failure agreement through the group's store (torchft agrees through its quorum).
        # The backend fails an operation past the group's timeout itself; this wait gives
        # up a second later only if it did not.
        limit = timeout
        if limit is None:
            default = self._inner.default_timeout
            limit = (default if default is not None else self._owner._timeout.total_seconds()) + 1.0
        if not super()._block(limit):
            late = DistBackendTimeoutError(f"{self.op}: did not complete within {limit:g} s")
            self._owner._note(late, self._generation)
            self._complete()
        return True
