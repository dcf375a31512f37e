"""Multi-rank tests with every rank a thread of this process (real sockets, fast to start).

Cover the algorithms at odd and even world sizes, bitwise agreement, mismatch
detection, timeouts, connection setup, handshake refusal, async progress and
thread cleanup. ``test_tcp_processes.py`` repeats the essentials across processes.
"""

from __future__ import annotations

import re
import socket
import threading
import time

import _tcp_jobs as J
import pytest
import torch
from tdist.plugin import HashStore
from _tcp_harness import make_backend, record, run_threads
from tdist._errors import DistBackendTimeoutError
from tdist._reduce_op import ReduceOp, Reduction
from tdist_tcp.protocol.auth import HELLO

pytestmark = pytest.mark.timeout(90)
SUM = Reduction(ReduceOp.SUM)


def _tcp_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("tdist-tcp")}


@pytest.mark.parametrize(
    "world,unix,streams",
    [(1, True, 1), (2, True, 1), (3, True, 1), (4, True, 1), (5, True, 1), (3, False, 1), (3, False, 3), (4, True, 2)],
)
def test_collectives_and_p2p(world, unix, streams):
    """The suites over Unix-domain sockets or TCP; with ``streams``, every TCP pair uses
    that many connections (a Unix-domain pair always one)."""

    def body(b, rank):
        fails = J.all_reduce_suite(b, rank) + J.collectives_suite(b, rank)
        fails += J.p2p_suite(b, rank) if world > 1 else []
        peers = [p for p in b._tr.peers if p is not None and p.links]  # those connected (when first needed)
        kinds = {link.sock.family.name for p in peers for link in p.links}
        fails += [] if world == 1 or kinds == {"AF_UNIX" if unix else "AF_INET"} else [f"connections {kinds}"]
        links = {len(p.links) for p in peers}
        if world > 1 and links != {1 if unix else streams}:
            fails.append(f"links per peer {links}")
        return fails

    options = {"unix": unix, "streams": streams}
    assert run_threads(world, body, options=options, timeout=80) == [[]] * world


@pytest.mark.parametrize("world,streams", [(2, 1), (3, 1), (5, 1), (3, 3), (4, 2)])
def test_segmented_ring_chain_and_tree(world, streams):
    """Tiny thresholds: every large-message path with many segments per step (with
    ``streams``, the segments of each step spread over several TCP connections)."""

    def body(b, rank):
        return J.all_reduce_suite(b, rank, sizes=(203,)) + J.collectives_suite(b, rank, n=101)

    options = {"ring_threshold": 64, "segment_bytes": 96, "streams": streams, "unix": streams == 1}
    assert run_threads(world, body, options=options, timeout=80) == [[]] * world


@pytest.mark.parametrize(
    "world,options",
    [
        (3, {}),
        (5, {}),
        (3, {"ring_threshold": 64, "segment_bytes": 200}),
        (5, {"ring_threshold": 64, "segment_bytes": 200}),
    ],
)
def test_results_bitwise_identical_on_all_ranks(world, options):
    digests = run_threads(world, lambda b, r: J.bitwise_digest(b, r, 1001, seed=world), options=options)
    assert len(set(digests)) == 1


@pytest.mark.parametrize(
    "kind,expect",
    [
        # whichever rank notices first names both sides
        (
            "op",
            r"expected (all_reduce\(SUM\)#1(\[[^]]*\])? float32 x 16 bytes from rank 0 but got broadcast#1 float32 x 16 "
            r"bytes|acknowledgement#1 .* but got all_reduce\(SUM\)#1(\[[^]]*\])? float32 x 16 bytes)",
        ),
        ("size", r"x 16 bytes"),
        ("dtype", r"int32"),
        ("redop", r"MAX"),
        (
            "root",
            r"expected acknowledgement#1 .* but got broadcast#1 float32 x 16 bytes"
            r"|expected broadcast#1 float32 x 16 bytes \(root \d\) from rank \d but got broadcast#1 .*\(root \d\)",
        ),
    ],
)
def test_mismatched_collectives_raise_on_every_rank(kind, expect):
    results = run_threads(3, lambda b, r: J.mismatch_job(b, r, kind), backend_timeout=20)
    messages = []
    for rank, (first, later, p2p_later) in enumerate(results):
        # every rank raises, the broadcast root too (it waits for its children's acknowledgements)
        assert first[0] == "DistBackendError", (rank, first)
        assert first[2] < 10, f"rank {rank} took {first[2]:.1f} s to notice"
        assert later[0] == "DistBackendError" and later[2] < 5, (rank, later)  # the group is broken everywhere
        assert p2p_later[0] == "DistBackendError", (rank, p2p_later)
        messages.append(first[1])
    text = "\n".join(messages)
    assert re.search(expect, text), text
    assert "tcp backend: rank" in text


def test_collective_timeout_names_op_and_peer():
    def body(b, rank):
        if rank == 1:
            time.sleep(2.0)  # never joins the all_reduce
            return None
        return J.describe_error(lambda: b.all_reduce(torch.ones(4), SUM).wait())

    results = run_threads(2, body, backend_timeout=0.7)
    name, text, elapsed = results[0]
    assert name == "DistBackendTimeoutError", text
    assert "all_reduce(SUM)#1" in text and "rank 1" in text and "0.7 s" in text
    assert 0.5 < elapsed < 3


def test_recv_timeout_cancels_and_later_message_is_not_lost():
    def body(b, rank):
        if rank == 0:
            t = torch.zeros(2)
            err = J.describe_error(lambda: b.recv(t, 1, 0).wait(0.3))  # explicit short wait
            t1 = torch.zeros(2)
            err_default = J.describe_error(lambda: b.recv(t1, 1, 1).wait())  # the group timeout (1.5 s)
            b.barrier().wait()  # now rank 1 sends
            t2 = torch.zeros(2)
            b.recv(t2, 1, 0).wait()
            return err, err_default, t.tolist(), t2.tolist()
        time.sleep(1.2)  # rank 0 enters the barrier at ~1.8 s, before this one's 1.5 s run out
        b.barrier().wait()
        b.send(torch.tensor([1.0, 2.0]), 0, 0).wait()
        return None

    (name, text, elapsed), default, stale, fresh = run_threads(2, body, backend_timeout=1.5)[0]
    assert name == "DistBackendTimeoutError" and "recv" in text and "rank 1" in text, text
    assert default[0] == "DistBackendTimeoutError" and "tag 1" in default[1] and 1.0 < default[2] < 4, default
    assert stale == [0.0, 0.0] and fresh == [1.0, 2.0]


def test_p2p_size_or_dtype_mismatch_fails_the_recv_only():
    def body(b, rank):
        if rank == 0:
            b.send(torch.ones(4), 1, 0).wait()
            b.send(torch.ones(2, dtype=torch.float64), 1, 0).wait()
            b.send(torch.ones(3), 1, 0).wait()
            b.barrier().wait()
            return None
        errs = [
            J.describe_error(lambda: b.recv(torch.empty(5), 0, 0).wait()),
            J.describe_error(lambda: b.recv(torch.empty(4), 0, 0).wait()),
        ]
        t = torch.zeros(3)
        b.recv(t, 0, 0).wait()
        b.barrier().wait()  # the group still works
        return errs, t.tolist()

    errs, last = run_threads(2, body)[1]
    assert errs[0][0] == "DistBackendError" and "float32 x 20 bytes" in errs[0][1] and "x 16 bytes" in errs[0][1]
    assert errs[1][0] == "DistBackendError" and "float64" in errs[1][1]
    assert last == [1.0, 1.0, 1.0]


def test_any_source_recv_reports_sender_and_preserves_pair_order():
    def body(b, rank):
        if rank == 0:
            got = []
            for _ in range(6):
                t = torch.zeros(1)
                w = b.recv(t, None, 0)
                w.wait()
                got.append((w.source_rank(), int(t.item())))
            return got
        for k in range(3):
            b.send(torch.tensor([float(rank * 10 + k)]), 0, 0).wait()
        return None

    got = run_threads(3, body)[0]
    for src in (1, 2):
        assert [v for s, v in got if s == src] == [src * 10, src * 10 + 1, src * 10 + 2]


def test_setup_timeout_names_ranks_that_never_arrived():
    results = run_threads(3, lambda b, r: None, ranks=[0, 1], backend_timeout=1.0, raise_errors=False, timeout=20)
    for rank in (0, 1):
        exc = results[rank]
        assert isinstance(exc, DistBackendTimeoutError), repr(exc)
        assert "[2]" in str(exc) and "never arrived" in str(exc), str(exc)


def test_bad_handshakes_are_refused_and_setup_continues():
    store = HashStore()
    out = {}

    def rank0():
        b = make_backend(store, 0, 2, 10.0)
        t = torch.ones(3)
        b.all_reduce(t, SUM).wait()
        out["sum"] = t.tolist()
        b.shutdown()

    thread = threading.Thread(target=rank0)
    thread.start()
    where = record(store, 0, timeout=10).address
    host, port = where.host, where.port
    for junk in (b"GET / HTTP/1.0\r\n\r\n" + b"x" * 40, b"TDISTTCP" + b"\0" * (HELLO.size - 8)):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(junk)
            try:
                assert s.recv(100) == b""  # closed without an answer
            except ConnectionResetError:
                pass
    silent = socket.create_connection((host, int(port)), timeout=5)  # says nothing at all
    b1 = make_backend(store, 1, 2, 10.0)
    t = torch.ones(3)
    b1.all_reduce(t, SUM).wait()
    b1.shutdown()
    thread.join(10)
    silent.close()
    assert out["sum"] == [2.0, 2.0, 2.0] and t.tolist() == [2.0, 2.0, 2.0]


def test_async_collective_progresses_while_caller_blocks_elsewhere():
    """Rank 0 issues an async all_reduce, then blocks in a recv that rank 1 only sends
    after its own all_reduce completed: needs the collective to run without a wait."""

    def body(b, rank):
        t = torch.full((5,), float(rank + 1))
        if rank == 0:
            w = b.all_reduce(t, SUM)
            r = torch.zeros(1)
            b.recv(r, 1, 0).wait()
            w.wait()
            return t.tolist(), r.item()
        b.all_reduce(t, SUM).wait()
        b.send(torch.tensor([42.0]), 0, 0).wait()
        return t.tolist()

    res = run_threads(2, body, backend_timeout=10, timeout=30)
    assert res[0] == ([3.0] * 5, 42.0) and res[1] == [3.0] * 5


def test_isend_is_not_queued_behind_a_pending_collective():
    def body(b, rank):
        if rank == 0:
            w = b.all_reduce(torch.ones(3), SUM)  # rank 1 joins only after receiving
            b.send(torch.tensor([7.0]), 1, 0).wait()
            w.wait()
            return "ok"
        r = torch.zeros(1)
        b.recv(r, 0, 0).wait()
        b.all_reduce(torch.ones(3), SUM).wait()
        return r.item()

    assert run_threads(2, body, timeout=30) == ["ok", 7.0]


def test_reduction_errors_raise_before_communicating():
    def body(b, rank):
        if rank == 0:
            with pytest.raises(TypeError):
                b.all_reduce(torch.ones(2), Reduction(ReduceOp.BAND))
            with pytest.raises(TypeError):
                b.reduce_scatter(
                    torch.ones(1, dtype=torch.bool), [torch.ones(1, dtype=torch.bool)] * 2, Reduction(ReduceOp.AVG)
                )
        t = torch.ones(2)
        b.all_reduce(t, SUM).wait()  # sequence numbers still agree
        return t.tolist()

    assert run_threads(2, body) == [[2.0, 2.0]] * 2


def test_shutdown_is_idempotent_and_fails_later_ops():
    def body(b, rank):
        b.barrier().wait()
        b.shutdown()
        b.shutdown()
        return J.describe_error(lambda: b.all_reduce(torch.ones(1), SUM).wait())[0]

    assert run_threads(2, body) == ["DistBackendError"] * 2


def test_no_threads_left_after_shutdown():
    before = _tcp_threads()

    def body(b, rank):
        b.all_reduce(torch.ones(100_000), SUM).wait()
        w = b.all_reduce(torch.ones(3), SUM)
        time.sleep(0.05)  # let the lane worker take it
        w.wait()
        b.send(torch.ones(1), (rank + 1) % 3, 0).wait()
        b.recv(torch.ones(1), (rank - 1) % 3, 0).wait()
        b.barrier().wait()

    for _ in range(3):
        run_threads(3, body)
    time.sleep(0.1)
    assert _tcp_threads() - before == set()


def test_broken_group_fails_pending_async_ops_promptly():
    """Rank 0 detects a mismatch; rank 2's pending async op fails through the ABORT frame."""

    def body(b, rank):
        if rank == 2:
            w = b.all_reduce(torch.ones(4), SUM)
            return J.describe_error(lambda: w.wait())
        if rank == 0:
            return J.describe_error(lambda: b.broadcast(torch.ones(4), 1).wait())
        return J.describe_error(lambda: b.all_reduce(torch.ones(4), SUM).wait())

    for name, text, elapsed in run_threads(3, body, backend_timeout=30):
        assert name == "DistBackendError" and elapsed < 10, (name, text)


def test_large_messages_posted_early_and_late():
    """Multi-MiB frames straight into a posted receive, and through the stash."""
    n = 1 << 20  # 4 MiB of float32

    def body(b, rank):
        src = torch.arange(n, dtype=torch.float32) + rank
        if rank == 0:
            early = torch.zeros(n)
            w = b.recv(early, 1, 0)  # posted before rank 1 sends
            b.barrier().wait()
            w.wait()
            b.barrier().wait()
            time.sleep(0.2)  # rank 1's second message is already here: stashed
            late = torch.zeros(n)
            b.recv(late, 1, 1).wait()
            return torch.equal(early, src + 1) and torch.equal(late, src + 1)
        b.barrier().wait()
        b.send(src, 0, 0).wait()
        b.barrier().wait()
        b.send(src, 0, 1).wait()
        return True

    assert run_threads(2, body) == [True, True]

    def ring(b, rank):
        fails = []
        for dtype, op in (
            (torch.float32, SUM),
            (torch.bfloat16, Reduction(ReduceOp.AVG)),
            (torch.int64, Reduction(ReduceOp.BXOR)),
        ):
            t = J.make(rank, 300_001, dtype)
            b.all_reduce(t, op).wait()
            if not torch.equal(t, J.expected_reduction(b.size, 300_001, dtype, op)):
                fails.append(f"{dtype} {op.name}")
        return fails

    assert run_threads(3, ring, timeout=60) == [[]] * 3


def test_isend_progresses_while_caller_waits_on_a_recv():
    """isend (small: sent at once; large: the send lane starts it at once), then a blocking
    recv that the peer answers only after receiving: must not depend on waiting the isend."""

    def body(b, rank):
        for n in (3, 1 << 18):
            if rank == 0:
                w = b.send(torch.ones(n), 1, 0)
                r = torch.zeros(1)
                b.recv(r, 1, 1).wait()
                w.wait()
                assert r.item() == n
            else:
                t = torch.zeros(n)
                b.recv(t, 0, 0).wait()
                b.send(torch.tensor([float(t.sum().item())]), 0, 1).wait()
        return True

    assert run_threads(2, body) == [True, True]
