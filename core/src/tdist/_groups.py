"""Process groups: :class:`ProcessGroup`, the process-wide state, and rank queries.

A group is a list of global ranks (in group-rank order) plus one backend instance per device
type (``"cpu"``, ``"cuda"``). Group ranks are indices into that list.
"""

from __future__ import annotations

import itertools
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._backend import Backend, BackendSpec
from ._errors import DistError, DistStateError
from ._failure import mark_aborting
from ._mismatch import checks_collectives

if TYPE_CHECKING:
    from ._store.base import Store

__all__ = [
    "ProcessGroup",
    "GroupMember",
    "group",
    "STATE",
    "resolve_group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "is_initialized",
]


class ProcessGroup:
    """A set of ranks and the backends that connect them.

    ``ranks`` are the global ranks in group-rank order (sorted unless created with
    ``sort_ranks=False``); ``rank`` is this process's index in
    them. ``backends`` maps device type to the backend serving it, and ``specs``
    to the :class:`BackendSpec` it came from (for capability checks).
    ``torch_group`` is the ``torch.distributed`` ProcessGroup that mirrors this group
    (see :mod:`tdist._torch`), None when not bridged; :attr:`handle` is what the API
    hands out for the group: the mirror when there is one, so torch accepts it too.
    Setting ``torch_group`` of the default group updates ``GroupMember.WORLD``.
    """

    def __init__(
        self,
        name: str,
        ranks: Sequence[int],
        rank: int,
        backends: dict[str, Backend],
        specs: dict[str, BackendSpec],
        store: "Store",
        timeout: timedelta,
        backend_name: str,
        options: Optional[dict[str, Any]] = None,
    ) -> None:
        self.name = name
        self.ranks = list(ranks)
        self.ranks_tuple = tuple(self.ranks)  # the same, for the work hooks (never changes)
        self.rank = rank
        self.size = len(self.ranks)
        self.backends = backends
        self.specs = specs
        self.store = store
        self.timeout = timeout
        self.backend_name = backend_name
        #: the backend options the group was built with (``shrink_group``'s default for its successor)
        self.options = dict(options or {})
        self._seqs = itertools.count(1)  # next() is atomic: no lock on the hot path
        self._p2p_seqs = itertools.count(1)
        self._global_to_group = {g: i for i, g in enumerate(self.ranks)}
        self.torch_group: Any = None
        #: compare every collective across ranks before issuing it (see :mod:`tdist._mismatch`)
        self.check_collectives = checks_collectives(list(backends.values()))
        self._served: dict[tuple[str, str], Backend] = {}  # (device, operation) -> backend, once checked
        #: the members' agreement on failed ranks, once one ran (see :mod:`tdist._failure`)
        self.agreement: Any = None
        self.closed = False  # shut down or aborted
        #: shrink_group / grow_group calls on this group so far: the n-th names its new group
        #: ``<name>.shrink<n>`` / ``<name>.grow<n>`` alike on every member (a new group starts at 0)
        self.shrinks = 0
        self.grows = 0

    @property
    def handle(self) -> Any:
        """The group as the API returns it: its torch.distributed mirror, else itself."""
        return self if self.torch_group is None else self.torch_group

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "torch_group" and STATE.world is self:
            GroupMember.WORLD = self.handle

    def next_seq(self) -> int:
        """Advance and return this group's collective counter: every member calls every
        collective, so the n-th collective has number n on every rank."""
        return next(self._seqs)

    def next_p2p_seq(self) -> int:
        """Advance and return this rank's point-to-point counter in this group (sends and
        receives involve only some ranks, so it differs between ranks)."""
        return next(self._p2p_seqs)

    def group_rank(self, global_rank: int, what: str = "rank") -> int:
        """The group rank of ``global_rank``; a clear error if it is not a member."""
        try:
            return self._global_to_group[global_rank]
        except (KeyError, TypeError):
            raise ValueError(
                f"{what} {global_rank!r} is not in group {self.name!r} (its global ranks: {self.ranks})"
            ) from None

    def backend_for(self, device: str, operation: str) -> Backend:
        """The backend that runs ``operation`` on ``device`` tensors, or a clear error."""
        known = self._served.get((device, operation))
        if known is not None:
            return known
        backend = self.backends.get(device)
        if backend is None:
            served = ", ".join(sorted(self.backends)) or "none"
            raise DistError(
                f"{operation}: backend {self.backend_name!r} of group {self.name!r} has no support for "
                f"{device} tensors (devices it serves: {served})"
            )
        if not self.specs[device].supports(operation, device):
            raise DistError(
                f"{operation}: not supported by backend {self.specs[device].name!r} on {device} tensors "
                "(see `python -m tdist info` for the support table)"
            )
        self._served[(device, operation)] = backend
        return backend

    def distinct_backends(self) -> list[Backend]:
        """Each backend object once (one backend may serve several device types)."""
        return list({id(b): b for b in self.backends.values()}.values())

    def shutdown(self, released: Sequence[Backend] = ()) -> None:
        """Release the backends but those already ``released`` (once: after :meth:`abort`,
        nothing is left to release)."""
        if self.closed:
            return
        self.closed = True
        for backend in self.distinct_backends():
            if not any(backend is done for done in released):
                backend.shutdown()

    def abort(self) -> None:
        """Fail every pending operation of this rank on the group now and, where the backend
        can (its ``abort`` feature), the peers' pending operations on it; the peers learn
        that this rank left on purpose, not that it failed. The group is then unusable:
        destroy it or shrink it."""
        if self.closed:
            return
        self.closed = True
        mark_aborting(self)
        for backend in self.distinct_backends():
            backend.abort()

    def __repr__(self) -> str:
        return f"<ProcessGroup {self.name!r} ranks={self.ranks} backend={self.backend_name!r}>"


class _NonMember:
    """The handle a rank receives from ``new_group`` when it is not a member. It equals
    torch.distributed's own (``-100``), so torch's functions treat it as theirs."""

    def __repr__(self) -> str:
        return "<GroupMember.NON_GROUP_MEMBER>"

    def __eq__(self, other: object) -> bool:
        return other is self or (type(other) is int and other == _TORCH_NON_MEMBER)

    def __hash__(self) -> int:
        return hash(_TORCH_NON_MEMBER)


class GroupMember:
    """Group sentinels: ``GroupMember.WORLD`` is the default group as the API hands it out
    (its :attr:`~ProcessGroup.handle`; None before init); ``GroupMember.NON_GROUP_MEMBER``
    is what non-members get from ``new_group``.

    ``WORLD`` is a plain class attribute, which ``STATE.world`` and the world's
    ``torch_group`` keep up to date when they are set: torch.compile (Dynamo) reads it as it
    reads torch's ``GroupMember.WORLD`` (a descriptor here would reach it unresolved).
    """

    NON_GROUP_MEMBER: Any = _NonMember()
    WORLD: Any = None


class _State:
    """Everything ``init_process_group`` sets up; reset by ``destroy_process_group``.
    Setting ``world`` updates ``GroupMember.WORLD``."""

    def __init__(self) -> None:
        self.world: Optional[ProcessGroup] = None
        self.groups: list[ProcessGroup] = []
        self.store: Optional["Store"] = None
        self.group_count = 0
        self.backend_name = ""
        self.options: dict[str, Any] = {}

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "world":
            GroupMember.WORLD = None if value is None else value.handle


STATE = _State()


#: ``tdist.group.WORLD`` as in torch.distributed.
group = GroupMember

#: What ``torch.distributed.new_group`` returns to ranks outside the group.
_TORCH_NON_MEMBER = -100


def is_initialized() -> bool:
    """Whether ``init_process_group`` has completed (and not been destroyed)."""
    return STATE.world is not None


def _require_init() -> ProcessGroup:
    if STATE.world is None:
        raise DistStateError("default process group is not initialized: call tdist.init_process_group() first")
    return STATE.world


def tdist_side(group: Any) -> Optional[ProcessGroup]:
    """The tdist group of a torch.distributed group that mirrors one, else None. A function of
    its own for torch.compile: Dynamo may not read a torch group's attributes, so a compiled
    function breaks its graph at this call (:mod:`tdist._torch.dynamo`)."""
    return getattr(group, "tdist_group", None)


def resolve_group(group: Any) -> Optional[ProcessGroup]:
    """The :class:`ProcessGroup` for a ``group=`` argument; None for a non-member handle.

    Raises if the package is not initialized or ``group`` is not a group. A torch group of
    a tdist backend needs no tdist default group: torch's may be another backend's.
    """
    world = STATE.world
    if world is None:
        mirrored = tdist_side(group)
        if mirrored is not None:  # torch made it beside its own default group, and owns it
            return mirrored
        world = _require_init()
    if group is None or group is world.torch_group:
        return world
    if group is GroupMember.NON_GROUP_MEMBER:
        return None
    mirrored = tdist_side(group)  # a torch.distributed group made by tdist (tdist._torch)
    if mirrored is not None:
        group = mirrored
    elif type(group) is int and group == _TORCH_NON_MEMBER:
        return None
    if isinstance(group, ProcessGroup):
        if group not in STATE.groups:
            raise DistStateError(f"group {group.name!r} was destroyed or belongs to an earlier init_process_group")
        return group
    raise TypeError(
        "group must be a group returned by tdist.new_group(), torch.distributed's group of a tdist backend, "
        f"or None; got {group!r}"
    )


def warn_not_member(operation: str) -> None:
    warnings.warn(f"{operation}: this rank is not a member of the group; nothing done", stacklevel=3)


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 for a non-member."""
    pg = resolve_group(group)
    return -1 if pg is None else pg.rank


def get_world_size(group: Any = None) -> int:
    """The number of ranks in ``group`` (default: the world); -1 for a non-member."""
    pg = resolve_group(group)
    return -1 if pg is None else pg.size


def get_backend(group: Any = None) -> str:
    """The backend name of ``group`` (as given to init_process_group or new_group)."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("get_backend: this rank is not a member of the group")
    return pg.backend_name


def get_process_group_ranks(group: Any) -> list[int]:
    """The global ranks of ``group``, in group-rank order."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("get_process_group_ranks: this rank is not a member of the group")
    return list(pg.ranks)


def get_global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group``."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("get_global_rank: this rank is not a member of the group")
    if not isinstance(group_rank, int) or not 0 <= group_rank < pg.size:
        raise ValueError(f"get_global_rank: group rank {group_rank!r} is out of range for a group of size {pg.size}")
    return pg.ranks[group_rank]


def get_group_rank(group: Any, global_rank: int) -> int:
    """The rank in ``group`` of the process with global rank ``global_rank``."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("get_group_rank: this rank is not a member of the group")
    return pg.group_rank(global_rank, "global rank")
