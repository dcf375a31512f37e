"""``tcp://<multicast address>:port``: the processes of a job find each other by UDP multicast.

Every process announces itself on the group (its random id, its given rank if any, the
job's world size), repeating with a growing pause (10 ms to 250 ms, back to 10 ms when it
hears someone new) and listening to the others, until it has found ``world_size``
processes of its job. From that list every process computes the same rank table
(:func:`assign_ranks`); the process with rank 0 starts the job's TCPStore on a free port of
its address and offers each other process its rank and the store's address, repeating
until all have connected and claimed their rank in the store. Then every UDP socket is
closed: the job keeps only its store, hosted by rank 0 (as with a unicast address).

Datagrams of other group names are dropped on arrival (:mod:`.multicast_wire`); an offer
names the process it is for, so two jobs on one address never mix. With
``$TDIST_STORE_TOKEN`` every datagram is authenticated, and the store is too.

Robust to any start order: a process that went silent for :data:`EXPIRY` seconds no longer
counts (it crashed; it may be restarted), the store's host hands the rank of one that died
before connecting to a newcomer, and a rank claim in the store is atomic. More processes
than ``world_size``, a rank given to two processes or another world size in the same group
is an error once it has lasted :data:`EXPIRY` seconds (a process restarted at once does
not trip it).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import select
import socket
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

from .._errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from .._store import TCPStore
from .._store.base import Store
from .._store.tcp_protocol import token_bytes
from .common import check_rank
from .multicast_socket import MulticastOptions, no_multicast_hint, open_multicast_socket
from .multicast_wire import ANNOUNCE, ID_BYTES, OFFER, Datagram, Rejected, job_tag, pack, source_of, unpack

__all__ = ["multicast_rendezvous", "assign_ranks", "Peer", "EXPIRY"]

#: Seconds after which a process that stopped announcing itself no longer counts.
EXPIRY = 3.0
FIRST_DELAY, LONGEST_DELAY = 0.01, 0.25
#: Seconds between two looks at the processes found (at once when a new one is heard).
REVIEW_PERIOD = 0.05
_CLAIMED = b"+"


@dataclass
class Peer:
    """A process of this job, as heard on the group."""

    id: bytes
    address: str  # the source address of its datagrams (its store's, should it host it)
    host: str  # its host name
    rank: int  # its given rank, -1 when none
    world_size: int
    last_seen: float = 0.0


def _address_key(address: str) -> Tuple[int, int]:
    parsed = ipaddress.ip_address(address.partition("%")[0])
    return parsed.version, int(parsed)


def assign_ranks(peers: Sequence[Peer], world_size: int) -> Dict[bytes, int]:
    """Every peer's rank: given ranks are kept; the others take the free ranks in order of
    (address, id), so that the processes of one host get consecutive ranks. ``peers`` are
    ``world_size`` processes whose given ranks differ."""
    ranks = {p.id: p.rank for p in peers if p.rank >= 0}
    free = iter(sorted(set(range(world_size)) - set(ranks.values())))
    for peer in sorted((p for p in peers if p.rank < 0), key=lambda p: (_address_key(p.address), p.id)):
        ranks[peer.id] = next(free)
    return ranks


def _slot(rank: int) -> str:
    return f"tdist/multicast/rank/{rank}"


def _world_size_from_env(world_size: int) -> int:
    if world_size > 0:
        return world_size
    raw = os.environ.get("WORLD_SIZE", "")
    try:
        value = int(raw) if raw else -1
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(
            "tcp:// multicast rendezvous: world_size is required: the processes must know how many to "
            "wait for (pass world_size=, add ?world_size= to the URL, or set WORLD_SIZE)"
            + (f"; WORLD_SIZE={raw!r} is not a positive integer" if raw else "")
        )
    return value


class _Rendezvous:
    """One process's side of the protocol in the module's description."""

    def __init__(
        self, sock: socket.socket, options: MulticastOptions, group: str, rank: int, world_size: int, timeout: float
    ) -> None:
        self.sock, self.options, self.group = sock, options, group
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.me = secrets.token_bytes(ID_BYTES)
        self.tag, self.token = job_tag(group), token_bytes(None)
        self.hostname = socket.gethostname()
        self.peers: Dict[bytes, Peer] = {}
        self.rejected: Counter = Counter()
        self.deadline = time.monotonic() + timeout
        self._problem_since: Optional[float] = None
        #: where this process's datagrams come from, as the group sees them: learned from its first
        #: one, named (MAC'd) in every later one (:mod:`.multicast_wire`)
        self.source: Optional[Tuple[bytes, int]] = None

    @property
    def where(self) -> str:
        return f"tcp:// multicast rendezvous at {self.options.where} (group {self.group!r})"

    # ------------------------------------------------------------------ datagrams
    def announcement(self) -> Datagram:
        source, port = self.source or (bytes(16), 0)
        return Datagram(
            ANNOUNCE, self.me, self.world_size, self.rank, text=self.hostname, source=source, source_port=port
        )

    def send(self, datagram: Datagram) -> None:
        if self.source is not None:
            datagram = dataclasses.replace(datagram, source=self.source[0], source_port=self.source[1])
        try:
            self.sock.sendto(pack(datagram, self.tag, self.token), (self.options.group, self.options.port))
        except (BlockingIOError, InterruptedError):
            pass  # the send buffer is full: the next round repeats it
        except OSError as exc:
            raise DistNetworkError(
                f"{self.where}: cannot send to the group: {exc}. {no_multicast_hint(self.options)}"
            ) from exc

    def receive(self, until: float) -> Optional[Tuple[Datagram, tuple]]:
        """The next datagram of this job (and its source) arriving before ``until``; None if none."""
        while True:
            wait = max(0.0, until - time.monotonic())
            if not select.select([self.sock], [], [], wait)[0]:
                return None
            try:
                data, source = self.sock.recvfrom(4096)
            except (BlockingIOError, InterruptedError):
                continue
            got = unpack(data, self.tag, self.token)
            if isinstance(got, Rejected):
                self.rejected[got] += 1
                continue
            if got is None:
                continue
            origin = source_of(source)
            if got.sender == self.me and got.kind == ANNOUNCE and self.source is None:
                self.source = origin  # this process's first datagram, heard back: now it knows where it is
                got = dataclasses.replace(got, source=origin[0], source_port=origin[1])
            if (got.source, got.source_port) != origin:
                if got.source_port or got.kind != ANNOUNCE:  # a replay from elsewhere: it takes no part
                    self.rejected[Rejected.WRONG_SOURCE] += 1
                continue  # (one that does not know its source yet: it names it in its next announcement)
            if got.kind == ANNOUNCE:
                self._heard(got, source)
            return got, source

    def _heard(self, datagram: Datagram, source: tuple) -> None:
        peer = self.peers.setdefault(
            datagram.sender,
            Peer(datagram.sender, _source_address(source), datagram.text, datagram.rank, datagram.world_size),
        )
        peer.last_seen = time.monotonic()

    def live(self) -> list:
        now = time.monotonic()
        return [p for p in self.peers.values() if now - p.last_seen <= EXPIRY]

    # ------------------------------------------------------------------ the protocol
    def run(self) -> Tuple[Store, int, int]:
        announce_at, delay, review_at = time.monotonic(), FIRST_DELAY, 0.0
        announced_source = False
        while True:
            now = time.monotonic()
            if now >= self.deadline:
                raise self._timeout_error()
            if now >= announce_at:
                announced_source = self.source is not None
                self.send(self.announcement())
                announce_at, delay = now + delay, min(delay * 2, LONGEST_DELAY)
            known = len(self.peers)
            got = self.receive(min(announce_at, self.deadline))
            if got is not None and self._for_me(got[0]):
                return self._accept(*got)
            now = time.monotonic()
            if self.source is not None and not announced_source:  # the others count it from this one on
                announce_at = now
            if len(self.peers) > known:  # someone new: let it hear everyone soon, and see if the job is complete
                announce_at, delay, review_at = now, FIRST_DELAY, now
            if now < review_at:
                continue
            review_at = now + REVIEW_PERIOD  # also when nobody is new: processes expire, problems last
            live = self.live()
            if self._check_problems(live) or len(live) != self.world_size or self.me not in self.peers:
                continue
            ranks = assign_ranks(live, self.world_size)
            if ranks.get(self.me) == 0:
                return self._lead(ranks, self.announcement())

    def _for_me(self, datagram: Datagram) -> bool:
        return datagram.kind == OFFER and datagram.recipient == self.me and datagram.world_size == self.world_size

    def _check_problems(self, live: list) -> bool:
        """Whether the processes found cannot form the job now; raises once that has lasted EXPIRY seconds."""
        problem = self._problem(live)
        if problem is None:
            self._problem_since = None
            return False
        now = time.monotonic()
        if self._problem_since is None:
            self._problem_since = now
        elif now - self._problem_since > EXPIRY:
            raise DistStoreError(f"{self.where}: {problem}")
        return True

    def _problem(self, live: list) -> Optional[str]:
        for peer in live:
            if peer.world_size != self.world_size:
                return (
                    f"a process on {_describe(peer)} has world_size {peer.world_size}, this one "
                    f"{self.world_size}: give every process of a job the same world_size, and different jobs "
                    "different group names"
                )
        claims: Dict[int, list] = {}
        for peer in sorted(live, key=lambda p: (_address_key(p.address), p.id)):
            if peer.rank >= 0:
                claims.setdefault(peer.rank, []).append(peer)
        for rank, claimants in sorted(claims.items()):
            if len(claimants) > 1:
                return (
                    f"rank {rank} is given to {len(claimants)} processes (on "
                    f"{', '.join(_describe(p) for p in claimants)}): each rank must be given to one process"
                )
        if len(live) > self.world_size:
            return (
                f"{len(live)} processes ({_hosts(live)}) announce this group but world_size is "
                f"{self.world_size}: do two jobs use this address with the same group_name? Give each its own"
            )
        return None

    def _accept(self, offer: Datagram, source: tuple) -> Tuple[Store, int, int]:
        """Join the store an offer for this process names and claim the rank it gives."""
        if self.rank >= 0 and offer.rank != self.rank:
            raise DistStoreError(
                f"{self.where}: offered rank {offer.rank}, but this process was given rank {self.rank}"
            )
        host = offer.text
        if _is_link_local(host) and len(source) > 3:  # reach it through the interface the offer came in on
            host = f"{host}%{source[3]}"
        remaining = max(self.deadline - time.monotonic(), 0.1)
        store = TCPStore(
            host, offer.port, is_master=False, timeout=timedelta(seconds=remaining), wait_for_workers=False
        )
        try:
            claimed = self.me.hex().encode() + _CLAIMED
            if store.compare_set(_slot(offer.rank), self.me.hex(), claimed) != claimed:
                raise DistStoreError(
                    f"{self.where}: the store at {host}:{offer.port} offered rank {offer.rank} but "
                    "gave it to another process before this one could claim it (this process "
                    "stopped announcing itself for too long, or, without a token, someone else "
                    "answered for the job: set TDIST_STORE_TOKEN)"
                )
            store.set_timeout(timedelta(seconds=self.timeout))
        except BaseException:
            store.close()
            raise
        return store, offer.rank, self.world_size

    def _lead(self, ranks: Dict[bytes, int], announcement: Datagram) -> Tuple[Store, int, int]:
        """Host the job's store, offer every other member its rank there, return once all have
        claimed it. Keeps announcing itself meanwhile, so that it stays in everyone's count."""
        own = _bindable(self.peers[self.me].address)
        store = TCPStore(own, 0, is_master=True, timeout=timedelta(seconds=self.timeout), wait_for_workers=False)
        try:
            by_rank = {rank: member for member, rank in ranks.items()}
            store.multi_set([_slot(r) for r in by_rank], [m.hex() for m in by_rank.values()])
            store.compare_set(_slot(0), self.me.hex(), self.me.hex().encode() + _CLAIMED)
            address = own.partition("%")[0]
            pending = {r: m for r, m in by_rank.items() if r != 0}
            counted = set(ranks)  # every process given a rank (also those that have claimed it)

            def offer(rank: int) -> None:
                self.send(Datagram(OFFER, self.me, self.world_size, rank, pending[rank], store.port, address))

            offer_at, delay, review_at = time.monotonic(), FIRST_DELAY, time.monotonic() + FIRST_DELAY
            while pending:
                now = time.monotonic()
                if now >= self.deadline:
                    raise self._unclaimed_error(pending)
                if now >= offer_at:
                    self.send(announcement)
                    for rank in pending:
                        offer(rank)
                    offer_at, delay = now + delay, min(delay * 2, LONGEST_DELAY)
                got = self.receive(min(offer_at, self.deadline, review_at))
                if got is not None and got[0].kind == ANNOUNCE:
                    placed = self._place(got[0], pending, counted, store)
                    if placed is not None:
                        offer(placed)
                if time.monotonic() >= review_at:
                    review_at = time.monotonic() + FIRST_DELAY
                    claims = store.multi_get([_slot(r) for r in pending])
                    pending = {r: m for (r, m), value in zip(pending.items(), claims) if not value.endswith(_CLAIMED)}
        except BaseException:
            store.close()
            raise
        return store, 0, self.world_size

    def _place(self, announce: Datagram, pending: Dict[int, bytes], counted: set, store: Store) -> Optional[int]:
        """The rank to offer the process that announced itself (still waiting for its offer, or
        taking the place of a pending member that went silent); None for nobody."""
        for rank, member in pending.items():
            if member == announce.sender:
                return rank
        if announce.sender in counted or announce.world_size != self.world_size:
            return None
        now = time.monotonic()
        for rank, member in pending.items():
            gone = now - self.peers[member].last_seen > EXPIRY
            if gone and announce.rank in (-1, rank):
                if (
                    store.compare_set(_slot(rank), member.hex(), announce.sender.hex())
                    == announce.sender.hex().encode()
                ):
                    pending[rank] = announce.sender
                    counted.add(announce.sender)
                    return rank
        return None

    # ------------------------------------------------------------------ errors
    def _timeout_error(self) -> DistStoreTimeoutError:
        live = self.live()
        text = f"{self.where}: found {len(live)} of {self.world_size} processes within {self.timeout:g} s" + (
            f" ({_hosts(live)})" if live else ""
        )
        problem = self._problem(live)
        if self.me not in self.peers:
            text += (
                ". This process never heard its own datagrams: multicast does not reach this host's own "
                "sockets on this interface. " + no_multicast_hint(self.options)
            )
        elif problem is not None:
            text += f"; {problem}"
        elif len(live) < self.world_size:
            text += ". Are the other processes started, with the same address, group_name and world_size?"
            own = self.peers[self.me].address
            if all(p.address == own for p in live):
                text += (
                    " No process on another host was heard: does the network between the hosts carry multicast"
                    f" (TTL {self.options.ttl}: raise it with ?ttl= or TDIST_MULTICAST_TTL if routers lie between "
                    "them)? Where it does not, use a unicast address: tcp://<address of one host>:<port>"
                )
        else:
            ranks = assign_ranks(live, self.world_size)
            leader = next(p for p in live if ranks[p.id] == 0)
            text += f", but rank 0's process (on {_describe(leader)}) offered no store to this one"
        return DistStoreTimeoutError(text + self._rejected_note())

    def _unclaimed_error(self, pending: Dict[int, bytes]) -> DistStoreTimeoutError:
        missing = ", ".join(
            f"rank {r} (on {_describe(self.peers[m])})" if m in self.peers else f"rank {r}"
            for r, m in sorted(pending.items())
        )
        return DistStoreTimeoutError(
            f"{self.where}: {self.world_size - len(pending)} of {self.world_size} processes joined the store within "
            f"{self.timeout:g} s; missing: {missing}" + self._rejected_note()
        )

    def _rejected_note(self) -> str:
        if not self.rejected:
            return ""
        parts = [f"{count} that {reason.value}" for reason, count in self.rejected.items()]
        return f". Datagrams of this group ignored: {', '.join(parts)}"


def _source_address(source: tuple) -> str:
    address = str(source[0]).partition("%")[0]
    if len(source) > 3 and source[3] and _is_link_local(address):
        return f"{address}%{source[3]}"
    return address


def _is_link_local(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.partition("%")[0]).is_link_local
    except ValueError:
        return False


def _bindable(address: str) -> str:
    """The address to serve the store on: the one the others see, loopback for an unspecified one."""
    parsed = ipaddress.ip_address(address.partition("%")[0])
    if parsed.is_unspecified:
        return "::1" if parsed.version == 6 else "127.0.0.1"
    return address


def _describe(peer: Peer) -> str:
    return f"{peer.host} ({peer.address})" if peer.host else peer.address


def _hosts(peers: Sequence[Peer]) -> str:
    """``2 on host0 (10.0.0.1), 1 on host1 (10.0.0.2)``."""
    counts = Counter(_describe(p) for p in peers)
    return ", ".join(f"{n} on {where}" for where, n in sorted(counts.items()))


def multicast_rendezvous(
    url: urllib.parse.SplitResult, host: str, port: int, *, rank: int, world_size: int, timeout: float, group_name: str
) -> Tuple[Store, int, int]:
    """The store, rank and world size of this process in the job at multicast ``host:port``
    (see the module's description; the options are :class:`MulticastOptions`')."""
    options = MulticastOptions.from_url(host, port, url)
    world_size = _world_size_from_env(world_size)
    check_rank("tcp", rank, world_size)
    sock = open_multicast_socket(options)
    try:
        return _Rendezvous(sock, options, group_name, rank, world_size, timeout).run()
    finally:
        sock.close()
