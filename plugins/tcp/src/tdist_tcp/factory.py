"""The tcp backend's factory: a group's connections, shared memory and hierarchy, then its :class:`TcpBackend`.

:func:`create_backend` (registered for ``tcp``) listens, takes part in the group's setup
through the store (:mod:`tdist_tcp.net.roster`: one record per rank, gathered by rank 0, whose
answer gives every rank the group's layout), makes the connections the ``connect`` option
asks for at setup (:class:`~tdist_tcp.net.mesh.Mesh`), builds the group's
:class:`~tdist_tcp.net.transport.Transport`, and uses shared memory where the layout allows:
rank 0's segment, offered in its record, when the whole group shares one host; every
host's own segment for the hierarchical collectives when it spans several.
"""

from __future__ import annotations

import mmap
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Sequence

from tdist.plugin import DistBackendTimeoutError, seconds

from .net import roster, tally

from .shared import segment
from .protocol import tls as _tls
from .protocol.auth import group_key
from .backend import TcpBackend
from .net.connect import _Auth
from .net.mesh import Mesh, connect_mode, open_listeners, stream_count
from .shared.shm import ShmEngine, make_offer, open_shm, shm_enabled, take_offer
from .shared.topology import Layout, hierarchy_mode, host_id
from .net.transport import Transport

if TYPE_CHECKING:
    from tdist.plugin import Store

__all__ = ["create_backend", "OFFER_MAX_RANKS"]

#: the largest group to which rank 0 offers a segment in its record, before it knows whether
#: the group shares one host (the segment is sized for every rank; beyond, a group of one
#: host sets its segment up afterwards, in a second exchange: :func:`tdist_tcp.shared.shm.open_shm`)
OFFER_MAX_RANKS = 512


class _Mapped(NamedTuple):
    """Rank 0's segment as this rank mapped it (or created it, on rank 0)."""

    mm: mmap.mmap
    slot: int
    direct: int


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
    mesh, answer, mapped = _set_up(store, rank, world_size, timeout_s, options, secret, host)
    transport = Transport(rank, world_size, {}, timeout_s, global_ranks, mesh)
    shm = host_shm = None
    layout: Optional[Layout] = answer.layout
    try:
        if mapped is not None:  # the group shares one host, and every rank mapped rank 0's segment
            shm = ShmEngine(mapped.mm, rank, world_size, mapped.slot, transport, options, mapped.direct)
            mapped = None
            layout = None
        elif len(answer.layout.hosts) == 1:
            if world_size > OFFER_MAX_RANKS:  # no offer made: the second exchange
                shm = open_shm(store, rank, world_size, timeout_s, options, transport, mesh.nonce, mesh.key)
            layout = None
        elif mode == "off" or not answer.layout.worth_it or not shm_enabled(options):
            layout = None
        else:
            layout, host_shm = _open_hosts(store, rank, world_size, timeout_s, options, transport, mesh, answer.layout)
    except BaseException:
        for engine in (shm, host_shm):
            if engine is not None:
                engine.close()
        if mapped is not None:
            mapped.mm.close()
        transport.close(0.0)
        raise
    return TcpBackend(
        rank, world_size, timeout, transport, options, shm, bool(secret), layout=layout, host_shm=host_shm
    )


def _set_up(
    store: "Store", rank: int, size: int, timeout: float, options: Mapping[str, Any], secret: bytes, host: str
) -> tuple[Mesh, roster.Answer, Optional[_Mapped]]:
    """Listen, take part in the group's setup (:mod:`tdist_tcp.net.roster`) and make the
    connections made at setup, within ``timeout`` seconds: the group's mesh, rank 0's
    answer, and rank 0's segment as mapped here when the group uses it (else None)."""
    deadline = time.monotonic() + timeout
    mode = connect_mode(options)
    stream_count(options)  # (a bad option: an error before anything is opened)
    tls = _tls.mesh_tls(options, f"tcp backend rank {rank}")
    listeners, me = open_listeners(store, rank, size, options)
    mesh: Optional[Mesh] = None
    offer = None
    mm: Optional[mmap.mmap] = None
    slot = direct = 0
    try:
        if rank == 0:
            nonce = os.urandom(16)
            mesh = Mesh(store, 0, size, _Auth(nonce, group_key(secret, nonce), bool(secret)), listeners, options, tls)
            mesh.acceptor.start()
            if size <= OFFER_MAX_RANKS:
                offer = make_offer(size, options, nonce, mesh.key)
            if offer is not None:
                mm, slot, direct = offer.mm, offer.slot, offer.direct
            mine = roster.Record(me, host, nonce=nonce, offer=offer.text if offer is not None else "")
            roster.publish(store, 0, mine)
            answer = roster.gather(store, size, mine, deadline - time.monotonic(), offer is not None)
            if offer is not None:
                segment.close_fd(offer.fd)  # everyone has mapped it, or given up: the mappings hold the memory
                offer = None
            mesh.learn(answer.records)
            mesh.connect_at_setup(mode, deadline, timeout)
        else:
            first = roster.first_record(store, rank, deadline - time.monotonic())
            auth = _Auth(first.nonce, group_key(secret, first.nonce), bool(secret))
            mesh = Mesh(store, rank, size, auth, listeners, options, tls)
            mesh.acceptor.start()
            mesh.learn({0: first})
            said = ""
            if first.offer and first.host == host:  # rank 0's host is this rank's: map its segment
                mm, slot, direct = take_offer(first.offer, rank, size, options, first.nonce, mesh.key, rank)
                said = "1" if mm is not None else "0"
            roster.publish(store, rank, roster.Record(me, host, said))
            mesh.connect_at_setup(mode, deadline, timeout)  # meanwhile rank 0 gathers the records
            answer = roster.answer(store, rank, size, deadline - time.monotonic())
    except BaseException:
        if offer is not None:
            segment.close_fd(offer.fd)
        if mm is not None:
            mm.close()
        if mesh is not None:
            mesh.close()
        else:
            for listener in listeners:
                listener.close()
        raise
    if mm is not None and not answer.shm:
        mm.close()
        mm = None
    return mesh, answer, _Mapped(mm, slot, direct) if mm is not None else None


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
    try:
        ready = engine is not None or len(members) == 1
        agreed = _every_host_ready(store, f"tcp/hier/{mesh.nonce.hex()}/", rank, layout, ready, deadline)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    if agreed:
        return layout, engine
    if engine is not None:
        engine.close()
    return None, None


def _every_host_ready(store: "Store", prefix: str, rank: int, layout: Layout, ready: bool, deadline: float) -> bool:
    """Whether every host has its segment (the same answer on every rank): each host's first
    rank says whether its host's is up (:func:`~tdist_tcp.shared.shm.open_shm`'s verdict is its
    members' alike), rank 0 counts the hosts' words and answers for all (:mod:`tdist_tcp.net.tally`)."""
    leaders = list(layout.leaders())
    keys = [prefix + str(r) for r in leaders]
    timeout = max(0.01, deadline - time.monotonic())

    def no_answer(missing: list[int]) -> DistBackendTimeoutError:
        return DistBackendTimeoutError(
            f"tcp backend: rank {rank} timed out after {timeout:g} s opening every host's shared memory: "
            f"ranks {missing} did not answer"
        )

    if rank in leaders:
        store.set(prefix + str(rank), "1" if ready else "0")
    if rank == 0:
        return tally.count(store, keys, leaders, prefix + "agreed", deadline, True, no_answer)
    return tally.hear(store, keys, leaders, prefix + "agreed", deadline, 0, no_answer)
