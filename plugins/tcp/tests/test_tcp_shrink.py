"""``shrink_group`` on tcp reuses the survivors' connections, listeners and shared segment
(tdist_tcp.regroup): real processes (a :class:`tdist.testing.World` per case), a rank
SIGKILLed, the others shrink; the new group's backend holds the very sockets (by inode)
and segment (by memfd name) the old one had, the store holds none of the factory's keys
for it, and its collectives and point-to-point operations give the right results --
also after a second shrink, on hierarchical groups, with several streams, and where a
frame (or a shared-memory step) of the failed collective was left behind. The link
protocol itself (epochs, MARK frames, parked links) is checked on socket pairs."""

from __future__ import annotations

import socket
import time

from typing import Optional

import _tcp_shrink_jobs as J
import pytest
from tdist.testing import RankFailure, World
from tdist.testing.tls_certs import OPENSSL, make_pki, tls_env
from tdist_tcp.shared import shm as S

pytestmark = [pytest.mark.timeout(240)]


def _run(n: int, body, env: dict, pg_timeout: float = 30.0, timeout: float = 150.0, **kwargs) -> list:
    with World.spawn("tcp", n, pg_timeout=pg_timeout, env=env) as world:
        return world.submit(body, timeout=timeout, **kwargs).outcomes()


def _survivor_outcomes(outcomes: list, lost: list[int]) -> list:
    for rank, o in enumerate(outcomes):
        if rank in lost:
            assert isinstance(o, RankFailure) and o.kind == "died", f"rank {rank} (lost) reported {o}"
        else:
            assert not isinstance(o, RankFailure), f"rank {rank} failed: {o}"
    return [o for rank, o in enumerate(outcomes) if rank not in lost]


def _pairs(snap: dict, original: list[int]) -> set:
    """The snapshot's links as (original rank, original rank, socket inode)."""
    me = original[snap["rank"]]
    return {(me, original[int(q)], ino) for q, inos in snap["links"].items() for ino in inos}


# env of the world; warm_up: every pair connected before the first loss; made: the peers
# (original ranks) each survivor connects to after each shrink (rank, shrink) -> peers
CASES = {
    "shm-connect-all": dict(env={"TDIST_TCP_SHM": "1", "TDIST_TCP_CONNECT": "all"}, warm_up=True, made={}),
    # barriers connect 0-2 in the old group: nothing is new
    "sockets-ring": dict(env={"TDIST_TCP_SHM": "0", "TDIST_TCP_CONNECT": "ring"}, warm_up=False, made={}),
    "sockets-2-streams": dict(
        env={"TDIST_TCP_SHM": "0", "TDIST_TCP_CONNECT": "all", "TDIST_TCP_UNIX": "0", "TDIST_TCP_STREAMS": "2"},
        warm_up=True,
        made={},
    ),
    "hierarchical": dict(env={"TDIST_TCP_RANKS_PER_HOST": "2", "TDIST_TCP_CONNECT": "all"}, warm_up=True, made={}),
}


@pytest.mark.parametrize("case", CASES)
def test_shrinks_reuse_connections_and_segment(case):
    """4 -> 3 -> 2: after each loss the survivors' new group has the old group's sockets,
    listeners and segment, nothing new in the store, and every operation is right; its
    operations connect only pairs that never were."""
    spec = CASES[case]
    if spec["env"].get("TDIST_TCP_SHM") != "0" and not S.shm_enabled({"shm": True}):
        pytest.skip("shared memory needs Linux x86-64 and memfd")
    _check_rounds(case, spec)


@pytest.mark.skipif(OPENSSL is None, reason="the certificates are made with the openssl command-line tool")
def test_shrinks_reuse_tls_connections(tmp_path):
    """The same over TLS (TCP connections: no Unix-domain sockets) with a job token: the
    new group keeps the TLS streams, whose peers proved the token's key to the old group."""
    env = {**tls_env(make_pki(tmp_path), client_auth=True), "TDIST_STORE_TOKEN": "shrink-token"}
    env.update(TDIST_TCP_SHM="0", TDIST_TCP_UNIX="0", TDIST_TCP_CONNECT="all")
    _check_rounds("tls", dict(env=env, warm_up=True, made={}), kinds={"TlsStream"})


def _check_rounds(case: str, spec: dict, kinds: Optional[set] = None) -> None:
    env = spec["env"]
    shm = env.get("TDIST_TCP_SHM") != "0"
    outcomes = _run(4, J.shrink_rounds, env, spec.get("pg_timeout", 30.0), losses=[3, 2], warm_up=spec["warm_up"])
    survivors = _survivor_outcomes(outcomes[:2], [])  # ranks 0 and 1 survive both rounds
    for lost in (2, 3):
        assert isinstance(outcomes[lost], RankFailure) and outcomes[lost].kind == "died", outcomes[lost]
    originals = [[0, 1, 2, 3], [0, 1, 2], [0, 1]]  # original rank of each group rank, round by round
    for rank, rounds in enumerate(survivors):
        assert len(rounds) == 2
        for k, rnd in enumerate(rounds):
            before, after, done = rnd["before"], rnd["after"], rnd["after_ops"]
            where = f"rank {rank}, shrink {k + 1} ({case})"
            assert rnd["failed"] == [len(originals[k]) - 1], (where, rnd["failed"])
            assert all(rnd["results"].values()), (where, rnd["results"])
            assert (after["rank"], after["size"], after["epoch"]) == (rank, len(originals[k + 1]), k + 1), where
            assert before["factory_keys"] == (k == 0), f"{where}: the store check does not see the factory's keys"
            assert not after["factory_keys"], f"{where}: the factory's keys are in the store: a new rendezvous"
            assert after["listeners"] == before["listeners"] and after["listeners"], f"{where}: new listeners"
            assert after["segments"] == before["segments"], (
                f"{where}: segments {before['segments']} -> {after['segments']}"
            )
            kept = _pairs(after, originals[k + 1])
            old = {pair for pair in _pairs(before, originals[k]) if pair[1] in originals[k + 1]}
            assert kept == old, f"{where}: links {sorted(old)} -> {sorted(kept)}"
            made = {pair[1] for pair in _pairs(done, originals[k + 1]) - kept}
            expected = spec["made"].get((rank, k), set())
            assert made == expected, f"{where}: operations on the shrunken group connected to {made}, not {expected}"
            if kinds is not None:
                assert set(done["kinds"]) == kinds, (where, done["kinds"])
            if env.get("TDIST_TCP_STREAMS") == "2":
                peers = [pair[1] for pair in _pairs(done, originals[k + 1])]
                assert peers and all(peers.count(q) == 2 for q in peers), f"{where}: {sorted(peers)}"
            if case == "hierarchical":
                expected_hosts = [[0, 1], [2]] if k == 0 else None
                assert after["hosts"] == expected_hosts, (where, after["hosts"])
                assert after["uses_shm"] and len(after["segments"]) == 1, where
            elif shm:
                assert after["uses_shm"] and after["segments"], f"{where}: the shrunken group lost its shared memory"


def test_connections_made_after_a_shrink_belong_to_the_new_group():
    """connect=lazy with shared memory: no connection before the shrink (rank 3, alive, is
    excluded: nobody probes it); the new group's sends connect its pairs, under its own
    epoch's identity, once each. (Before it, ranks 1 and 2 shrink a subgroup of 1, 2, 3.)"""
    if not S.shm_enabled({"shm": True}):
        pytest.skip("shared memory needs Linux x86-64 and memfd")
    outcomes = _run(4, J.exclude_and_exercise, {"TDIST_TCP_SHM": "1", "TDIST_TCP_CONNECT": "lazy"})
    for rank in range(3):
        o = outcomes[rank]
        assert not isinstance(o, RankFailure), (rank, o)
        assert all(o["results"].values()) and all(o["again"].values()), (rank, o)
        assert o["before"]["links"] == {} and o["after"]["links"] == {}, (rank, o["before"], o["after"])
        # (the shrunken subgroup's segment is gone with it: destroyed by the default group's shrink)
        segments = o["after"]["segments"]
        assert o["after"]["epoch"] == 1 and segments and set(segments) <= set(o["before"]["segments"]), (rank, o)
        assert sorted(o["done"]["links"]) == [q for q in range(3) if q != rank], (rank, o["done"])
        assert o["done"]["links"] == o["twice"]["links"], f"rank {rank} connected again: {o['done']} {o['twice']}"
    assert not isinstance(outcomes[3], RankFailure) and outcomes[3]["excluded"], outcomes[3]


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shm", "sockets"])
def test_a_stale_step_of_the_failed_collective_is_never_taken(shm):
    """Rank 0's broadcast of the old group reached rank 1 (a stashed frame, or a step posted
    in the segment) but rank 1 never joined it; the new group's broadcast with the same
    sequence number, shape and root gives rank 1 the new data."""
    if shm == "1" and not S.shm_enabled({"shm": True}):
        pytest.skip("shared memory needs Linux x86-64 and memfd")
    outcomes = _run(3, J.stale_broadcast, {"TDIST_TCP_SHM": shm})
    for rank, o in enumerate(_survivor_outcomes(outcomes, [2])):
        assert o["failed"] == [2], (rank, o)
        assert o["broadcast"] and o["all_reduce"], f"rank {rank}: {o}"
        assert o["epoch"] == 1, f"rank {rank}: the group was built anew, not shrunk from the old one"


def test_a_live_rank_excluded_keeps_nothing():
    """Ranks 0 and 1 exclude rank 2, alive and waiting in a receive from rank 0: its receive
    fails once the survivors closed their connections to it (the ABORT says why); rank 0's
    pending receive on the old group fails (SHRINK_ABORT); the survivors' group works."""
    outcomes = _run(3, J.exclude_live_rank, {"TDIST_TCP_CONNECT": "all"})
    for rank in (0, 1):
        o = outcomes[rank]
        assert not isinstance(o, RankFailure), (rank, o)
        assert o["all_reduce"] and o["epoch"] == 1 and o["peers"] == [1 - rank], (rank, o)
    assert outcomes[0]["pending_error"] is not None, "rank 0's pending receive on the old group did not fail"
    excluded = outcomes[2]
    assert not isinstance(excluded, RankFailure) and excluded["error"] is not None, excluded
    assert "excluded" in excluded["error"] or "rank 0" in excluded["error"], excluded


def test_after_an_abort_every_survivor_builds_anew():
    """A member aborted the group (its connections are gone): every survivor, not only it,
    builds the shrunken group through the store (epoch 0), and it works."""
    outcomes = _run(4, J.abort_then_shrink, {})
    for rank, o in enumerate(_survivor_outcomes(outcomes, [3])):
        assert o["all_reduce"] and o["epoch"] == 0, (rank, o)


# ------------------------------------------------------------------ the link protocol
def _pair(epoch: int = 0):
    """Two transports (ranks 0 and 1 of a group of 3) joined by a socket pair."""
    from tdist_tcp.net.transport import Transport

    a, b = socket.socketpair()
    return Transport(0, 3, {1: [a]}, 5.0, epoch=epoch), Transport(1, 3, {0: [b]}, 5.0, epoch=epoch)


def _coll_frame(value: float, seq: int = 1):
    import torch
    from tdist_tcp.protocol.wire import COLL, OP_CODES, byte_view, pack_header

    t = torch.full((4,), value)
    return pack_header(COLL, OP_CODES["broadcast"], 0, 6, 0, seq, t.nbytes), byte_view(t)


def _recv_coll(tr, src: int, seq: int = 1, wait: float = 5.0):
    import torch
    from tdist_tcp.protocol.wire import OP_CODES, byte_view

    out = torch.zeros(4)
    pr = tr.post_coll(src, byte_view(out), OP_CODES["broadcast"], 0, seq, 6)
    tr.wait_coll(pr, time.monotonic() + wait)
    return out.tolist()


def _successor(tr, peer_old: int, epoch: int):
    from tdist.plugin import DistBackendError
    from tdist_tcp.net.transport import Transport

    new = Transport(tr.rank, 2, {}, 5.0, epoch=epoch)
    links = tr.retire(DistBackendError("shrunk"), new, {0: 0, 1: 1})
    assert new.adopt(peer_old, links[peer_old], 2.0)
    return new


@pytest.mark.parametrize("order", ["receiver-first", "sender-first"])
def test_link_epochs_drop_the_old_groups_frames(order):
    """An old frame stashed, and another sent after the receiver took the link over (before
    the sender's MARK), are both dropped; the new group's frame with the same identity is
    delivered -- whether the receiver hands over first, or the sender (its MARK then
    parks the receiver's link until the receiver hands over)."""
    a, b = _pair()
    try:
        a.send(1, *_coll_frame(10.0))  # stashed by b's old transport
        time.sleep(0.2)
        if order == "receiver-first":
            nb = _successor(b, 0, 1)
            a.send(1, *_coll_frame(11.0))  # b already took the link: dropped (before a's MARK)
            na = _successor(a, 1, 1)
        else:
            na = _successor(a, 1, 1)
            na.send(1, *_coll_frame(12.0))  # after a's MARK, which parks b's link
            time.sleep(0.2)
            nb = _successor(b, 0, 1)
        if order == "receiver-first":
            na.send(1, *_coll_frame(12.0))
        assert _recv_coll(nb, 0) == [12.0] * 4
        na.send(1, *_coll_frame(13.0, seq=2))
        assert _recv_coll(nb, 0, seq=2) == [13.0] * 4
        nb.send(0, *_coll_frame(14.0))  # and the other way
        assert _recv_coll(na, 1) == [14.0] * 4
        na.close(0.5)
        nb.close(0.5)
    finally:
        a.close(0.0)
        b.close(0.0)


def test_old_transport_cannot_send_on_a_link_handed_over():
    from tdist.plugin import DistBackendError

    a, b = _pair()
    try:
        na, nb = _successor(a, 1, 1), _successor(b, 0, 1)
        with pytest.raises(DistBackendError):
            a.send(1, *_coll_frame(1.0))
        na.send(1, *_coll_frame(2.0))
        assert _recv_coll(nb, 0) == [2.0] * 4
        na.close(0.5)
        nb.close(0.5)
    finally:
        a.close(0.0)
        b.close(0.0)


def test_a_frame_cut_short_is_completed_before_the_mark():
    """A send of the old group that gave up mid-frame leaves bytes owed: the MARK goes
    after them (zeros), so the receiver still reads whole frames."""
    a, b = _pair()
    try:
        link = a.peers[1].links[0]
        header, payload = _coll_frame(7.0)
        with link.send_lock:
            link.sock.sendall(header + bytes(payload[:5]))  # a frame cut short
            link.owed = len(payload) - 5
        na, nb = _successor(a, 1, 1), _successor(b, 0, 1)
        na.send(1, *_coll_frame(8.0))
        assert _recv_coll(nb, 0) == [8.0] * 4
        na.close(0.5)
        nb.close(0.5)
    finally:
        a.close(0.0)
        b.close(0.0)


def test_an_abort_names_the_rank_whose_loss_it_relays():
    """A rank that breaks its group because rank 2 died tells its peers so: their error
    blames rank 2 (the agreement then does not suspect the messenger), not rank 0."""
    from tdist.plugin import DistBackendError
    from tdist_tcp.net.transport import Transport

    a_sock, b_sock = socket.socketpair()
    a = Transport(0, 3, {1: [a_sock]}, 5.0, global_ranks=[10, 11, 12])
    b = Transport(1, 3, {0: [b_sock]}, 5.0, global_ranks=[10, 11, 12])
    try:
        lost = DistBackendError("rank 2 died")
        lost.failed_peer = 12
        a.fail(lost)
        deadline = time.monotonic() + 5.0
        while b.broken is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert b.broken is not None and "rank 2 died" in str(b.broken), b.broken
        assert b.broken.failed_peer == 12, b.broken.failed_peer
        plain = Transport(0, 2, {}, 5.0, global_ranks=[10, 11])
        assert plain.abort_error(b.peers[0], b'{"reason": "x"}').failed_peer == 10  # no relay: the sender
    finally:
        a.close(0.0)
        b.close(0.0)


def test_a_connection_still_being_opened_goes_to_the_new_group():
    """Rank 0's old group was opening a connection to rank 1 (an ABORT helper's, say) when
    it retired; rank 1 accepted it before it retired (so it takes it over): when rank 0's
    connect completes, the connection is the new group's on both ends."""
    from tdist.plugin import DistBackendError
    from tdist_tcp.net.transport import Transport

    a_sock, b_sock = socket.socketpair()
    a, b = Transport(0, 3, {}, 5.0), Transport(1, 3, {0: [b_sock]}, 5.0)  # b accepted; a's connect still runs
    na, nb = Transport(0, 2, {}, 5.0, epoch=1), Transport(1, 2, {}, 5.0, epoch=1)
    try:
        assert a.retire(DistBackendError("shrunk"), na, {0: 0, 1: 1}) == {}
        a.attach(1, [a_sock])  # a's connect completes after it retired
        assert a.peers[1].links == [] and len(na.peers[1].links) == 1
        taken = b.retire(DistBackendError("shrunk"), nb, {0: 0, 1: 1})
        assert nb.adopt(0, taken[0], 2.0)
        na.send(1, *_coll_frame(3.0))
        assert _recv_coll(nb, 0) == [3.0] * 4
        nb.send(0, *_coll_frame(4.0))
        assert _recv_coll(na, 1) == [4.0] * 4
    finally:
        for tr in (na, nb, a, b):
            tr.close(0.0)
