"""The tdist plugin contract: every hook a plugin may implement.

A plugin is a module (or object) registered under the entry-point group ``tdist``
whose functions are marked with :data:`hookimpl` and named like the specs below.
It also sets ``TDIST_HOOKSPEC_VERSION`` to the contract version it was written
for; the core refuses a plugin whose major version differs from
:data:`HOOKSPEC_VERSION`'s.

Hooks are always called with keyword arguments.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import pluggy

if TYPE_CHECKING:
    from ._plugins import BackendRegistry, RendezvousRegistry, WorkInfo

__all__ = ["hookspec", "hookimpl", "HOOKSPEC_VERSION", "PROJECT_NAME"]

PROJECT_NAME = "tdist"
#: (major, minor) of this contract. A plugin written for the same major version
#: and a minor version <= this one is compatible.
#: 1.1 added WorkInfo's rank, group_ranks, reduce_op, root, peer, tag and issued_time,
#: ``tdist_work_failed``'s ``duration``, rejected operations reaching it, and the group hooks.
#: 1.2 added ``Backend.run_blocking`` (optional: a backend may run a blocking call without a Work).
HOOKSPEC_VERSION = (1, 2)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# ------------------------------------------------------------------- backends
@hookspec
def tdist_register_backends(registry: "BackendRegistry") -> None:
    """Register this plugin's backends with ``registry.add(BackendSpec(...))``.

    Called once, when the core first needs the list of backends. Import heavy
    dependencies inside the backend factory, not here; a backend whose
    dependency is missing registers with ``available="<reason>"``.
    The return value is ignored.
    """


# ----------------------------------------------------------------- rendezvous
@hookspec
def tdist_register_rendezvous(registry: "RendezvousRegistry") -> None:
    """Register init-method handlers with ``registry.add(scheme, handler)``.

    ``handler(url, *, rank, world_size, timeout, group_name)`` receives the
    parsed ``init_method`` URL (``urllib.parse.SplitResult``), the rank and
    world size given to ``init_process_group`` (-1 when not given), the timeout
    in seconds and the group name; it returns ``(store, rank, world_size)``.
    The return value of this hook is ignored.
    """


# ----------------------------------------------------------------------- work
@hookspec
def tdist_work_issued(info: "WorkInfo") -> None:
    """Observe an operation as it is issued. ``info`` (a :class:`tdist.WorkInfo`)
    describes the operation: op, group name and global ranks, this rank, sequence
    number, shapes, dtype, bytes, reduction, root, peer and tag. Return value ignored."""


@hookspec
def tdist_work_completed(info: "WorkInfo", duration: float) -> None:
    """Observe an operation that completed successfully after ``duration`` seconds
    (measured from issue to completion). Return value ignored."""


@hookspec
def tdist_work_failed(info: "WorkInfo", error: BaseException, duration: float) -> None:
    """Observe an operation that failed with ``error`` after ``duration`` seconds from
    issue (a timeout included). An operation rejected before any communication (bad
    arguments at call time) reaches this hook too, without ``tdist_work_issued``, with
    ``info.seq`` 0 and ``duration`` 0. Return value ignored."""


# --------------------------------------------------------------------- groups
@hookspec
def tdist_group_created(name: str, ranks: list[int], rank: int, backend: str) -> None:
    """Observe a process group this rank is a member of, once it is ready:
    ``init_process_group`` (name ``"pg0"``) and ``new_group``. ``ranks``: its global
    ranks in group-rank order; ``rank``: this process's global rank; ``backend``: its
    backend name. Return value ignored."""


@hookspec
def tdist_group_destroyed(name: str, ranks: list[int], rank: int, backend: str) -> None:
    """Observe a group being destroyed (``destroy_process_group``), before its backends
    shut down; the same arguments as :func:`tdist_group_created`. Return value ignored."""


# ------------------------------------------------------------------ lifecycle
@hookspec(firstresult=True)
def tdist_default_backend(device: str) -> Optional[str]:
    """Name the backend to use for ``device`` ("cpu", "cuda") when
    ``init_process_group`` is called without one. Stops at first non-None
    result; None means "no opinion"."""
