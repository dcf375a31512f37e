"""Setting up and tearing down: ``init_process_group``, ``new_group``,
``destroy_process_group`` and the backend availability queries."""

from __future__ import annotations

import urllib.parse
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

from . import _bridge as bridging
from ._backend import Backend, BackendSpec
from ._errors import DistError, DistStateError, NotInitializedAssertion
from ._failure import publish_process
from ._groups import STATE, GroupMember, ProcessGroup, resolve_group
from ._join import enter_incarnation, join
from ._plugins import plugins
from ._secret import secret_argument as _secret_argument
from ._store import PrefixStore
from ._store.base import Store, timeout_seconds

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "new_group",
    "is_available",
    "is_backend_available",
    "available_backends",
    "get_backend_spec",
    "default_pg_timeout",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "get_default_backend_for_device",
    "get_pg_count",
    "set_timeout",
    "get_backend_impl",
]

#: Default timeout of every blocking operation, as in torch.distributed.
default_pg_timeout = timedelta(minutes=30)
_PREFERRED_CPU_BACKENDS = ("tcp", "gloo", "mpi")


def is_available() -> bool:
    """Always True: the core is pure Python. Use :func:`is_backend_available` per backend."""
    return True


def get_backend_spec(name: str) -> BackendSpec:
    """The :class:`BackendSpec` registered under ``name``; a clear error when not installed."""
    registry = plugins()
    spec = registry.backends.get(name)
    if spec is None:
        raise DistError(registry.missing_backend_message(name))
    return spec


def is_backend_available(backend: str) -> bool:
    """Whether ``backend`` (a name) is installed and usable on this machine."""
    spec = plugins().backends.get(backend)
    return spec is not None and spec.available is None


def available_backends() -> list[str]:
    """The names of the installed backends that are usable here."""
    return [spec.name for spec in plugins().backends.specs() if spec.available is None]


def is_gloo_available() -> bool:
    """torch.distributed's spelling of ``is_backend_available("gloo")``."""
    return is_backend_available("gloo")


def is_mpi_available() -> bool:
    """torch.distributed's spelling of ``is_backend_available("mpi")``."""
    return is_backend_available("mpi")


def is_nccl_available() -> bool:
    """torch.distributed's spelling of ``is_backend_available("nccl")``."""
    return is_backend_available("nccl")


def get_default_backend_for_device(device: Any) -> str:
    """The backend ``init_process_group()`` without a backend uses for ``device``'s tensors
    (``"cpu"``, ``"cuda:1"`` or a ``torch.device``): a plugin's ``tdist_default_backend``
    choice, else for CPU the first available of tcp, gloo, mpi, else the first available
    backend serving that device type (in name order); a ValueError when there is none."""
    kind = device.type if hasattr(device, "type") else str(device).partition(":")[0]
    preferred = plugins().default_backend(kind)
    if preferred:
        return preferred
    candidates = _PREFERRED_CPU_BACKENDS if kind == "cpu" else ()
    serving = [spec.name for spec in plugins().backends.specs() if kind in spec.devices]
    for name in [*candidates, *sorted(serving)]:
        if is_backend_available(name) and kind in get_backend_spec(name).devices:
            return name
    raise ValueError(
        f"no available backend serves {kind} tensors (installed: {', '.join(plugins().backends.names()) or 'none'})"
    )


def get_pg_count() -> int:
    """How many process groups this process has created since ``init_process_group``, the
    default group and every ``new_group`` call (members or not) included; 0 before init."""
    return 0 if STATE.world is None else STATE.group_count + 1


def _parse_backend(backend: Optional[str]) -> tuple[str, dict[str, str]]:
    """``"tcp"`` or ``"cpu:tcp,cuda:nccl"`` -> (display name, {device: backend name}).

    A plain name serves every device its spec declares.
    """
    if backend is None:
        try:
            backend = get_default_backend_for_device("cpu")
        except ValueError:
            raise DistError(
                "init_process_group: no backend given and no default backend is available "
                f"(installed: {', '.join(plugins().backends.names()) or 'none'}); pip install tdist-tcp"
            ) from None
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a non-empty string, got {backend!r}")
    backend = backend.lower()
    if ":" not in backend:
        spec = _usable_spec(backend)
        return backend, {device: backend for device in spec.devices}
    mapping: dict[str, str] = {}
    for part in backend.split(","):
        device, sep, name = part.partition(":")
        if not sep or not device.strip() or not name.strip():
            raise ValueError(
                f"backend {backend!r}: expected 'device:backend[,device:backend]', e.g. 'cpu:tcp,cuda:nccl'"
            )
        mapping[device.strip()] = name.strip()
    return backend, mapping


def _usable_spec(name: str) -> BackendSpec:
    spec = get_backend_spec(name)
    if spec.available is not None:
        raise DistError(f"backend {name!r} is installed but unavailable: {spec.available}")
    return spec


def _check_rank_args(rank: int, world_size: int, zero_is_unset: bool = False) -> None:
    """Validate rank/world_size. ``zero_is_unset``: before the rendezvous, world_size 0
    means "not given" (as the tutorial passes under mpirun); the rendezvous decides."""
    lowest = 0 if zero_is_unset else 1
    if not isinstance(world_size, int) or (world_size != -1 and world_size < lowest):
        raise ValueError(f"init_process_group: world_size must be a positive integer (or -1), got {world_size!r}")
    if not isinstance(rank, int) or rank < -1:
        raise ValueError(f"init_process_group: rank must be a non-negative integer (or -1), got {rank!r}")
    if world_size > 0 and rank >= world_size:
        raise ValueError(
            f"init_process_group: rank {rank} is out of range for world_size {world_size} (0..{world_size - 1})"
        )


def _rendezvous(
    init_method: str, rank: int, world_size: int, timeout: timedelta, group_name: str
) -> tuple[Store, int, int]:
    url = urllib.parse.urlsplit(init_method)
    if not url.scheme:
        raise ValueError(
            f"init_method {init_method!r} has no scheme: expected e.g. env://, tcp://host:port, file:///path"
        )
    handler = plugins().rendezvous.get(url.scheme)
    if handler is None:
        known = ", ".join(f"{s}://" for s in plugins().rendezvous.schemes()) or "none"
        raise ValueError(f"init_method {init_method!r}: no rendezvous handler for {url.scheme}:// (installed: {known})")
    store, rank, world_size = handler(
        url, rank=rank, world_size=world_size, timeout=timeout.total_seconds(), group_name=group_name
    )
    _check_rank_args(rank, world_size)
    return store, rank, world_size


def _build_group(
    name: str,
    ranks: list[int],
    rank: int,
    devices: dict[str, str],
    display: str,
    store: Store,
    timeout: timedelta,
    options: dict[str, Any],
    derive: Optional[Callable[[str, Store], Optional[Backend]]] = None,
) -> ProcessGroup:
    """The group ``name`` of global ``ranks`` (this process is global rank ``rank``): one
    backend instance per distinct backend name in ``devices``, each built by its factory
    over the group's prefixed store -- or by ``derive(backend_name, backend_store)`` where
    that returns one (``shrink_group``: a backend made from the old group's)."""
    group_store = PrefixStore(name, store)
    backends: dict[str, Backend] = {}
    specs: dict[str, BackendSpec] = {}
    by_name: dict[str, Backend] = {}
    try:
        for device, backend_name in devices.items():
            spec = _usable_spec(backend_name)
            if device not in spec.devices:
                raise DistError(
                    f"backend {backend_name!r} does not serve {device} tensors (it serves {', '.join(spec.devices)})"
                )
            if backend_name not in by_name:
                backend_store = PrefixStore(backend_name, group_store)
                derived = derive(backend_name, backend_store) if derive is not None else None
                by_name[backend_name] = derived or spec.factory(
                    store=backend_store,
                    rank=ranks.index(rank),
                    world_size=len(ranks),
                    timeout=timeout,
                    options=dict(options),
                    global_ranks=list(ranks),
                    **_secret_argument(spec.factory, store, backend_name),
                )
            backends[device] = by_name[backend_name]
            specs[device] = spec
        publish_process(group_store, ranks.index(rank))  # for the failure agreement (tdist._failure)
    except BaseException:
        for backend in by_name.values():
            backend.shutdown()
        raise
    return ProcessGroup(name, ranks, ranks.index(rank), backends, specs, group_store, timeout, display, options)


def init_process_group(
    backend: Optional[str] = None,
    init_method: Optional[str] = None,
    timeout: Optional[timedelta] = None,
    world_size: int = -1,
    rank: int = -1,
    store: Optional[Store] = None,
    group_name: str = "",
    pg_options: Optional[dict[str, Any]] = None,
    device_id: Any = None,
    enable_reconfigure: bool = False,
    torch_bridge: Optional[bool] = None,
) -> None:
    """Initialise the default process group; blocks until every rank has joined.

    ``backend``: a backend name (``"tcp"``, ``"gloo"``, ``"mpi"``, ``"nccl"``, ...) or a
    per-device map such as ``"cpu:tcp,cuda:nccl"``; None picks an installed one.
    ``init_method``: ``env://`` (default), ``tcp://host:port``, ``file:///path`` or any
    scheme a plugin registers; mutually exclusive with ``store``. ``timeout`` bounds
    every blocking operation (default 30 minutes). ``group_name`` lets several jobs
    share one rendezvous (file path or address). ``pg_options`` are passed to the
    backend factories, with ``device_id`` (the device this rank uses, which lets a
    GPU backend connect eagerly) added as ``pg_options["device_id"]`` when given.
    ``enable_reconfigure`` (torch 2.15's) is accepted and ignored, as torch's backends
    without a reconfigure regime ignore it.

    ``torch_bridge`` (default: on unless ``TDIST_TORCH_BRIDGE=0``): also make this group
    torch.distributed's default group, so torch's utilities (DDP, DistributedSampler,
    FSDP, DCP, ...) use it; if the program initialized torch.distributed itself, tdist
    leaves it alone (and warns once), or raises ValueError when torch's world differs.
    """
    if STATE.world is not None:
        raise DistStateError("init_process_group: already initialized; call tdist.destroy_process_group() first")
    if timeout is None:
        timeout = default_pg_timeout
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    timeout_seconds(timeout, 0.0, "init_process_group")  # a timeout too large to wait for: ValueError now
    _check_rank_args(rank, world_size, zero_is_unset=store is None)
    options = dict(pg_options or {})
    if device_id is not None:
        options["device_id"] = device_id
    display, devices = _parse_backend(backend)
    bridge_wanted = bridging.wanted(torch_bridge)
    bridge = bridge_wanted and bridging.installed().torch_is_free(rank, world_size)
    if store is not None:
        if init_method is not None:
            raise ValueError("init_process_group: pass either init_method or store, not both")
        if rank < 0 or world_size < 0:
            raise ValueError("init_process_group: rank and world_size are required when a store is given")
    else:
        if init_method is None:
            init_method = _default_init_method(devices)
        store, rank, world_size = _rendezvous(init_method, rank, world_size, timeout, group_name)
    try:
        if bridge_wanted:  # again, now that rank and world size are known
            bridge = bridging.installed().torch_is_free(rank, world_size)
        store = enter_incarnation(store, rank, world_size, timeout)  # owns the rendezvous' store
        join(store, "tdist/init", rank, range(world_size), timeout, backend=display)
        world = _build_group("pg0", list(range(world_size)), rank, devices, display, store, timeout, options)
    except BaseException:
        store.close()
        raise
    STATE.world = world
    STATE.groups = [world]
    STATE.store = store
    STATE.group_count = 0
    STATE.backend_name = display
    STATE.options = options
    _announce(plugins().group_created, world)
    if bridge:
        try:
            bridging.installed().mirror_world(world)
        except BaseException:
            destroy_process_group()
            raise


def _default_init_method(devices: dict[str, str]) -> str:
    for name in devices.values():
        method = get_backend_spec(name).default_init_method
        if method:
            return method
    return "env://"


def new_group(
    ranks: Optional[Sequence[int]] = None,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Optional[dict[str, Any]] = None,
    use_local_synchronization: bool = False,
    group_desc: Optional[str] = None,
    device_id: Any = None,
    sort_ranks: bool = True,
) -> Any:
    """Create a group of the global ``ranks`` (default: all). Every rank of the world
    must call ``new_group`` in the same order, members or not; non-members get
    ``GroupMember.NON_GROUP_MEMBER``. With ``use_local_synchronization``, only the
    members call it (each creating the groups of one set of ranks in the same order);
    a non-member's call returns at once. ``backend`` defaults to the world's; ``device_id``
    is passed to the backends as ``pg_options["device_id"]``, as for init_process_group.
    Group ranks follow the global ranks' order; with ``sort_ranks=False`` they follow
    the order of ``ranks`` instead (``ranks[i]`` is group rank ``i``)."""
    world = resolve_group(None)
    assert world is not None and STATE.store is not None
    if ranks is None:
        members = list(range(world.size))
    else:
        members = sorted(ranks) if sort_ranks else list(ranks)
        if len(set(members)) != len(members):
            raise ValueError(f"new_group: ranks contain duplicates: {list(ranks)}")
        bad = [r for r in members if not isinstance(r, int) or not 0 <= r < world.size]
        if bad:
            raise ValueError(f"new_group: rank(s) {bad} out of range for world size {world.size}")
        if not members:
            raise ValueError("new_group: ranks is empty")
    display, devices = _parse_backend(backend) if backend else (world.backend_name, _same_devices(world))
    if use_local_synchronization:
        if world.rank not in members:
            return GroupMember.NON_GROUP_MEMBER
        name = _local_group_name(members)
    else:
        STATE.group_count += 1
        name = f"pg{STATE.group_count}"
        if world.rank not in members:
            bridging.installed().mirror_new_group(None, members, devices, group_desc)
            return GroupMember.NON_GROUP_MEMBER
    timeout = timeout or world.timeout
    join(STATE.store, f"tdist/{name}", world.rank, members, timeout, backend=display)
    options = {**STATE.options, **(pg_options or {})}
    if device_id is not None:
        options["device_id"] = device_id
    pg = _build_group(name, members, world.rank, devices, display, STATE.store, timeout, options)
    STATE.groups.append(pg)
    _announce(plugins().group_created, pg)
    bridging.installed().mirror_new_group(pg, members, devices, group_desc, local=use_local_synchronization)
    return pg.handle


#: How many groups of each set of ranks this process made with use_local_synchronization.
_local_groups: dict[tuple[int, ...], int] = {}


def _local_group_name(members: Sequence[int]) -> str:
    """The name of a group only its ``members`` create: the same on each of them (they
    make the groups of one set of ranks in the same order), unlike every other's."""
    key = tuple(members)
    _local_groups[key] = _local_groups.get(key, 0) + 1
    return f"local-{'.'.join(map(str, key))}-{_local_groups[key]}"


def _announce(hook: Any, pg: ProcessGroup) -> None:
    """Tell the group hooks (``tdist_group_created`` / ``_destroyed``) about ``pg``."""
    hook(name=pg.name, ranks=pg.ranks, rank=pg.ranks[pg.rank], backend=pg.backend_name)


def _same_devices(pg: ProcessGroup) -> dict[str, str]:
    """``pg``'s backend name per device type, for a group made like it."""
    return {device: spec.name for device, spec in pg.specs.items()}


def destroy_process_group(group: Any = None) -> None:
    """Shut down ``group``'s backends; with no argument, every group and the default
    one, after which ``init_process_group`` may be called again."""
    if group is GroupMember.NON_GROUP_MEMBER:
        return
    if group is None and STATE.world is None:
        raise NotInitializedAssertion("destroy_process_group: the default process group is not initialized")
    pg = resolve_group(group)
    if group is not None and pg is not STATE.world:
        assert pg is not None
        STATE.groups.remove(pg)
        _announce(plugins().group_destroyed, pg)
        pg.shutdown()
        bridging.installed().forget(pg)
        return
    groups, store = STATE.groups, STATE.store
    STATE.reset()
    _local_groups.clear()
    for pg in reversed(groups):
        _announce(plugins().group_destroyed, pg)
        pg.shutdown()
    bridging.installed().forget_all(groups)
    if store is not None:
        store.close()


def set_timeout(timeout: timedelta, group: Any = None) -> None:
    """Operations issued on ``group`` (default: the default group) from now on time out
    after ``timeout`` instead of the timeout it was created with; every backend of the
    group is told (:meth:`tdist.plugin.Backend.set_timeout`)."""
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"set_timeout: timeout must be a positive timedelta, got {timeout!r}")
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("set_timeout: this rank is not a member of the group")
    pg.timeout = timeout
    for backend in pg.distinct_backends():
        backend.set_timeout(timeout)


def get_backend_impl(group: Any = None, device: Any = None) -> Backend:
    """The backend object (a :class:`tdist.plugin.Backend`) that runs ``group``'s
    operations on ``device`` (a device, its type, or None: the group's one backend).
    ``group`` may also be given by name. Backend methods beyond the contract are the
    backend's own business."""
    if isinstance(group, str):
        named = [pg for pg in (STATE.world, *STATE.groups) if pg is not None and group in _names_of(pg)]
        if not named:
            raise ValueError(f"get_backend_impl: no process group named {group!r} on this rank")
        group = named[0]
    pg = resolve_group(group)
    if pg is None:
        raise ValueError("get_backend_impl: this rank is not a member of the group")
    if device is not None:
        kind = device if isinstance(device, str) else getattr(device, "type", str(device))
        kind = kind.split(":")[0]
        if kind not in pg.backends:
            raise ValueError(
                f"get_backend_impl: group {pg.name!r} has no backend for {kind!r} (it has {sorted(pg.backends)})"
            )
        return pg.backends[kind]
    distinct = pg.distinct_backends()
    if len(distinct) > 1:
        raise ValueError(
            f"get_backend_impl: group {pg.name!r} has a backend per device type ({sorted(pg.backends)}); pass device"
        )
    return distinct[0]


def _names_of(pg: ProcessGroup) -> set[str]:
    """``pg``'s own name and its torch mirror's."""
    mirror = pg.torch_group
    return {pg.name} if mirror is None else {pg.name, mirror.group_name}
