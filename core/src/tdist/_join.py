"""How the ranks of a group meet in the store: the world's incarnation, then the join.

**Incarnations.** Every ``init_process_group`` starts a new incarnation of the world:
rank 0 publishes a fresh random id with its world size under :data:`INCARNATION_KEY`,
and every key of that world (the join, the backends' addresses and nonces, the torch
bridge's) lives under ``tdist/world/<id>/``. Every other rank takes the first id that
is not the one it joined last. So after ``destroy_process_group`` a rank never joins
the previous incarnation: neither its keys in a store that outlives it (tdistrun's,
torchrun's agent store, a file) nor rank 0's previous store, which may still serve
while rank 0 tears its world down. That store goes away under the rank, which then
reconnects until it reaches rank 0's new one.

**The join.** Each rank claims ``<key>/joined/<rank>`` atomically (a second process
started with the same rank finds the claim taken). The first member waits for every
claim (one ``wait`` on all of them), reads them (one ``multi_get``), compares what they
named (the backend) and publishes the verdict, ``ok`` or what is wrong; the other members
wait for the verdict (one blocking ``get``): the verdict comes out only once every claim
is in. So a join costs a member two store round trips and the first member four,
whatever the group's size. A rank that finds something wrong on its own (its world size
is not rank 0's, its rank is claimed already) publishes the verdict itself, unless one is
out, and writes a marker into the claims still missing, so that every rank waiting in
the join wakes at once, reads the verdict and raises it: nobody waits out the timeout.
The first member (rank 0, who may host the store) raises only once the others have read
the verdict, or after :data:`VERDICT_GRACE_S`. A rank whose wait times out names the
ranks whose claims are missing.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from datetime import timedelta
from typing import NoReturn, Optional, Sequence

from ._errors import DistError, DistNetworkError, DistStoreTimeoutError
from ._oserror import noted
from ._rendezvous.common import Poll
from ._store import PrefixStore
from ._store.base import Store

__all__ = ["INCARNATION_KEY", "WORLD_PREFIX", "VERDICT_GRACE_S", "enter_incarnation", "join"]

#: Where rank 0 publishes the incarnation it starts: ``"<id> <world size>"``.
INCARNATION_KEY = "tdist/incarnation"
#: The keys of incarnation ``<id>`` live under ``tdist/world/<id>/``.
WORLD_PREFIX = "tdist/world"
#: How long the first member, having a verdict other than ``ok``, waits for the others
#: to read it before it raises (and its store may close).
VERDICT_GRACE_S = 10.0
#: Written into the claims still missing when a join fails: wakes the ranks waiting for them.
_WOKEN = b"\x00tdist-join-failed"
_OK = b"ok"

_last_incarnation: Optional[str] = None  # the incarnation this process joined last


def enter_incarnation(store: Store, rank: int, world_size: int, timeout: timedelta) -> Store:
    """The store of a new incarnation of the world, owning ``store`` (see the module's
    docstring): rank 0 starts it, the others wait for it. A rank whose world size is not
    rank 0's raises DistError, and so does every rank waiting in the join."""
    global _last_incarnation
    if rank == 0:
        ident, first_size = secrets.token_hex(8), world_size
        store.set(INCARNATION_KEY, f"{ident} {world_size}")
    else:
        ident, first_size = _await_incarnation(store, rank, world_size, timeout)
    _last_incarnation = ident
    world = PrefixStore(f"{WORLD_PREFIX}/{ident}", store, owns=True)
    if first_size != world_size:
        _fail(
            world,
            "tdist/init",
            rank,
            [rank],
            f"init_process_group: the ranks disagree on the world size: rank {rank} was started with "
            f"world_size {world_size}, rank 0 with {first_size} (check WORLD_SIZE or world_size= on every rank)",
            range(max(first_size, world_size)),
            timeout,
        )
    return world


def _await_incarnation(store: Store, rank: int, world_size: int, timeout: timedelta) -> tuple[str, int]:
    """The id and world size of the incarnation rank 0 started, not the one this process
    joined last; rank 0's previous store going away meanwhile is waited out."""
    poll = Poll(timeout.total_seconds(), first=0.005, longest=0.05)
    stale, lost = False, ""
    while True:
        try:
            value = store.get(INCARNATION_KEY, timeout=max(poll.remaining, 0.001))
        except DistStoreTimeoutError:
            break
        except DistNetworkError as exc:  # rank 0's previous store closed under us: its next one comes
            lost = str(exc)
        else:
            ident, _, size = value.decode("utf-8", "replace").partition(" ")
            if ident != _last_incarnation:
                return ident, int(size)
            stale = True
        if poll.expired():
            break
        poll.sleep()
    waited = (
        f"tdist/init: rank {rank} waited {poll.timeout:g} s but rank(s) [0] never arrived (of {world_size} expected)"
    )
    if stale:
        waited += ": the store holds only the world this process joined before (rank 0 did not start a new one)"
    elif lost:
        waited += f"; the store was lost: {lost}"
    raise DistStoreTimeoutError(waited + noted())


def _context(key: str) -> str:
    return "init_process_group" if key == "tdist/init" else key


def _claim(backend: str) -> bytes:
    """A rank's claim in a join: the backend it names, who it is (for the error naming a
    duplicate) and a nonce that makes it unique."""
    who = {"process": os.getpid(), "host": socket.gethostname(), "nonce": secrets.token_hex(8)}
    return json.dumps({**who, "backend": backend}).encode()


def _parse(claim: bytes) -> dict:
    try:
        parsed = json.loads(claim)
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _who(claim: bytes) -> str:
    parsed = _parse(claim)
    if "process" in parsed and "host" in parsed:
        return f"process {parsed['process']} on {parsed['host']}"
    return "another process"


def join(store: Store, key: str, rank: int, members: Sequence[int], timeout: timedelta, backend: str = "") -> None:
    """Block until every rank in ``members`` has called ``join`` with the same ``key``.

    On timeout, raise naming the ranks that never arrived. With ``backend``, the ranks
    must all have named the same backend; a rank claimed twice (two processes started
    with the same rank) fails the join too: every member then raises the same DistError.
    """
    members = list(members)
    limit = timeout.total_seconds()
    mine = _claim(backend)
    claimed = store.compare_set(f"{key}/joined/{rank}", b"", mine)
    if claimed != mine:
        if claimed == _WOKEN:
            _raise_verdict(store, key, rank, members, timeout)
        _fail(
            store,
            key,
            rank,
            members,
            f"{_context(key)}: rank {rank} was started twice: {_who(claimed)} and {_who(mine)} both joined as rank "
            f"{rank} (check RANK or rank= on every process)",
            members,
            timeout,
        )
    deadline = time.monotonic() + limit
    if rank != members[0]:  # the verdict comes out once every claim is in: wait for it alone
        try:
            verdict = store.get(f"{key}/verdict", timeout=max(deadline - time.monotonic(), 0.001))
        except DistStoreTimeoutError:
            _arrival_timeout(store, key, rank, members, limit)
            verdict = store.get(f"{key}/verdict", timeout=max(deadline - time.monotonic(), 0.001))
        if verdict != _OK:
            _raise_verdict(store, key, rank, members, timeout)
        return
    names = [f"{key}/joined/{r}" for r in members]
    try:
        store.wait(names, timeout=max(deadline - time.monotonic(), 0.001))
    except DistStoreTimeoutError:
        _arrival_timeout(store, key, rank, members, limit)
    claims = dict(zip(members, store.multi_get(names)))
    if _WOKEN in claims.values():
        _raise_verdict(store, key, rank, members, timeout)
    verdict = store.compare_set(f"{key}/verdict", b"", _backend_verdict(key, claims) if backend else _OK)
    if verdict != _OK:
        _raise_verdict(store, key, rank, members, timeout)


def _arrival_timeout(store: Store, key: str, rank: int, members: Sequence[int], limit: float) -> None:
    """The join's wait timed out: raise naming the ranks whose claims are missing (returns
    when none is: they all came in at the last moment)."""
    missing = [r for r in members if not store.check([f"{key}/joined/{r}"])]
    if missing:
        raise DistStoreTimeoutError(
            f"{key}: rank {rank} waited {limit:g} s but rank(s) {missing} never arrived "
            f"(of {len(members)} expected)" + noted()  # e.g. this process's store server ran out of descriptors
        ) from None


def _backend_verdict(key: str, claims: dict[int, bytes]) -> bytes:
    by_backend: dict[str, list[int]] = {}
    for r, claim in claims.items():
        parsed = _parse(claim)
        name = str(parsed.get("backend", "")) if parsed else claim.decode("utf-8", "replace")
        by_backend.setdefault(name, []).append(r)
    if len(by_backend) == 1:
        return _OK
    listing = "; ".join(f"{name!r} on rank(s) {ranks}" for name, ranks in by_backend.items())
    return f"{key}: the ranks disagree on the backend: {listing}".encode()


def _fail(
    store: Store, key: str, rank: int, members: Sequence[int], message: str, wake: Sequence[int], timeout: timedelta
) -> NoReturn:
    """Publish ``message`` as the verdict of join ``key`` and wake the ranks waiting in it
    (the claims in ``wake`` still missing get the marker), then raise it. A verdict out
    already is raised instead; an ``ok`` one means the group formed without this rank,
    which raises its own ``message``."""
    verdict = store.compare_set(f"{key}/verdict", b"", message.encode())
    if verdict == _OK:
        raise DistError(message)
    if verdict == message.encode():
        for r in wake:
            store.compare_set(f"{key}/joined/{r}", b"", _WOKEN)
    _raise_verdict(store, key, rank, members, timeout)


def _raise_verdict(store: Store, key: str, rank: int, members: Sequence[int], timeout: timedelta) -> NoReturn:
    """Read the verdict of join ``key`` (not ``ok``), say so, and raise it; the first member
    first waits (up to :data:`VERDICT_GRACE_S`) for the others to have read it."""
    limit = timeout.total_seconds()
    verdict = store.get(f"{key}/verdict", timeout=limit).decode("utf-8", "replace")
    store.set(f"{key}/read/{rank}", b"1")
    others = [r for r in members if r != rank]
    if members and rank == members[0] and others:
        try:
            store.wait([f"{key}/read/{r}" for r in others], timeout=min(VERDICT_GRACE_S, limit))
        except DistStoreTimeoutError:
            pass  # a rank that does not read the verdict fails on its own (its backend sees no peers)
    raise DistError(verdict)
