"""The tcp backend's factory: a group's connections, shared memory and hierarchy, then its :class:`TcpBackend`.

:func:`create_backend` (registered for ``tcp``) sets up the group's :class:`~tdist_tcp.mesh.Mesh`
(addresses exchanged through the store, the connections the ``connect`` option asks for),
its :class:`~tdist_tcp.transport.Transport`, learns which ranks share a host, and opens the
shared-memory segment (one host) or every host's segment for the hierarchical collectives
(several hosts).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from tdist.plugin import seconds

from .backend import TcpBackend
from .mesh import connect_mesh
from .shm import ShmEngine, open_shm, shm_enabled
from .topology import Layout, everyones, hierarchy_mode, host_id, host_layout
from .transport import Transport

if TYPE_CHECKING:
    from tdist.plugin import Store

__all__ = ["create_backend"]


def create_backend(
    *,
    store: "Store",
    rank: int,
    world_size: int,
    timeout: Any,
    options: Optional[Mapping] = None,
    global_ranks: Optional[Sequence[int]] = None,
    secret: bytes = b"",
    **_ignored: Any,
) -> TcpBackend:
    """The factory registered for ``tcp``: connect to the group's peers through ``store``;
    with a ``secret`` (the core derives it from the job's store token) every connection
    and the shared segment are authenticated with it."""
    options = dict(options or {})
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(seconds(timeout, 300.0)))  # type: ignore[arg-type]
    timeout_s = min(timeout.total_seconds(), 1e9)  # beyond that, "forever" (and lock waits overflow)
    if timeout_s <= 0:
        raise ValueError(f"tcp backend: timeout must be positive, got {timeout}")
    timeout = timedelta(seconds=timeout_s)
    secret = bytes(secret or b"")
    if world_size == 1:
        return TcpBackend(
            rank,
            world_size,
            timeout,
            Transport(rank, world_size, {}, timeout_s, global_ranks),
            options,
            authenticated=bool(secret),
        )
    mode, host = hierarchy_mode(options), host_id(options, rank)  # (bad options: an error before connecting)
    mesh = connect_mesh(store, rank, world_size, timeout_s, options, secret)
    transport = Transport(rank, world_size, {}, timeout_s, global_ranks, mesh)
    shm = host_shm = layout = None
    try:
        layout = host_layout(store, rank, world_size, mesh.nonce, timeout_s, host)
        if len(layout.hosts) == 1:
            shm = open_shm(store, rank, world_size, timeout_s, options, transport, mesh.nonce, mesh.key)
            layout = None
        elif mode == "off" or not layout.worth_it or not shm_enabled(options):
            layout = None
        else:
            layout, host_shm = _open_hosts(store, rank, world_size, timeout_s, options, transport, mesh, layout)
    except BaseException:
        for engine in (shm, host_shm):
            if engine is not None:
                engine.close()
        transport.close(0.0)
        raise
    return TcpBackend(
        rank, world_size, timeout, transport, options, shm, bool(secret), layout=layout, host_shm=host_shm
    )


def _open_hosts(
    store: "Store",
    rank: int,
    size: int,
    timeout: float,
    options: Mapping,
    transport: Transport,
    mesh: Any,
    layout: Layout,
) -> tuple[Optional[Layout], Optional[ShmEngine]]:
    """Every host's segment; the layout and this host's segment (None when alone on it) if
    every host with several ranks has its segment, else (None, None) on every rank."""
    deadline = time.monotonic() + timeout
    members = layout.hosts[layout.host_of(rank)]
    engine = None
    if len(members) > 1:
        index = members.index(rank)
        engine = open_shm(
            store, index, len(members), timeout, options, transport, mesh.nonce, mesh.key, members=members
        )
    ready = "1" if engine is not None or len(members) == 1 else "0"
    try:
        answers = everyones(
            store,
            f"tcp/hier/{mesh.nonce.hex()}/",
            rank,
            size,
            ready,
            deadline - time.monotonic(),
            "opening every host's shared memory",
        )
        agreed = all(v == b"1" for v in answers)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    if agreed:
        return layout, engine
    if engine is not None:
        engine.close()
    return None, None
