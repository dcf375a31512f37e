"""``shrink_group`` on tcp: the survivors' group made from the old group's connections,
listeners and shared memory, with nothing exchanged through the store.

:func:`shrink` runs on every survivor once they agreed on who stays (the core's
``_agree``); every step below is decided from what all of them know alike (the
survivors, the old group's layout and options), so they all reuse or none does:

1. **The old group stops.** Its pending and later operations fail (on this rank; every
   survivor does the same), its transport connects and accepts no more, and once no
   collective of it runs on the shared segment any more (woken by the broken transport,
   waited for up to the group's timeout) it never touches the segment again.
2. **Connections.** Each link to a survivor goes to the new transport, renumbered: this
   rank sends a MARK frame on it (after the rest of any frame cut short), the first
   frame of the new *epoch*; the peer's frames count for the new group only after the
   peer's MARK (:mod:`tdist_tcp.net.links`), so a frame of the old group -- a collective step
   a survivor sent before the failure, stashed or still in the socket -- is dropped,
   never matched to the new group's operation with the same sequence number. A link to
   an excluded rank gets an ABORT ("excluded by shrink_group") and is closed: an excluded
   rank, dead or alive, keeps nothing.
3. **Listeners.** The new group keeps the listening sockets and addresses; its
   handshakes prove a key derived from the old group's (so only holders of the job's
   secret, which proved it to the old group, can join) under a nonce derived from the
   old group's, the epoch and the survivors: a connection still opened by the old group
   is refused, and a connection the new group makes lazily (a pair of survivors that
   was never connected, with ``connect`` = ``ring`` or ``lazy``) belongs to it alone. TLS
   links stay as they are, new ones use the same certificates.
4. **Shared memory** (:meth:`tdist_tcp.shared.shm.ShmEngine.successor`): the survivors on a host
   keep their slots of the segment (control block and buffers), those of the lost ranks
   are never read again; the C part takes each member's slot. The new epoch starts
   with a fence in the segment (every survivor there publishes that it is out of the old
   group) and a counter base half the counter space away, so neither an old step still
   waited for (by an excluded rank that is alive) nor a lost rank's stale counter is ever
   taken for a new step. A hierarchical group keeps each host's segment for that host's
   survivors; when they all end up on one host, that segment becomes the whole group's.

Where reuse is impossible it returns None and the core builds the group through the
store, as for any new group: a group of one (no connection needed), options that change
the connections or the shared memory (``pg_options`` of ``shrink_group``), or a member
that aborted the old group (``group.abort()`` released its connections; it says so in
the old group's store, one key, which every survivor reads). A survivor that cannot
finish (its old collective stuck in a computation past the timeout, a survivor on its
host that never comes to the fence) raises; the others then fail on it as on a lost rank.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from tdist.plugin import DistBackendError

from .protocol.auth import group_key
from .net.connect import _Auth
from .net.ioloop import io_loop
from .net.links import Link, close_links, send_control
from .net.mesh import Mesh
from .shared.topology import Layout
from .net.transport import Transport
from .protocol.wire import ABORT, pack_header

if TYPE_CHECKING:
    from .backend import TcpBackend
    from .shared.shm import ShmEngine

__all__ = ["shrink", "Successor", "forbid_reuse", "FORBID_KEY", "LOCAL_OPTIONS"]

#: set in a group's store by a member that aborted it: its successor cannot reuse its connections
FORBID_KEY = "tcp/shrink/no-reuse"
#: options a shrunken group may change and still reuse the old group's connections and segment
LOCAL_OPTIONS = frozenset(
    {"connect", "native", "cma", "ring_threshold", "segment_bytes", "grace", "linger", "shm_spin_us"}
)
_MARK_LIMIT = 30.0  # seconds at most to send a link's MARK (a frame of the old group may be going out)


def forbid_reuse(tr: Transport) -> None:
    """Say in the group's store that a shrink cannot reuse its connections (this rank is
    about to release them: ``group.abort()``), so that every survivor builds anew."""
    mesh = tr.mesh
    if mesh is not None:
        try:
            mesh.store.set(FORBID_KEY, "1")
        except Exception:  # noqa: BLE001 - the store is gone: so is any shrink
            pass


@dataclass(frozen=True)
class Successor:
    """What the survivors' backend is made of (``TcpBackend`` builds itself from it)."""

    rank: int
    size: int
    transport: Transport
    engine: Optional["ShmEngine"]  # the whole group's segment, or this host's when hierarchical
    layout: Optional[Layout]  # the ranks by host when hierarchical
    host_engine: Optional["ShmEngine"]


def shrink(
    old: "TcpBackend", survivors: Sequence[int], store: Any, global_ranks: Sequence[int], options: Mapping[str, Any]
) -> Optional[Successor]:
    """The parts of ``old``'s group without the ranks not in ``survivors`` (see the
    module), or None (the same on every survivor) where they cannot be made from ``old``."""
    tr, mesh = old._tr, old._tr.mesh
    survivors = list(survivors)
    if len(survivors) < 2 or mesh is None or tr.retired or old._shut or _changed(old._options, options):
        return None
    if mesh.store.check([FORBID_KEY]):
        return None
    rank, size, epoch = survivors.index(old.rank), len(survivors), tr.epoch + 1
    deadline = time.monotonic() + old._timeout_s
    new_mesh = _successor_mesh(mesh, store, survivors, rank, epoch, options)
    new_tr = Transport(rank, size, {}, old._timeout_s, global_ranks, new_mesh, epoch)
    error = DistBackendError(f"tcp backend: {tr.me}'s process group was shrunk: use the new group")
    taken = tr.retire(error, new_tr, {r: i for i, r in enumerate(survivors)})
    engine = host_engine = None
    try:
        _quiesce(old)
        new_mesh.acceptor.start()  # the listeners' handler is now the new group's acceptor
        _retire_acceptor(mesh)
        _hand_links(taken, survivors, new_tr, tr)
        layout = old._hier.layout if old._hier is not None else None
        if old._shm is not None:  # the whole group's segment
            engine = old._shm.successor(survivors, new_tr, options, epoch, deadline)
        elif old._hier is not None:
            layout, engine, host_engine = _hosts(old, survivors, new_tr, options, epoch, deadline)
    except BaseException:
        new_tr.close(0.0)
        _close([link for links in taken.values() for link in links if link.sender is tr], None)
        for e in (engine, host_engine):
            if e is not None:
                e.close(unmap=False)
        raise
    old._shm = old._hier = None  # (handed over: the old backend's shutdown leaves them alone)
    return Successor(rank, size, new_tr, engine, layout, host_engine)


def _changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether the options change what the connections or the segment are."""
    keys = (set(before) | set(after)) - LOCAL_OPTIONS
    return any(before.get(k) != after.get(k) for k in keys)


def _quiesce(old: "TcpBackend") -> None:
    """Make sure no collective of the old group runs, or will run, on its segment: the
    transport is retired (broken: a waiter wakes and fails), later collectives refuse, and
    the one in progress, if any, is waited for (up to the timeout, then an error)."""
    old._retired = True  # (then _in_collective: the collectives set them in the other order)
    if not old.uses_shm:
        return
    deadline = time.monotonic() + old._timeout_s
    while old._in_collective and time.monotonic() < deadline:
        time.sleep(0.001)
    if old._in_collective:
        raise DistBackendError(
            f"tcp backend: {old._tr.me} cannot shrink its group: a collective of the old group is still running on "
            f"its shared memory after {old._timeout_s:g} s"
        )


def _successor_mesh(
    mesh: Mesh, store: Any, survivors: list[int], rank: int, epoch: int, options: Mapping[str, Any]
) -> Mesh:
    """The new group's mesh on the old one's listeners and addresses, renumbered, with the
    epoch's nonce and key (derived: the same on every survivor, unknown to anyone who does
    not hold the old group's key)."""
    tag = b"tdist-tcp shrink %d %s" % (epoch, ",".join(map(str, survivors)).encode())
    nonce = hashlib.sha256(mesh.nonce + tag).digest()[:16]
    auth = _Auth(nonce, group_key(mesh.key, nonce), mesh.auth.has_token)
    new = Mesh(store, rank, len(survivors), auth, mesh.acceptor.listeners, options, mesh.tls)
    new.addresses = {i: mesh.addresses[r] for i, r in enumerate(survivors) if r in mesh.addresses}
    new.directory = lambda peer, deadline: mesh.address(survivors[peer], deadline)  # the old group's records
    return new


def _retire_acceptor(mesh: Mesh) -> None:
    """Close the old group's handshakes in progress, but not the listeners (the new group's
    acceptor serves them from now on)."""
    io_loop().sync()  # the loop no longer calls the old listeners' handler
    mesh.acceptor.listeners = []
    mesh.close()


def _hand_links(taken: dict[int, list[Link]], survivors: list[int], new_tr: Transport, old_tr: Transport) -> None:
    """Give each survivor's links to ``new_tr`` (MARK first); close the others, telling an
    excluded rank why."""
    index = {r: i for i, r in enumerate(survivors)}
    for q, links in taken.items():
        if q in index and all(not link.ended.is_set() for link in links):
            if new_tr.adopt(index[q], links, min(_MARK_LIMIT, old_tr.timeout)):
                continue
            _close(links, None)
        elif q in index:
            _close(links, None)  # ended: the new group connects anew if it needs this peer
        else:
            _close(links, f"{old_tr.me} shrank the group without {old_tr.label(q)} (shrink_group excluded it)")


def _close(links: Sequence[Link], reason: Optional[str]) -> None:
    """Close ``links`` (sending an ABORT with ``reason`` first, if any)."""
    if reason is not None:
        payload = json.dumps({"reason": reason, "timeout": False, "missing": []}).encode()
        frame = pack_header(ABORT, 0, 0, 0, 0, 0, len(payload)) + payload
        for link in links:
            send_control(link, frame, 0.5)
    close_links(links, DistBackendError("tcp backend: the connection was closed by shrink_group"))


def _hosts(
    old: "TcpBackend",
    survivors: list[int],
    new_tr: Transport,
    options: Mapping[str, Any],
    epoch: int,
    deadline: float,
) -> tuple[Optional[Layout], Optional["ShmEngine"], Optional["ShmEngine"]]:
    """A hierarchical group's successor: (layout, the whole group's engine, this host's
    engine). Each host keeps its segment for its survivors; when they are all on one host,
    its segment becomes the whole group's; where the hierarchy no longer pays off (every
    host holds one survivor), the flat algorithms."""
    hier = old._hier
    assert hier is not None
    index = {r: i for i, r in enumerate(survivors)}
    hosts = sorted(tuple(index[r] for r in members if r in index) for members in hier.layout.hosts)
    layout = Layout(tuple(h for h in hosts if h))
    keep = [m for m, r in enumerate(hier.local) if r in index]  # this host's survivors, as members here
    engine = hier.shm
    if engine is None or len(keep) < 2:  # alone on this host now
        if engine is not None:
            engine.close()
        return (layout if layout.worth_it else None), None, None
    if len(layout.hosts) == 1:  # everyone on this host: its segment is the whole group's
        return None, engine.successor(keep, new_tr, options, epoch, deadline), None
    ranks = [index[hier.local[m]] for m in keep]
    return layout, None, engine.successor(keep, new_tr, options, epoch, deadline, ranks)
