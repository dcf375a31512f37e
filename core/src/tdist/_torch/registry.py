"""tdist's backends registered as torch.distributed backends, and the creator torch calls.

torch builds a process group of a registered backend by calling its creator
(``Backend.register_backend(name, creator, extended_api=True)``) with the group's store
(a torch ``PrefixStore``), group rank and size, timeout and global ranks. The creator
returns a :class:`TorchProcessGroup` over a tdist group:

* while tdist mirrors a group it has just built itself (:func:`adopting`), that group
  -- torch gets tdist's group, no second rendezvous and no second connection mesh;
* for torch's default group (``torch.distributed.init_process_group("tdist-tcp")``),
  tdist's default group, initialised over torch's store (so tdist's API works too);
* for ``torch.distributed.new_group`` (torch's default group on a tdist backend or
  not), a new tdist group of those ranks over torch's store.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch.distributed as torch_dist

from tdist_autoload._shared import Creator, torch_backend_name

from .._errors import DistError
from .._groups import STATE, ProcessGroup
from .._init import _build_group, get_backend_spec, init_process_group, join
from .._plugins import plugins
from .._store.torch_adapters import from_torch_store
from .dynamo import prepare as prepare_for_compile
from .features import register_backend
from .process_group import TorchProcessGroup
from .shrink import install as route_shrink_group

__all__ = ["register_torch_backends", "create_torch_group", "adopting", "torch_backend_string", "mirror", "is_mirrored"]

_adopting: Optional[ProcessGroup] = None


def register_torch_backends(names: Optional[Iterable[str]] = None) -> None:
    """Register ``tdist-<name>`` with torch.distributed, with the devices its spec declares,
    for the backends ``names`` (default: every installed one; naming them probes no other);
    torch's creator calls :func:`create_torch_group` directly."""
    registry = plugins().backends
    specs = registry.specs() if names is None else [s for s in map(registry.get, names) if s is not None]
    for spec in specs:
        register_backend(torch_backend_name(spec.name), Creator(spec.name, create_torch_group), list(spec.devices))


def torch_backend_string(devices: dict[str, str]) -> str:
    """torch's backend string for a tdist device map: ``tdist-tcp``, or
    ``cpu:tdist-tcp,cuda:tdist-nccl`` when devices use different backends."""
    names = set(devices.values())
    if len(names) == 1:
        return torch_backend_name(names.pop())
    return ",".join(f"{device}:{torch_backend_name(name)}" for device, name in devices.items())


def is_mirrored(pg: Optional[ProcessGroup]) -> bool:
    """Whether torch.distributed's default group is ``pg``'s mirror."""
    return pg is not None and pg.torch_group is not None and pg.torch_group is torch_dist.GroupMember.WORLD


def mirror(pg: ProcessGroup) -> TorchProcessGroup:
    """The TorchProcessGroup of ``pg`` (made once); tdist's code is made ready for
    torch.compile (:func:`tdist._torch.dynamo.prepare`) and torch's ``shrink_group`` for
    tdist's groups (:mod:`tdist._torch.shrink`) first."""
    if pg.torch_group is None:
        prepare_for_compile()
        route_shrink_group()
        pg.torch_group = TorchProcessGroup(pg, torch_backend_string({d: s.name for d, s in pg.specs.items()}))
    return pg.torch_group


@contextlib.contextmanager
def adopting(pg: ProcessGroup) -> Iterator[None]:
    """While torch creates a group inside this block, the creator hands torch ``pg``."""
    global _adopting
    _adopting = pg
    try:
        yield
    finally:
        _adopting = None


def _check_bridgeable(name: str) -> None:
    spec = get_backend_spec(name)
    if spec.torch_bridge is not None:
        raise DistError(
            f"{torch_backend_name(name)}: tdist's backend {name!r} cannot serve torch.distributed: {spec.torch_bridge}"
        )


def _options(pg_options: Any) -> dict[str, Any]:
    if pg_options is None:
        return {}
    if not isinstance(pg_options, dict):
        raise TypeError(f"tdist backends take pg_options as a dict of backend options, got {type(pg_options).__name__}")
    return dict(pg_options)


def _devices_for(name: str) -> tuple[str, dict[str, str]]:
    """The display name and device map of a torch-made group of backend ``name``: the
    devices it serves, and for the others what tdist's default group uses (so a group
    torch makes under ``cpu:tdist-tcp,cuda:tdist-nccl`` gets both)."""
    devices = {device: name for device in get_backend_spec(name).devices}
    world = STATE.world
    if world is not None:
        for device, spec in world.specs.items():
            devices.setdefault(device, spec.name)
    if len(set(devices.values())) == 1:
        return name, devices
    return ",".join(f"{d}:{n}" for d, n in devices.items()), devices


def create_torch_group(name: str, opts: Any, pg_options: Any) -> TorchProcessGroup:
    """What torch's creator for ``tdist-<name>`` returns (see the module's docstring)."""
    pending = _adopting
    if pending is not None:
        return mirror(pending)
    register_torch_backends([name])
    _check_bridgeable(name)
    store = from_torch_store(opts.store)
    rank, size, timeout = int(opts.group_rank), int(opts.group_size), opts.timeout
    options = _options(pg_options)
    if not opts.global_ranks_in_group:  # torch's default group
        return _default_group(name, store, rank, size, timeout, options)
    ranks = [int(r) for r in opts.global_ranks_in_group]
    display, devices = _devices_for(name)
    join(store, "tdist/join", rank, range(size), timeout, backend=display)
    pg = _build_group(f"torch/{opts.group_id}", ranks, ranks[rank], devices, display, store, timeout, options)
    if is_mirrored(STATE.world):  # tdist's API accepts the groups torch makes on its world
        STATE.groups.append(pg)
    return mirror(pg)


def _default_group(name: str, store: Any, rank: int, size: int, timeout: Any, options: dict) -> TorchProcessGroup:
    """torch's default group: tdist's default group, made over torch's store (or tdist's
    own, when the program initialised tdist first without the bridge and the worlds agree)."""
    world = STATE.world
    if world is None:
        init_process_group(
            name, store=store, rank=rank, world_size=size, timeout=timeout, pg_options=options, torch_bridge=False
        )
        world = STATE.world
        assert world is not None
    elif (world.rank, world.size) != (rank, size) or world.backend_name != name:
        raise DistError(
            f"torch.distributed.init_process_group({torch_backend_name(name)!r}): tdist is already initialized as "
            f"rank {world.rank} of {world.size} on {world.backend_name!r}, torch asks for rank {rank} of {size}; "
            "call tdist.destroy_process_group() first"
        )
    return mirror(world)
