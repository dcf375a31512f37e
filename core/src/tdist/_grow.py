"""Growing a running job: a new process joins the default group without anyone restarting.

A newcomer calls :func:`join_process_group`: it reaches the job's store (``env://`` as a
launcher sets it, or ``store=``; with a token set, the store authenticates it both ways),
files a join request (``tdist/join/seq``, ``tdist/join/request/<n>``) and waits for its
answer. The members call :func:`grow_group` at the point the program chooses (between
steps): the default group's rank 0 takes every pending request (waiting for at least
``min_joiners``), answers each newcomer with its rank, and tells the members; all of
them build the grown group through the store, the old members keeping their ranks and
the newcomers numbered after them. The grown group becomes the default group; as when
shrinking, every other group is destroyed first (the newcomers are in none of them).
The program then sends its state from a member to the newcomers (DDP's constructor
broadcasts the parameters; ``broadcast_object_list`` the optimizer state).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from datetime import timedelta
from typing import Any, Optional

from . import _bridge as bridging
from ._errors import DistError, DistStateError, DistStoreTimeoutError
from ._groups import STATE, resolve_group
from ._init import (
    _announce,
    _build_group,
    _parse_backend,
    _same_devices,
    default_pg_timeout,
    destroy_process_group,
)
from ._join import INCARNATION_KEY, WORLD_PREFIX
from ._plugins import plugins
from ._rendezvous.common import job_store
from ._rendezvous.env import _store
from ._shrink import _retire
from ._store import PrefixStore
from ._store.base import Store

__all__ = ["join_process_group", "grow_group"]

_SEQ, _TAKEN = "tdist/join/seq", "tdist/join/taken"
_POLL = 0.05


def grow_group(min_joiners: int = 0, timeout: Optional[timedelta] = None) -> Any:
    """Admit the processes waiting in :func:`join_process_group` into the default group;
    called by every member. Waits (up to ``timeout``, default the group's) until at least
    ``min_joiners`` are waiting. Returns the default group: the grown one, or the same one
    when nobody was waiting."""
    world = resolve_group(None)
    if world is None or STATE.store is None:
        raise DistStateError("grow_group: call init_process_group first")
    if not isinstance(min_joiners, int) or isinstance(min_joiners, bool) or min_joiners < 0:
        raise ValueError(f"grow_group: min_joiners must be an int >= 0, got {min_joiners!r}")
    if world.agreement is not None and world.agreement.verdict and world.agreement.verdict["failed"]:
        raise DistError(
            f"grow_group: ranks {world.agreement.verdict['failed']} of the default group failed; shrink it "
            "(tdist.shrink_group) before growing it"
        )
    limit = (timeout or world.timeout).total_seconds()
    store = STATE.store
    world.grows += 1
    name = f"{world.name}.grow{world.grows}"
    if world.rank == 0:
        decision = _admit(store, name, world.size, min_joiners, limit)
        store.set(f"tdist/{name}/decision", json.dumps(decision))
    else:
        try:
            decision = json.loads(store.get(f"tdist/{name}/decision", timeout=timedelta(seconds=limit)))
        except DistStoreTimeoutError:
            raise DistError(
                f"grow_group: rank {world.rank} waited {limit:g} s for rank 0 to admit the newcomers; "
                "call grow_group on every member of the default group"
            ) from None
    if decision["size"] == world.size:
        return world.handle
    for other in [g for g in STATE.groups if g is not world]:
        destroy_process_group(other)
    devices = _same_devices(world)
    new = _build_group(
        name,
        list(range(decision["size"])),
        world.rank,
        devices,
        world.backend_name,
        store,
        world.timeout,
        dict(STATE.options),
    )
    STATE.group_count = decision["group_count"]
    _retire(world, new, devices, is_world=True)
    return new.handle


def _admit(store: Store, name: str, size: int, min_joiners: int, limit: float) -> dict[str, Any]:
    """Rank 0's part: take the pending join requests and answer each newcomer."""
    deadline = time.monotonic() + limit
    taken = int(store.add(_TAKEN, 0))
    while True:
        filed = int(store.add(_SEQ, 0))
        if filed - taken >= min_joiners:
            break
        if time.monotonic() >= deadline:
            raise DistError(
                f"grow_group: waited {limit:g} s for {min_joiners} process(es) to call join_process_group; "
                f"{filed - taken} did"
            )
        time.sleep(_POLL)
    requests = list(range(taken + 1, filed + 1))
    store.add(_TAKEN, len(requests))
    grown = size + len(requests)
    decision = {"name": name, "size": grown, "group_count": STATE.group_count}
    world = STATE.world
    assert world is not None
    for i, request in enumerate(requests):
        answer = {
            **decision,
            "rank": size + i,
            "backend": world.backend_name,
            "devices": _same_devices(world),
            "timeout": world.timeout.total_seconds(),
        }
        store.set(f"tdist/join/answer/{request}", json.dumps(answer))
    return decision


def join_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    store: Optional[Store] = None,
    timeout: Optional[timedelta] = None,
    pg_options: Optional[dict[str, Any]] = None,
    torch_bridge: Optional[bool] = None,
) -> None:
    """Join a running job as a new rank of its default group (instead of
    ``init_process_group``): blocks until the members call :func:`grow_group` (or
    ``timeout``, default 30 minutes, passes). ``init_method`` is ``env://`` (the
    default: ``MASTER_ADDR``/``MASTER_PORT`` of the job's store, as its launcher set
    them) or ``store`` is the job's store. ``backend``, when given, must be the job's."""
    if STATE.world is not None:
        raise DistStateError("join_process_group: already initialized; call tdist.destroy_process_group() first")
    timeout = timeout or default_pg_timeout
    if store is None:
        store = _job_store(init_method or "env://", timeout)
    elif init_method is not None:
        raise ValueError("join_process_group: pass either init_method or store, not both")
    try:
        world_store = _incarnation(store, timeout)
        request = int(world_store.add(_SEQ, 1))
        try:
            answer = json.loads(world_store.get(f"tdist/join/answer/{request}", timeout=timeout))
        except DistStoreTimeoutError:
            raise DistError(
                f"join_process_group: the job's members did not admit this process within "
                f"{timeout.total_seconds():g} s (they admit newcomers when they call tdist.grow_group)"
            ) from None
        if backend is not None and _parse_backend(backend)[1] != answer["devices"]:
            raise DistError(f"join_process_group: the job uses backend {answer['backend']!r}, not {backend!r}")
        group_timeout = timedelta(seconds=answer["timeout"])
        options = dict(pg_options or {})
        world = _build_group(
            answer["name"],
            list(range(answer["size"])),
            answer["rank"],
            answer["devices"],
            answer["backend"],
            world_store,
            group_timeout,
            options,
        )
    except BaseException:
        store.close()
        raise
    STATE.world, STATE.groups, STATE.store = world, [world], world_store
    STATE.group_count = answer["group_count"]
    STATE.backend_name, STATE.options = answer["backend"], options
    _announce(plugins().group_created, world)
    if bridging.wanted(torch_bridge) and bridging.installed().torch_is_free(world.rank, world.size):
        bridging.installed().mirror_world(world)


def _job_store(init_method: str, timeout: timedelta) -> Store:
    """A client of the job's store named by ``init_method`` (``env://``)."""
    if urllib.parse.urlsplit(init_method).scheme != "env":
        raise ValueError(
            f"join_process_group: init_method {init_method!r} is not supported; use env:// (MASTER_ADDR and "
            "MASTER_PORT of the job's store) or pass the job's store as store="
        )
    return job_store(_store(1, -1, timeout.total_seconds()), "")


def _incarnation(store: Store, timeout: timedelta) -> Store:
    """The running world's keys in the job's store (see :mod:`tdist._join`)."""
    try:
        ident = store.get(INCARNATION_KEY, timeout=timeout).decode().partition(" ")[0]
    except DistStoreTimeoutError:
        raise DistError("join_process_group: no job is running on this store (no incarnation key)") from None
    return PrefixStore(f"{WORLD_PREFIX}/{ident}", store, owns=True)
