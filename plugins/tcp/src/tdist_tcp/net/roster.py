"""A group's setup through its store: one record per rank, gathered by rank 0, one answer for all.

Every rank publishes one *record* under ``tcp/rank/<rank>`` in the group's store (already
prefixed per group and backend): where it listens (TCP address, Unix-domain name), its
host (:func:`tdist_tcp.shared.topology.host_id`) and its answer to rank 0's offer of a shared
segment. Rank 0's record also carries the group nonce and that offer, so every other rank
first reads rank 0's record (one blocking ``get``), maps the offered segment if it runs
on rank 0's host, and then publishes its own. Rank 0 waits for every record (one
``wait``, one ``multi_get``), derives the group's :class:`~tdist_tcp.shared.topology.Layout`
and whether every rank mapped the segment, and publishes that *answer* under
``tcp/setup``, which the others wait for (one blocking ``get``). So setting a group up
costs every rank four store round trips and one wait for all ranks, whatever the
group's size, and only rank 0 reads every record: the store serves O(N) bytes in all,
not O(N²). A rank learns another rank's address when it first connects to it
(:func:`lookup`, by :class:`tdist_tcp.net.mesh.Mesh`), at setup only its ring neighbours'.

If some ranks never publish a record, rank 0's wait times out and its answer names them:
every rank waiting for the answer raises the same error at once.
"""

from __future__ import annotations

import json
import time
from typing import Any, NamedTuple, Sequence

from tdist.plugin import DistBackendTimeoutError, DistError, DistNetworkError, DistStoreTimeoutError

from . import tally
from .connect import Address, format_addr, parse_addr
from ..shared.topology import Layout

__all__ = ["RECORD_KEY", "SETUP_KEY", "Record", "Answer", "publish", "first_record", "gather", "answer", "lookup"]

RECORD_KEY = "tcp/rank/{}"
SETUP_KEY = "tcp/setup"


class Record(NamedTuple):
    """What a rank publishes: its ``address``, its ``host`` (a host id), its ``shm`` answer to
    rank 0's offer (``"1"`` mapped, ``"0"`` could not or would not, ``""`` not asked: another
    host, or no offer); rank 0's also the group ``nonce`` and its ``offer`` (a segment
    locator with its buffer size and one-step threshold, ``""`` for none)."""

    address: Address
    host: str
    shm: str = ""
    nonce: bytes = b""
    offer: str = ""

    def encode(self) -> str:
        fields: dict[str, Any] = {
            "addr": format_addr(self.address.host, self.address.port),
            "unix": self.address.unix,
            "host": self.host,
            "shm": self.shm,
        }
        if self.nonce:
            fields["nonce"] = self.nonce.hex()
            fields["offer"] = self.offer
        return json.dumps(fields, separators=(",", ":"))

    @staticmethod
    def decode(raw: bytes, rank: int) -> "Record":
        """The record of ``rank`` from the store; a DistNetworkError if it is malformed."""
        try:
            fields = json.loads(raw)
            host, port = parse_addr(str(fields["addr"]).encode())
            return Record(
                Address(host, port, str(fields.get("unix", ""))),
                str(fields["host"]),
                str(fields.get("shm", "")),
                bytes.fromhex(fields.get("nonce", "")),
                str(fields.get("offer", "")),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DistNetworkError(
                f"tcp backend: the group's store holds a malformed record for rank {rank}: {exc}"
            ) from None


class Answer(NamedTuple):
    """Rank 0's answer: the group's ``layout`` and whether it uses rank 0's segment (``shm``);
    on rank 0, ``records`` holds every rank's record (elsewhere it is empty)."""

    layout: Layout
    shm: bool
    records: dict[int, Record]


def publish(store: Any, rank: int, record: Record) -> None:
    """Publish this rank's record (one ``set``)."""
    store.set(RECORD_KEY.format(rank), record.encode())


def first_record(store: Any, rank: int, timeout: float) -> Record:
    """Rank 0's record (its nonce and offer), waiting for it up to ``timeout`` seconds."""
    try:
        raw = store.get(RECORD_KEY.format(0), timeout=max(0.01, timeout))
    except DistStoreTimeoutError:
        raise _never_arrived(rank, timeout, [0]) from None
    record = Record.decode(raw, 0)
    if len(record.nonce) != 16:
        raise DistNetworkError("tcp backend: rank 0's record in the group's store carries no group nonce")
    return record


def gather(store: Any, size: int, mine: Record, timeout: float, shm_offered: bool) -> Answer:
    """Rank 0: wait up to ``timeout`` seconds for every rank's record, derive and publish the
    answer (or, when some never came, an error naming them, which every rank raises)."""
    keys = [RECORD_KEY.format(r) for r in range(1, size)]
    try:
        store.wait(keys, timeout=max(0.01, timeout))
    except DistStoreTimeoutError:
        absent = tally.absent(store, keys, range(1, size)) or list(range(1, size))
        store.set(SETUP_KEY, json.dumps({"absent": absent, "timeout": timeout}))
        raise _never_arrived(0, timeout, absent) from None
    records = {0: mine}
    for r, raw in enumerate(store.multi_get(keys), start=1):
        records[r] = Record.decode(raw, r)
    by_host: dict[str, list[int]] = {}
    for r in range(size):
        by_host.setdefault(records[r].host, []).append(r)
    layout = Layout(tuple(tuple(m) for m in sorted(by_host.values())))
    shm = shm_offered and len(layout.hosts) == 1 and all(records[r].shm == "1" for r in range(1, size))
    store.set(SETUP_KEY, json.dumps({"hosts": pack_hosts(layout), "shm": shm}))
    return Answer(layout, shm, records)


def answer(store: Any, rank: int, size: int, timeout: float) -> Answer:
    """Every rank but 0: rank 0's answer, waiting for it up to ``timeout`` seconds."""
    try:
        raw = store.get(SETUP_KEY, timeout=max(0.01, timeout))
    except DistStoreTimeoutError:
        absent = tally.absent(store, [RECORD_KEY.format(r) for r in range(size)], range(size))
        if absent:
            raise _never_arrived(rank, timeout, absent) from None
        raise DistBackendTimeoutError(
            f"tcp backend: rank {rank} timed out after {timeout:g} s setting up the group: every rank published "
            "its address but rank 0 did not answer (it stopped, or is overloaded)"
        ) from None
    try:
        fields = json.loads(raw)
        if "absent" in fields:  # rank 0 waited for them in vain
            absent, waited = [int(r) for r in fields["absent"]], float(fields["timeout"])
        else:
            return Answer(unpack_hosts(str(fields["hosts"]), size), bool(fields["shm"]), {})
    except (ValueError, TypeError, KeyError) as exc:
        raise DistNetworkError(f"tcp backend: rank 0's answer in the group's store is malformed: {exc}") from None
    raise _never_arrived(rank, waited, absent)


def lookup(store: Any, ranks: Sequence[int], deadline: float, me: int) -> dict[int, Record]:
    """The records of ``ranks`` (published already, or waited for until ``deadline``): a
    DistBackendTimeoutError names the ranks whose records never appear, a DistNetworkError
    says why the store could not be read."""
    keys = [RECORD_KEY.format(r) for r in ranks]
    try:
        if len(keys) == 1:
            raws = [store.get(keys[0], timeout=max(0.01, deadline - time.monotonic()))]
        else:
            store.wait(keys, timeout=max(0.01, deadline - time.monotonic()))
            raws = store.multi_get(keys)
    except DistStoreTimeoutError:
        absent = tally.absent(store, keys, ranks)
        raise DistBackendTimeoutError(
            f"tcp backend: rank {me} cannot connect to rank(s) {absent or list(ranks)}: no address published in "
            "the group's store (they never took part in the group's setup)"
        ) from None
    except (DistError, OSError) as exc:  # e.g. the store's server is gone
        raise DistNetworkError(
            f"tcp backend: rank {me} cannot read the address of rank(s) {list(ranks)} from the group's store: {exc}"
        ) from None
    return {r: Record.decode(raw, r) for r, raw in zip(ranks, raws)}


def _never_arrived(rank: int, timeout: float, absent: list[int]) -> DistBackendTimeoutError:
    return DistBackendTimeoutError(
        f"tcp backend: rank {rank} timed out after {timeout:g} s setting up connections: "
        f"ranks {absent} never arrived (no address published)"
    )


# ----------------------------------------------------------------------- the layout
def pack_hosts(layout: Layout) -> str:
    """``layout`` as text: ``/k`` when every host holds the next ``k`` ranks (the last
    perhaps fewer), so the answer stays small however many hosts; else hosts separated by
    ``;``, each a list of rank ranges (``0-7,16-23``)."""
    size = sum(len(m) for m in layout.hosts)
    k = len(layout.hosts[0])
    if all(m == tuple(range(h * k, min(size, (h + 1) * k))) for h, m in enumerate(layout.hosts)):
        return f"/{k}"
    hosts = []
    for members in layout.hosts:
        runs: list[list[int]] = []
        for r in members:
            if runs and r == runs[-1][1] + 1:
                runs[-1][1] = r
            else:
                runs.append([r, r])
        hosts.append(",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs))
    return ";".join(hosts)


def unpack_hosts(text: str, size: int) -> Layout:
    """The :class:`Layout` :func:`pack_hosts` wrote; a ValueError unless it places every
    rank of ``size`` on exactly one host."""
    if text.startswith("/"):
        k = int(text[1:])
        if k < 1:
            raise ValueError(f"the layout {text!r} has hosts of no rank")
        return Layout(tuple(tuple(range(a, min(size, a + k))) for a in range(0, size, k)))
    hosts = []
    for part in text.split(";"):
        members: list[int] = []
        for run in part.split(","):
            first, _, last = run.partition("-")
            members.extend(range(int(first), int(last or first) + 1))
        hosts.append(tuple(members))
    if sorted(r for members in hosts for r in members) != list(range(size)):
        raise ValueError(f"the layout {text!r} does not place each of {size} ranks once")
    return Layout(tuple(hosts))
