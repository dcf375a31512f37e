"""tdist's groups made torch.distributed's groups: what ``init_process_group``,
``new_group`` and ``destroy_process_group`` do on torch's side.

``mirror_world`` initialises torch.distributed's default group with tdist's backend
(``tdist-<name>``) over tdist's store; torch's creator adopts the tdist group that was
just built (:func:`tdist._torch.registry.adopting`), so no rendezvous, connection or
backend instance is made twice. ``mirror_new_group`` does the same through
``torch.distributed.new_group`` on every rank (members or not, so torch's group names
stay in step). Destroying either side destroys both, once.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Optional, Sequence

import torch.distributed as torch_dist

from .._groups import STATE, ProcessGroup
from .._init import get_backend_spec
from .._store import PrefixStore
from .._store.torch_adapters import as_torch_store
from .features import features
from .registry import adopting, is_mirrored, register_torch_backends, torch_backend_string

__all__ = ["mirror_world", "mirror_new_group", "forget", "forget_all", "unbridgeable"]


def unbridgeable(devices: dict[str, str]) -> Optional[str]:
    """Why the backends of a device map cannot serve torch.distributed, or None."""
    specs = {name: get_backend_spec(name) for name in devices.values()}
    reasons = [f"{name}: {spec.torch_bridge}" for name, spec in specs.items() if spec.torch_bridge is not None]
    return "; ".join(reasons) or None


def _devices(pg: ProcessGroup) -> dict[str, str]:
    return {device: spec.name for device, spec in pg.specs.items()}


def mirror_world(world: ProcessGroup) -> None:
    """Make torch.distributed's default group ``world``'s mirror."""
    register_torch_backends(set(_devices(world).values()))
    why = unbridgeable(_devices(world))
    if why is not None:
        warnings.warn(f"tdist: torch.distributed is left uninitialized: {why}", stacklevel=3)
        return
    assert STATE.store is not None
    excepthook = sys.excepthook  # torch's init prefixes tracebacks with the rank; tdist's programs keep theirs
    try:
        with adopting(world):
            torch_dist.init_process_group(
                torch_backend_string(_devices(world)),
                # a world that replaced another (shrink_group) keeps torch's keys apart from its predecessor's
                store=as_torch_store(
                    PrefixStore("torch" if world.name == "pg0" else f"torch/{world.name}", STATE.store)
                ),
                rank=world.rank,
                world_size=world.size,
                timeout=world.timeout,
            )
    finally:
        sys.excepthook = excepthook


def mirror_new_group(
    pg: Optional[ProcessGroup],
    members: Sequence[int],
    devices: dict[str, str],
    group_desc: Optional[str],
    local: bool = False,
) -> None:
    """Mirror the group tdist's ``new_group`` made of ``members`` (``pg`` is None on the
    ranks outside it, which still call torch's ``new_group``: tdist's ``new_group`` is
    called by every rank, so torch's group names stay in step). ``local``: only the
    members made it (``use_local_synchronization``); torch names such a group after its
    ranks, so a second group of the same ranks stays tdist's only (with a warning)."""
    if not is_mirrored(STATE.world) or unbridgeable(devices):  # the same answer on every rank
        return
    world = STATE.world
    assert world is not None
    kwargs: dict[str, Any] = dict(
        backend=torch_backend_string(devices),
        timeout=world.timeout if pg is None else pg.timeout,
        group_desc=group_desc,
    )
    if features().new_group_sort_ranks:
        kwargs["sort_ranks"] = False
    elif list(members) != sorted(members):  # torch would number the group's ranks differently
        warnings.warn(
            f"tdist: torch {features().version}'s new_group sorts ranks, so the group {list(members)} "
            "(ranks not in ascending order) is tdist's only: torch.distributed does not see it",
            stacklevel=4,
        )
        return
    if pg is None:
        torch_dist.new_group(list(members), **kwargs)
        return
    if local:
        kwargs["use_local_synchronization"] = True
    try:
        with adopting(pg):
            torch_dist.new_group(list(members), **kwargs)
    except ValueError as exc:  # torch: "The specified group name has already been created"
        if not local:
            raise
        warnings.warn(
            f"tdist: torch.distributed names groups made with use_local_synchronization after their "
            f"ranks, and already has one of {list(members)}: this one is tdist's only ({exc})",
            stacklevel=4,
        )


def forget(pg: ProcessGroup) -> None:
    """tdist destroyed ``pg``: remove its mirror from torch.distributed (unless torch is
    the one destroying it)."""
    mirror = pg.torch_group
    if mirror is None or mirror.closing:
        return
    mirror.closing = True
    try:
        torch_dist.destroy_process_group(mirror)
    except ValueError:  # torch no longer knows it (its world was destroyed first)
        pass


def forget_all(groups: Sequence[ProcessGroup]) -> None:
    """tdist destroyed every group: destroy torch.distributed's world too when it is
    tdist's and torch is not already destroying it."""
    mirrors = [pg.torch_group for pg in groups if pg.torch_group is not None]
    world_mirror = torch_dist.GroupMember.WORLD
    destroy_torch = any(m is world_mirror for m in mirrors if not m.closing)
    for m in mirrors:
        m.closing = True
    if destroy_torch:
        torch_dist.destroy_process_group()
