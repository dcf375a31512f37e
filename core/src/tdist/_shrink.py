"""``shrink_group``: a group without some of its ranks (lost ones, typically), made by the
others without restarting -- torch 2.13's signature and semantics, on every backend
whose groups are built through the store (tcp, gloo; MPI needs ULFM, see its spec).

The survivors agree first (:func:`_agree`): each publishes the group ranks it excludes
under the group's next shrink key, waits for every other survivor's claim and compares.
A survivor that excludes other ranks, or an excluded rank that is alive and shrinking
too, is a clear :class:`DistError`; each survivor then publishes its verdict and reads
the others', so one survivor's refusal is every survivor's (none goes on to build a
group the others left). A survivor that never comes is a timeout naming it. Then they build the new group through the store, as
``new_group`` does, and shut the old one down (its pending operations fail).

Shrinking the default group makes the new group the default one with its ranks
renumbered ``0 .. n-1`` in the old order (``get_rank()`` changes), and destroys every
other group first, as torch does; torch.distributed's default group follows where the
bridge had attached.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Optional, Sequence

from . import _bridge as bridging
from ._backend import Backend
from ._errors import DistError, DistStoreTimeoutError
from ._failure import agree_now
from ._groups import STATE, ProcessGroup, resolve_group
from ._init import _announce, _build_group, _same_devices, destroy_process_group
from ._plugins import plugins
from ._store.base import Store

__all__ = ["SHRINK_DEFAULT", "SHRINK_ABORT", "shrink_group", "failed_ranks"]

#: Build the new group, then shut the old one down.
SHRINK_DEFAULT = 0x00
#: Shut the old group down first (its pending operations fail at once), then build the new one.
SHRINK_ABORT = 0x01


def shrink_group(
    ranks_to_exclude: list[int],
    group: Any = None,
    shrink_flags: int = SHRINK_DEFAULT,
    pg_options: Optional[dict[str, Any]] = None,
) -> Any:
    """A new group of ``group``'s ranks (default: the default group) without the group
    ranks ``ranks_to_exclude``, called by every rank that stays (not by the excluded
    ones). The survivors must agree on ``ranks_to_exclude``. The old group is shut down;
    shrinking the default group makes the result the default group, renumbered, and
    destroys the other groups. ``pg_options`` are the new group's backend options
    (default: the old group's)."""
    _check_arguments(ranks_to_exclude, shrink_flags)
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("shrink_group: this rank is not a member of the group")
    if pg.size <= 1:
        raise ValueError(f"shrink_group: cannot shrink a group of {pg.size} rank; it needs at least 2")
    excluded = _check_excluded(ranks_to_exclude, pg)
    for spec in pg.specs.values():
        why = spec.extra.get("unsupported", {}).get("shrink_group")
        if why:
            raise TypeError(f"shrink_group: backend {spec.name!r} cannot shrink a group: {why}")
    survivors = [r for r in range(pg.size) if r not in excluded]
    store = STATE.store
    assert store is not None
    pg.shrinks += 1
    name = f"{pg.name}.shrink{pg.shrinks}"
    _agree(store, f"tdist/{name}/agree", pg.rank, survivors, sorted(excluded), pg.timeout)
    aborted = bool(shrink_flags & SHRINK_ABORT)
    is_world = pg is STATE.world
    if is_world:  # every other group goes first, as torch does
        for other in [g for g in STATE.groups if g is not pg]:
            destroy_process_group(other)
    devices = _same_devices(pg)
    options = {**pg.options, **(pg_options or {})}
    if is_world:  # renumbered: the survivors are the new world's ranks 0 .. n-1
        ranks, me = list(range(len(survivors))), survivors.index(pg.rank)
    else:
        ranks, me = [pg.ranks[r] for r in survivors], pg.ranks[pg.rank]
    old_backends = {spec.name: pg.backends[device] for device, spec in pg.specs.items()}
    released: list[Backend] = []  # shut down before the new group was built (SHRINK_ABORT)

    def derive(backend_name: str, backend_store: Store) -> Optional[Backend]:
        """The old backend's own shrink; None: the factory builds the new one (with
        SHRINK_ABORT, after the old one is shut down)."""
        old = old_backends[backend_name]
        derived = old.shrink(survivors, store=backend_store, global_ranks=ranks, options=dict(options), abort=aborted)
        if derived is None and aborted:
            old.shutdown()
            released.append(old)
        return derived

    try:
        new = _build_group(name, ranks, me, devices, pg.backend_name, store, pg.timeout, options, derive)
    except BaseException:
        if aborted:
            pg.shutdown(released)
        raise
    _retire(pg, new, devices, is_world, released)
    return new.handle


def failed_ranks(group: Any = None) -> list[int]:
    """The group ranks of ``group`` (default: the default group) that failed, as every
    surviving member agrees (what :class:`tdist.DistRankFailureError` carries); called by the
    survivors after an operation failed, for instance when torch's DDP raised a
    RuntimeError. Runs the agreement if no failure was agreed yet (every survivor must
    then call it); an empty list when no rank failed."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("failed_ranks: this rank is not a member of the group")
    return list(agree_now(pg))


def _check_arguments(ranks_to_exclude: Any, shrink_flags: Any) -> None:
    if not isinstance(ranks_to_exclude, list):
        raise TypeError(
            f"shrink_group: ranks_to_exclude must be a list of group ranks, got {type(ranks_to_exclude).__name__}"
        )
    if not ranks_to_exclude:
        raise ValueError("shrink_group: ranks_to_exclude is empty; name at least one rank to exclude")
    if shrink_flags not in (SHRINK_DEFAULT, SHRINK_ABORT):
        raise ValueError(
            f"shrink_group: shrink_flags must be SHRINK_DEFAULT ({SHRINK_DEFAULT}) or SHRINK_ABORT ({SHRINK_ABORT}), "
            f"got {shrink_flags!r}"
        )


def _check_excluded(ranks_to_exclude: Sequence[Any], pg: ProcessGroup) -> set[int]:
    excluded: set[int] = set()
    for rank in ranks_to_exclude:
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise TypeError(f"shrink_group: ranks_to_exclude holds {rank!r}, not a group rank (int)")
        if not 0 <= rank < pg.size:
            raise ValueError(f"shrink_group: rank {rank} is out of range for a group of size {pg.size}")
        if rank in excluded:
            raise ValueError(f"shrink_group: rank {rank} is in ranks_to_exclude twice")
        excluded.add(rank)
    if len(excluded) == pg.size:
        raise ValueError(f"shrink_group: ranks_to_exclude excludes every rank of the group ({pg.size})")
    if pg.rank in excluded:
        raise RuntimeError(
            f"shrink_group: this rank (group rank {pg.rank}) is in ranks_to_exclude; only the ranks that stay call it"
        )
    return excluded


def _agree(store: Store, key: str, me: int, survivors: list[int], excluded: list[int], timeout: timedelta) -> None:
    """Publish ``excluded`` as this rank's claim, wait for every other survivor's and
    compare; also look whether an excluded rank is shrinking the group too. Then every
    survivor publishes its verdict and reads the others': one survivor's refusal is every
    survivor's (an excluded rank's claim may arrive between two survivors' looks)."""
    mine = json.dumps(excluded).encode()
    store.set(f"{key}/{me}", mine)
    _wait_for(store, [f"{key}/{r}" for r in survivors], survivors, me, timeout, f"excluding {excluded}")
    refusal = _refusal(store, key, me, survivors, excluded)
    store.set(f"{key}/verdict/{me}", (refusal or "").encode())
    if refusal:
        raise DistError(refusal)
    _wait_for(store, [f"{key}/verdict/{r}" for r in survivors], survivors, me, timeout, "to agree")
    verdicts = store.multi_get([f"{key}/verdict/{r}" for r in survivors])
    for r, theirs in zip(survivors, verdicts):
        if theirs:
            raise DistError(
                f"shrink_group: group rank {r} refused the shrink, so rank {me} does too: {theirs.decode()}"
            )


def _wait_for(store: Store, keys: list[str], ranks: list[int], me: int, timeout: timedelta, what: str) -> None:
    """Wait for ``keys`` (one per rank of ``ranks``); a DistError names the ranks that never set theirs."""
    try:
        store.wait(keys, timeout=timeout)
    except DistStoreTimeoutError:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        raise DistError(
            f"shrink_group: group rank {me} waited {timeout.total_seconds():g} s but rank(s) {missing}, which it "
            f"keeps, never called shrink_group ({what})"
        ) from None


def _refusal(store: Store, key: str, me: int, survivors: list[int], excluded: list[int]) -> Optional[str]:
    """Why this rank refuses the shrink (the survivors' claims differ, or a rank it excludes
    is alive and shrinking too), or None."""
    views = dict(zip(survivors, (json.loads(raw) for raw in store.multi_get([f"{key}/{r}" for r in survivors]))))
    differing = {r: view for r, view in views.items() if view != excluded}
    if differing:
        listing = "; ".join(f"rank {r} excludes {view}" for r, view in differing.items())
        return f"shrink_group: the ranks disagree on the ranks to exclude: rank {me} excludes {excluded}; {listing}"
    alive = [r for r in excluded if store.check([f"{key}/{r}"])]
    if alive:
        return (
            f"shrink_group: the ranks disagree: rank(s) {alive}, which rank {me} excludes, are alive and called "
            f"shrink_group too (excluding {[json.loads(store.get(f'{key}/{r}')) for r in alive]})"
        )
    return None


def _retire(
    old: ProcessGroup, new: ProcessGroup, devices: dict[str, str], is_world: bool, released: Sequence[Backend] = ()
) -> None:
    """Put ``new`` in ``old``'s place (the default group too, when ``old`` was it) and shut
    ``old``'s backends down, but those already ``released`` (what a backend's shrink handed
    to ``new`` survives that)."""
    mirrored = old.torch_group is not None
    if old in STATE.groups:
        STATE.groups.remove(old)
    _announce(plugins().group_destroyed, old)
    old.shutdown(released)
    if is_world:
        bridging.installed().forget_all([old])
        STATE.world = new
        STATE.groups.insert(0, new)
    else:
        bridging.installed().forget(old)
        STATE.groups.append(new)
    _announce(plugins().group_created, new)
    if not mirrored:
        return
    if is_world:
        bridging.installed().mirror_world(new)
    else:
        bridging.installed().mirror_new_group(new, new.ranks, devices, None, local=True)
