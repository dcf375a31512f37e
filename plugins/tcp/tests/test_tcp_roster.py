"""The group's setup through the store (tdist_tcp.net.roster): one record per rank, rank 0's
answer for all, every rank reading only the addresses it needs; and what each side says
when a rank never comes."""

from __future__ import annotations

import json
import time

import pytest
import torch
from _tcp_harness import make_backend, run_threads
from tdist._errors import DistBackendTimeoutError, DistNetworkError
from tdist.plugin import HashStore
from tdist_tcp import factory
from tdist_tcp.protocol.auth import group_key
from tdist_tcp.net.connect import Address, _Auth
from tdist_tcp.net.mesh import Mesh
from tdist_tcp.net.roster import (
    RECORD_KEY,
    SETUP_KEY,
    Record,
    answer,
    first_record,
    gather,
    lookup,
    pack_hosts,
    publish,
    unpack_hosts,
)
from tdist_tcp.shared.shm import shm_enabled
from tdist_tcp.shared.topology import Layout
from tdist_tcp.net.transport import Transport

pytestmark = pytest.mark.timeout(120)
NONCE = b"\x05" * 16


def _records(hosts: list[str], shm: list[str]) -> list[Record]:
    first = Record(Address("127.0.0.1", 1000, "u0"), hosts[0], nonce=NONCE, offer="where|1|1")
    return [first] + [Record(Address("127.0.0.1", 1000 + r, ""), hosts[r], shm[r]) for r in range(1, len(hosts))]


def test_rank_0_derives_the_layout_and_every_rank_reads_it():
    store = HashStore()
    records = _records(["b", "a", "b", "c"], ["", "", "", ""])
    for r in (1, 2, 3):
        publish(store, r, records[r])
    got = gather(store, 4, records[0], 1.0, shm_offered=False)
    assert got.layout.hosts == ((0, 2), (1,), (3,)) and not got.shm
    assert got.records == dict(enumerate(records))
    theirs = answer(store, 2, 4, 1.0)
    assert theirs.layout == got.layout and not theirs.shm and theirs.records == {}
    assert len(store.get(SETUP_KEY)) < 100  # the answer is the layout, not the records


@pytest.mark.parametrize(
    "hosts,shm,offered,used",
    [
        (["a"] * 4, ["", "1", "1", "1"], True, True),
        (["a"] * 4, ["", "1", "0", "1"], True, False),  # one rank could not map it
        (["a"] * 4, ["", "1", "1", "1"], False, False),  # rank 0 offered none
        (["a", "a", "b", "b"], ["", "1", "", ""], True, False),  # two hosts
    ],
)
def test_the_segment_is_used_only_if_every_rank_mapped_it(hosts, shm, offered, used):
    store = HashStore()
    records = _records(hosts, shm)
    for r in range(1, 4):
        publish(store, r, records[r])
    assert gather(store, 4, records[0], 1.0, shm_offered=offered).shm is used
    assert answer(store, 3, 4, 1.0).shm is used


@pytest.mark.parametrize(
    "hosts",
    [((0, 1, 2, 3),), ((0, 2), (1, 3)), ((0, 1, 5), (2, 3, 4)), ((0,), (1,), (2, 3, 4, 5, 6, 9), (7, 8))],
)
def test_layouts_travel_as_rank_ranges(hosts):
    size = sum(len(m) for m in hosts)
    text = pack_hosts(Layout(hosts))
    assert unpack_hosts(text, size) == Layout(hosts)
    assert pack_hosts(Layout((tuple(range(4096)),))) == "/4096"  # one host: constant size
    blocks = Layout(tuple(tuple(range(a, min(16387, a + 8))) for a in range(0, 16387, 8)))
    assert pack_hosts(blocks) == "/8" and unpack_hosts("/8", 16387) == blocks  # 2,049 hosts of 8 (the last 3)


@pytest.mark.parametrize("text", ["0-2", "0-3;3", "0,1,2,2", "x", "/0", "/x"])
def test_a_layout_that_does_not_place_every_rank_once_is_refused(text):
    with pytest.raises(ValueError):
        unpack_hosts(text, 4)


def test_a_rank_that_never_publishes_is_named_by_every_rank_at_once():
    """Rank 2 never comes: rank 0's wait times out naming it, and its answer makes a rank
    waiting with a long timeout raise the same at once instead of waiting it out."""
    store = HashStore()
    records = _records(["a"] * 4, [""] * 4)
    for r in (1, 3):
        publish(store, r, records[r])
    with pytest.raises(DistBackendTimeoutError, match=r"rank 0 timed out after 0.3 s .*ranks \[2\] never arrived"):
        gather(store, 4, records[0], 0.3, shm_offered=False)
    start = time.monotonic()
    with pytest.raises(DistBackendTimeoutError, match=r"rank 1 timed out after 0.3 s .*ranks \[2\] never arrived"):
        answer(store, 1, 4, 60.0)
    assert time.monotonic() - start < 10


def test_a_rank_whose_answer_never_comes_names_the_missing_ranks():
    store = HashStore()
    records = _records(["a"] * 3, [""] * 3)
    publish(store, 0, records[0])
    publish(store, 2, records[2])
    with pytest.raises(DistBackendTimeoutError, match=r"ranks \[1\] never arrived"):
        answer(store, 2, 3, 0.2)  # rank 1 never published: named, though rank 0 did not answer
    publish(store, 1, records[1])
    with pytest.raises(DistBackendTimeoutError, match="every rank published its address but rank 0 did not answer"):
        answer(store, 2, 3, 0.2)


def test_rank_0_never_arriving_is_named():
    with pytest.raises(DistBackendTimeoutError, match=r"rank 3 timed out after 0.2 s .*ranks \[0\] never arrived"):
        first_record(HashStore(), 3, 0.2)


def test_a_malformed_record_is_refused_naming_its_rank():
    store = HashStore()
    store.set(RECORD_KEY.format(1), b"not json")
    with pytest.raises(DistNetworkError, match="malformed record for rank 1"):
        gather(store, 2, _records(["a", "a"], ["", ""])[0], 1.0, shm_offered=False)
    store.set(SETUP_KEY, json.dumps({"hosts": "0-2", "shm": False}))
    with pytest.raises(DistNetworkError, match="answer in the group's store is malformed"):
        answer(store, 1, 2, 1.0)


def test_lookup_reads_only_the_records_asked_for_and_names_the_absent():
    store = HashStore()
    records = _records(["a"] * 3, [""] * 3)
    publish(store, 0, records[0])
    publish(store, 2, records[2])
    assert lookup(store, [2], time.monotonic() + 1, 1) == {2: records[2]}
    assert lookup(store, [0, 2], time.monotonic() + 1, 1) == {0: records[0], 2: records[2]}
    with pytest.raises(DistBackendTimeoutError, match=r"rank 0 cannot connect to rank\(s\) \[1\]: no address"):
        lookup(store, [1, 2], time.monotonic() + 0.2, 0)


def test_a_peer_whose_address_never_appears_fails_its_first_connection_naming_it():
    """A mesh learns a peer's address when it first connects to it; a peer with no record
    fails that connection within the limit given, with an error naming it."""
    store = HashStore()
    auth = _Auth(NONCE, group_key(b"", NONCE), False)
    mesh = Mesh(store, 0, 3, auth, [], {}, None)
    tr = Transport(0, 3, {}, 5.0, None, mesh)
    try:
        assert mesh.addresses == {}
        start = time.monotonic()
        with pytest.raises(DistBackendTimeoutError, match=r"rank 0 cannot connect to rank\(s\) \[2\]: no address"):
            tr.connect(tr.peers[2], 0.3)
        assert time.monotonic() - start < 5
    finally:
        tr.close(0.0)


def test_each_rank_reads_only_the_addresses_it_connects_to():
    """World 4, ``connect="ring"``: after setup a rank knows rank 0's address and its lower
    ring neighbour's (rank 0 every rank's, from the records it gathered); a message to
    another rank reads that rank's then."""

    def body(b, rank):
        known = sorted(b._tr.mesh.addresses)
        if rank == 1:
            b.send(torch.ones(2), 3, 7).wait()
        elif rank == 3:
            t = torch.zeros(2)
            b.recv(t, 1, 7).wait()
            assert t.tolist() == [1.0, 1.0]
        return known, sorted(b._tr.mesh.addresses)

    results = run_threads(4, body, options={"shm": False})
    assert [known for known, _ in results] == [[1, 2, 3], [0], [0, 1], [0, 2]], results
    assert results[1][1] == [0, 3], results


def test_setup_stores_one_record_per_rank():
    """What a group of 3 leaves in its store: rank 0's answer and one record per rank."""
    store = HashStore()
    run_threads(3, lambda b, r: b.barrier().wait(), store=store, options={"shm": False})
    for r in range(3):
        assert Record.decode(store.get(RECORD_KEY.format(r)), r).address.port > 0
    assert json.loads(store.get(SETUP_KEY))["hosts"] == "/3"


def test_a_missing_rank_makes_the_others_fail_fast_naming_it():
    """World 3 with rank 2 never started: every rank's error names rank 2."""
    results = run_threads(3, lambda b, r: None, backend_timeout=1.5, raise_errors=False, ranks=[0, 1], timeout=60)
    for rank in (0, 1):
        assert isinstance(results[rank], DistBackendTimeoutError), (rank, results[rank])
        assert "ranks [2] never arrived" in str(results[rank]), (rank, results[rank])


def test_make_backend_with_a_missing_peer_releases_everything():
    """Rank 0 alone, its peer never arrives: the setup times out naming rank 1 and rank 0's
    offered segment and listeners are gone."""
    import _tcp_jobs as J

    with pytest.raises(DistBackendTimeoutError, match=r"ranks \[1\] never arrived"):
        make_backend(HashStore(), 0, 2, 0.5)
    assert J.shm_mapped() == set() and J.shm_fds() == set()


@pytest.mark.skipif(not shm_enabled({"shm": True}), reason="shared memory needs Linux x86-64, memfd and /proc")
@pytest.mark.parametrize("offer_max", [512, 2])
def test_one_host_uses_shared_memory_with_or_without_the_offer(monkeypatch, offer_max):
    """World 3 on one host: rank 0's segment offered in its record (the default), or, for a
    group larger than the offer's limit, set up afterwards (open_shm): shared memory either way."""
    from tdist._reduce_op import ReduceOp, Reduction

    monkeypatch.setattr(factory, "OFFER_MAX_RANKS", offer_max)

    def body(b, rank):
        t = torch.full((5,), float(rank + 1))
        b.all_reduce(t, Reduction(ReduceOp.SUM)).wait()
        return t.tolist(), b._shm is not None

    store = HashStore()
    for got, used in run_threads(3, body, timeout=60, store=store):
        assert got == [6.0] * 5 and used
    offered = Record.decode(store.get(RECORD_KEY.format(0)), 0).offer
    assert bool(offered) is (offer_max >= 3), offered
