"""Connections made when first needed, and threads that do not grow with the world.

Every tcp socket of a process is read by one I/O loop thread (``tdist-tcp-io``), so the
tcp threads of a process do not depend on the world size; connections are made at the
first message to a peer (the ``connect`` option: ``ring`` connects the ring neighbours at
setup, ``lazy`` none), and when two ranks contact each other at the same time exactly one
connection (the lower rank's) is kept.
"""

from __future__ import annotations

import threading
import time

import _tcp_jobs as J
import pytest
import torch
from _tcp_harness import ProcWorld, run_threads
from tdist._reduce_op import ReduceOp, Reduction

pytestmark = pytest.mark.timeout(240)
SUM = Reduction(ReduceOp.SUM)
#: the most tdist-tcp threads a process may have at any world size (I/O loop, lanes, helpers)
MAX_TCP_THREADS = 8


@pytest.mark.parametrize("world", [2, 4, 8])
def test_threads_do_not_grow_with_the_world(tmp_path, world):
    """Processes of worlds 2, 4 and 8 (TCP between them, shared memory off so that the
    collectives use the links): after one all_reduce each has at most a few tcp threads,
    the same number at every world size, and one I/O loop thread."""
    procs = ProcWorld(world, str(tmp_path))
    try:
        results = procs.run("resources_job", timeout=180, options={"shm": False, "unix": False})
    finally:
        procs.close()
    for rank, (names, _fds, peers) in enumerate(results):
        assert len(names) <= MAX_TCP_THREADS, (rank, names)
        assert names.count("tdist-tcp-io") == 1, (rank, names)
        assert peers, f"rank {rank} has no connection after an all_reduce"
    assert len({len(names) for names, _, _ in results}) == 1, results


def test_no_connection_until_first_message(tmp_path):
    """``connect="lazy"``, world 4 in processes: after init no rank has a connection; after
    rank 0 sends rank 2 one message, exactly that pair is connected."""
    procs = ProcWorld(4, str(tmp_path))
    try:
        results = procs.run("first_contact_job", timeout=120, options={"connect": "lazy", "shm": False})
    finally:
        procs.close()
    assert [before for before, _ in results] == [[]] * 4, results
    assert [after for _, after in results] == [[2], [], [0], []], results


def test_ring_neighbours_are_connected_at_setup():
    """The default (``connect="ring"``): after setup each rank is connected to its two ring
    neighbours only; a message to any other rank connects it then."""

    def body(b, rank):
        at_setup = J.connected_peers(b)
        J.looked_at_setup(b, rank)
        other = (rank + 2) % 4
        w = b.send(torch.full((2,), float(rank)), other, 5)
        t = torch.zeros(2)
        b.recv(t, other, 5).wait()
        w.wait()
        return at_setup, J.connected_peers(b), t.tolist()

    results = run_threads(4, body, options={"shm": False})
    for rank, (at_setup, after, got) in enumerate(results):
        assert at_setup == sorted({(rank - 1) % 4, (rank + 1) % 4}), (rank, at_setup)
        assert after == [0, 1, 2, 3][:rank] + [0, 1, 2, 3][rank + 1 :], (rank, after)
        assert got == [float((rank + 2) % 4)] * 2


@pytest.mark.parametrize("unix,streams", [(True, 1), (False, 1), (False, 3)])
def test_simultaneous_first_contact_keeps_one_connection(unix, streams):
    """Every rank sends to every other at the same moment (no connection yet): each pair
    ends with exactly one set of links (one connection, or ``streams`` of them) and every
    message arrives, in order. Repeated to meet the races."""
    world = 4
    for _round in range(4):
        gate = threading.Barrier(world)

        def body(b, rank, gate=gate):
            gate.wait(10)
            works = [b.send(torch.tensor([rank * 10.0 + q, 1.0]), q, 1) for q in range(world) if q != rank]
            works += [b.send(torch.tensor([rank * 10.0 + q, 2.0]), q, 1) for q in range(world) if q != rank]
            got = {}
            for q in range(world):
                if q != rank:
                    first, second = torch.zeros(2), torch.zeros(2)
                    b.recv(first, q, 1).wait()
                    b.recv(second, q, 1).wait()
                    got[q] = (first.tolist(), second.tolist())
            for w in works:
                w.wait()
            b.barrier().wait()
            links = {p.rank: len(p.links) for p in b._tr.peers if p is not None}
            return got, links

        options = {"connect": "lazy", "shm": False, "unix": unix, "streams": streams}
        results = run_threads(world, body, options=options, timeout=60)
        for rank, (got, links) in enumerate(results):
            expected = {q: ([q * 10.0 + rank, 1.0], [q * 10.0 + rank, 2.0]) for q in range(world) if q != rank}
            assert got == expected, (rank, got)
            assert set(links.values()) == {1 if unix else streams}, (rank, links)


def test_collective_timeout_names_a_rank_never_connected():
    """``connect="lazy"``: a rank that never joins a collective is named by the timeout
    verdict of ranks that were never connected to it (the probe connects)."""

    def body(b, rank):
        if rank == 3:
            time.sleep(4.0)  # alive (its listener serves) but never joins
            return None
        return J.describe_error(lambda: b.all_reduce(torch.ones(4), SUM).wait())

    results = run_threads(4, body, backend_timeout=1.0, options={"connect": "lazy", "shm": False}, timeout=60)
    for rank in range(3):
        name, text, _elapsed = results[rank]
        assert name == "DistBackendTimeoutError", (rank, text)
        assert "rank 3" in text, (rank, text)


def test_message_to_a_rank_that_left_fails_at_once():
    """``connect="lazy"``: a send to a rank that destroyed its group before anyone connected
    to it fails at once (its listener refuses), naming it, instead of waiting out the timeout."""

    def body(b, rank):
        if rank == 1:
            return None  # shuts its group down at once
        time.sleep(0.5)
        return J.describe_error(lambda: b.send(torch.ones(2), 1, 0).wait())

    results = run_threads(2, body, backend_timeout=30.0, options={"connect": "lazy"}, timeout=60)
    name, text, elapsed = results[0]
    assert name == "DistBackendError" and "rank 1" in text and "shut down" in text, text
    assert elapsed < 10, elapsed


def test_a_broken_group_tells_ranks_it_never_connected_to():
    """``connect="lazy"``: rank 0 breaks its group before any connection exists; its ABORT
    frames still reach every rank (it connects to tell them), which then fail at once
    instead of waiting out the timeout."""
    from tdist._errors import DistBackendError

    def body(b, rank):
        if rank == 0:
            b._tr.fail(DistBackendError("tcp backend: rank 0 gave up (test)"))
            time.sleep(3.0)  # alive while the others look
            return None
        time.sleep(1.0)
        return J.describe_error(lambda: b.all_reduce(torch.ones(4), SUM).wait())

    results = run_threads(4, body, backend_timeout=30.0, options={"connect": "lazy", "shm": False}, timeout=60)
    for rank in range(1, 4):
        name, text, elapsed = results[rank]
        assert name == "DistBackendError" and "rank 0 gave up" in text, (rank, text)
        assert elapsed < 5, (rank, elapsed)
