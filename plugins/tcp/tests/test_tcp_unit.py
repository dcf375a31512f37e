"""In-process unit tests: wire format, byte views, reduction helpers, lanes."""

from __future__ import annotations

import struct
import threading
import time

import pytest
import torch
from tdist._errors import DistBackendError
from tdist._reduce_op import ReduceOp, Reduction, make_premul_sum
from tdist.reduction import check_reduction, combine_, finalize_, prescale_, prescaled
from tdist_tcp.collectives import algorithms as algo
from tdist_tcp.protocol import wire
from tdist_tcp.collectives.lanes import Lane, TcpWork

pytestmark = pytest.mark.timeout(60)

ALL_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


# -------------------------------------------------------------------- wire
def test_header_roundtrip_and_size():
    head = wire.pack_header(
        wire.COLL, wire.OP_CODES["all_reduce"], 1, wire.dtype_code(torch.float16), -5, 7, 12345, (2, 3)
    )
    assert len(head) == wire.HEADER.size + 16
    magic, kind, op, redop, dtype, ndim, tag, seq, nbytes = wire.HEADER.unpack_from(head)
    assert (magic, kind, op, redop, ndim, tag, seq, nbytes) == (
        wire.FRAME_MAGIC,
        wire.COLL,
        wire.OP_CODES["all_reduce"],
        1,
        2,
        -5,
        7,
        12345,
    )
    assert wire.dtype_name(dtype) == "float16"
    assert struct.unpack_from("<2q", head, wire.HEADER.size) == (2, 3)


def test_huge_ndim_is_flattened():
    head = wire.pack_header(wire.P2P, 1, 0, 1, 0, 0, 8, tuple([1] * 100))
    assert wire.HEADER.unpack_from(head)[5] == 1


def test_dtype_codes_unique_and_named():
    codes = [wire.dtype_code(d) for d in ALL_DTYPES]
    assert len(set(codes)) == len(codes) and 255 not in codes
    assert wire.dtype_name(wire.dtype_code(torch.complex128)) == "complex128"


def test_describe_names_op_seq_dtype_size():
    text = wire.describe(
        wire.OP_CODES["all_reduce"], wire.redop_code(Reduction(ReduceOp.SUM)), 7, wire.dtype_code(torch.float32), 16
    )
    assert text == "all_reduce(SUM)#7 float32 x 16 bytes"
    assert wire.describe(wire.OP_CODES["all_reduce"], 1, 7, 1, 16, part=(1 << 32) | 5).startswith(
        "all_reduce(SUM)#7[step 1 part 5] "
    )
    assert "[fold]" in wire.describe(wire.OP_CODES["all_reduce"], 1, 7, 1, 16, part=wire.PART_FOLD)
    assert wire.describe(wire.OP_ACK, 0, 3, 0, 0).startswith("acknowledgement#3")


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_byte_view_every_dtype_is_zero_copy(dtype):
    t = torch.zeros(5, dtype=dtype)
    view = wire.byte_view(t)
    assert view.nbytes == 5 * t.element_size() and view.format == "B" and not view.readonly
    src = torch.ones(5, dtype=dtype)
    view[:] = wire.byte_view(src)
    assert torch.equal(t, src)


def test_byte_view_scalar_and_empty():
    assert wire.byte_view(torch.tensor(3.0)).nbytes == 4
    assert wire.byte_view(torch.empty(0, dtype=torch.complex64)).nbytes == 0
    t = torch.ones(3, requires_grad=True)
    assert wire.byte_view(t).nbytes == 12


# ---------------------------------------------------------------- reduction
@pytest.mark.parametrize(
    "op,dtype,error",
    [
        (ReduceOp.BAND, torch.float32, TypeError),
        (ReduceOp.BXOR, torch.complex64, TypeError),
        (ReduceOp.AVG, torch.bool, TypeError),
        (ReduceOp.MIN, torch.complex64, TypeError),
        (ReduceOp.MAX, torch.complex128, TypeError),
        (ReduceOp.PRODUCT, torch.complex64, TypeError),
    ],
)
def test_check_reduction_rejects(op, dtype, error):
    with pytest.raises(error, match=op.name):
        check_reduction(Reduction(op), dtype, "tcp")


def test_check_reduction_premul_sum_factor():
    check_reduction(make_premul_sum(2.0), torch.bfloat16, "tcp")
    check_reduction(make_premul_sum(3), torch.int32, "tcp")
    check_reduction(make_premul_sum(1j), torch.complex64, "tcp")
    with pytest.raises(TypeError):
        check_reduction(make_premul_sum(2.5), torch.int64, "tcp")
    with pytest.raises(TypeError):
        check_reduction(make_premul_sum(1j), torch.float32, "tcp")
    with pytest.raises(TypeError):
        check_reduction(make_premul_sum(2), torch.bool, "tcp")
    with pytest.raises(ValueError):
        check_reduction(Reduction(ReduceOp.PREMUL_SUM, None), torch.float32, "tcp")
    with pytest.raises(ValueError):
        check_reduction(Reduction(ReduceOp.PREMUL_SUM, torch.ones(2)), torch.float32, "tcp")
    with pytest.raises(TypeError):
        check_reduction(Reduction(ReduceOp.PREMUL_SUM, "x"), torch.float32, "tcp")


@pytest.mark.parametrize(
    "op,expected",
    [
        (ReduceOp.SUM, [True, True, True, False]),
        (ReduceOp.MAX, [True, True, True, False]),
        (ReduceOp.PRODUCT, [True, False, False, False]),
        (ReduceOp.MIN, [True, False, False, False]),
        (ReduceOp.BAND, [True, False, False, False]),
        (ReduceOp.BOR, [True, True, True, False]),
        (ReduceOp.BXOR, [False, True, True, False]),
    ],
)
def test_combine_bool(op, expected):
    a = torch.tensor([True, True, False, False])
    combine_(a, torch.tensor([True, False, True, False]), Reduction(op))
    assert a.tolist() == expected and a.dtype == torch.bool


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX])
def test_combine_numeric(dtype, op):
    a = torch.tensor([1, 5, 3], dtype=dtype)
    b = torch.tensor([4, 2, 3], dtype=dtype)
    ref = {ReduceOp.SUM: [5, 7, 6], ReduceOp.PRODUCT: [4, 10, 9], ReduceOp.MIN: [1, 2, 3], ReduceOp.MAX: [4, 5, 3]}
    assert combine_(a, b, Reduction(op)).tolist() == ref[op] and a.dtype == dtype


def test_combine_complex_and_bitwise():
    a = torch.tensor([1 + 2j, 3j], dtype=torch.complex64)
    combine_(a, torch.tensor([1j, 2], dtype=torch.complex64), Reduction(ReduceOp.PRODUCT))
    assert a.tolist() == [(-2 + 1j), 6j]
    x = torch.tensor([0b1100, 0b1010], dtype=torch.int16)
    combine_(x, torch.tensor([0b1010, 0b0110], dtype=torch.int16), Reduction(ReduceOp.BXOR))
    assert x.tolist() == [0b0110, 0b1100]


def test_prescale_and_finalize_keep_dtype():
    half = torch.ones(3, dtype=torch.float16)
    op = make_premul_sum(torch.tensor([2.5], dtype=torch.float64))  # a shape-[1] float64 factor
    assert prescaled(half, op).dtype == torch.float16 and prescaled(half, op).tolist() == [2.5] * 3
    assert half.tolist() == [1.0] * 3  # prescaled does not modify
    prescale_(half, op)
    assert half.tolist() == [2.5] * 3
    t = torch.tensor(6.0, dtype=torch.bfloat16)  # 0-dim
    prescale_(t, op)
    assert t.item() == 15.0 and t.dim() == 0
    avg = torch.tensor([6.0, 3.0])
    finalize_(avg, Reduction(ReduceOp.AVG), 3)
    assert avg.tolist() == [2.0, 1.0]
    plain = torch.ones(2)
    assert prescaled(plain, Reduction(ReduceOp.SUM)) is plain
    assert finalize_(plain, Reduction(ReduceOp.SUM), 4).tolist() == [1.0, 1.0]


def test_serial_helpers_match_whole_tensor_ops():
    a = torch.randn(100_003)
    b = torch.randn(100_003)
    want = torch.maximum(a, b)
    algo.combine_serial(a, b, Reduction(ReduceOp.MAX))
    assert torch.equal(a, want)
    out = torch.empty(100_003)
    algo.copy_serial(out, b)
    assert torch.equal(out, b)


def test_segments():
    assert algo.segments(0, 4) == []
    assert algo.segments(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert algo.segments(3, 10) == [(0, 3)]


# -------------------------------------------------------------------- lanes
def test_lane_runs_job_in_the_waiting_thread():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    ran_in = []
    work = TcpWork("job", 10.0)
    lane.submit(lambda: ran_in.append(threading.current_thread()) or [1], work)
    assert work.wait() and work.result() == [1]
    assert ran_in == [threading.current_thread()]
    lane.close()


def test_lane_starts_a_job_waited_for_through_its_future_at_once():
    """A Work waited for through its future (torch's DDP waits for every bucket so) has no
    waiter to run it inline: the worker starts it (and the jobs queued before it) without
    the grace period, here 60 s, which the future would otherwise wait out."""
    lane = Lane("test-lane", grace=60.0, inline_limit=1.0)
    try:
        ran_in = []
        first, second = TcpWork("first", 10.0), TcpWork("second", 10.0)
        lane.submit(lambda: ran_in.append(threading.current_thread()) or [1], first)
        lane.submit(lambda: ran_in.append(threading.current_thread()) or [2], second)
        assert second.get_future().wait() == [2]
        assert first.is_completed() and first.result() == [1]
        assert ran_in == [lane.thread(), lane.thread()]  # the worker's, not this thread
    finally:
        lane.close()


def test_lane_worker_runs_unclaimed_job_after_grace_in_order():
    lane = Lane("test-lane", grace=0.01, inline_limit=1.0)
    order = []
    works = [TcpWork(f"job{i}", 10.0) for i in range(3)]
    for i, w in enumerate(works):
        lane.submit(lambda i=i: order.append(i) or [], w)
    deadline = time.monotonic() + 5
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert order == [0, 1, 2]
    lane.close()
    assert not lane.thread().is_alive()


def test_lane_waiting_on_a_later_job_runs_earlier_ones_first():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    order = []
    works = [TcpWork(f"job{i}", 10.0) for i in range(3)]
    for i, w in enumerate(works):
        lane.submit(lambda i=i: order.append(i) or [], w)
    works[2].wait()
    assert order == [0, 1, 2] and all(w.is_completed() for w in works)
    lane.close()


def test_lane_errors_and_close():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    failing = TcpWork("bad", 10.0)
    lane.submit(lambda: 1 / 0, failing)
    with pytest.raises(ZeroDivisionError):
        failing.wait()
    queued = TcpWork("queued", 10.0)
    lane.submit(lambda: [], queued)
    lane.close(DistBackendError("closed for test"))
    with pytest.raises(DistBackendError, match="closed for test"):
        queued.wait()
    late = TcpWork("late", 10.0)
    lane.submit(lambda: [], late)
    with pytest.raises(DistBackendError, match="closed for test"):
        late.wait()


def test_short_wait_does_not_run_inline():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    started = threading.Event()
    release = threading.Event()
    work = TcpWork("slow", 10.0)
    lane.submit(lambda: (started.set(), release.wait(5), [])[2], work)
    with pytest.raises(TimeoutError):
        work.wait(0.05)  # short waits hand the job to the worker instead of blocking in it
    assert started.wait(5)
    release.set()
    assert work.wait(5)
    lane.close()


def test_run_now_runs_only_on_an_idle_lane_and_lets_errors_through():
    lane = Lane("test-lane", grace=5.0, inline_limit=1.0)
    ran_in = []
    assert lane.run_now(lambda: ran_in.append(threading.current_thread()))
    assert ran_in == [threading.current_thread()]
    with pytest.raises(ZeroDivisionError):
        lane.run_now(lambda: 1 / 0)
    queued = TcpWork("queued", 10.0)
    lane.submit(lambda: [], queued)
    assert not lane.run_now(lambda: ran_in.append("jumped the queue"))  # FIFO: the queued job first
    queued.wait()
    assert lane.run_now(lambda: ran_in.append("after"))
    assert ran_in[1:] == ["after"]
    lane.close()
    assert not lane.run_now(lambda: ran_in.append("closed"))


# ---------------------------------------------------------------- addresses
class _FakeServerStore:
    host = "localhost"
    port = 29500


class _FakePrefixStore:
    def __init__(self, inner):
        self._store = inner

    def get(self, key):  # looks like a store to the endpoint walk
        raise KeyError(key)

    def set(self, key, value):
        pass


def test_choose_host_order(monkeypatch):
    from tdist_tcp.net.mesh import HOST_ENV, IFNAME_ENV, choose_host

    monkeypatch.delenv(HOST_ENV, raising=False)
    monkeypatch.delenv(IFNAME_ENV, raising=False)
    wrapped = _FakePrefixStore(_FakePrefixStore(_FakeServerStore()))
    assert choose_host(wrapped, {}) == "127.0.0.1"  # the route to the store's (loopback) server
    assert choose_host(wrapped, {"host": "10.9.8.7"}) == "10.9.8.7"
    monkeypatch.setenv(HOST_ENV, "10.1.2.3")
    assert choose_host(wrapped, {}) == "10.1.2.3"
    monkeypatch.delenv(HOST_ENV)
    assert choose_host(wrapped, {"ifname": "lo"}) == "127.0.0.1"


# ------------------------------------------------------- stashed frames
def _transport_and_peer():
    """A Transport of rank 0 in a group of 2, and the raw socket that plays rank 1."""
    import socket

    from tdist_tcp.net.transport import Transport

    mine, theirs = socket.socketpair()
    return Transport(0, 2, {1: [mine]}, 10.0), theirs


def _wait_until(predicate, limit: float = 5.0) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_posting_a_receive_never_waits_for_a_frame_still_arriving():
    """A collective frame that started arriving before its receive was posted (so the
    reader stashes it) is claimed at once: the post returns while the rest of the frame
    is still on its way (a rank starting its own sends late would otherwise idle its
    link), and the receive completes with the whole payload once it is in."""
    tr, peer = _transport_and_peer()
    try:
        payload = bytes(range(256)) * 4096  # 1 MiB
        head = wire.pack_header(wire.COLL, 1, 2, 3, 7, 5, len(payload))
        peer.sendall(head + payload[:1000])
        _wait_until(lambda: len(tr.peers[1].links[0].coll_stash) == 1)
        dest = bytearray(len(payload))
        started = time.monotonic()
        pr = tr.post_coll(1, memoryview(dest), 1, 2, 5, 3, 7)
        assert time.monotonic() - started < 1.0
        assert pr.done.locked(), "completed before the frame was in"
        peer.sendall(payload[1000:])
        tr.wait_coll(pr, time.monotonic() + 5)
        assert bytes(dest) == payload
    finally:
        tr.close(0.0)
        peer.close()


def test_a_stashed_frame_that_mismatches_fails_at_once():
    """The header of a stashed frame is checked when the receive is posted, before its
    payload is in: a mismatch fails the group at once."""
    tr, peer = _transport_and_peer()
    try:
        peer.sendall(wire.pack_header(wire.COLL, 1, 2, 3, 0, 5, 4096) + b"x" * 10)
        _wait_until(lambda: len(tr.peers[1].links[0].coll_stash) == 1)
        with pytest.raises(DistBackendError, match="expected .* but got"):
            tr.post_coll(1, memoryview(bytearray(4096)), 1, 2, 6, 3)
        assert tr.broken is not None
    finally:
        tr.close(0.0)
        peer.close()


def test_a_stashed_frame_cut_short_fails_its_receive():
    """The peer's connection ends in the middle of a stashed frame: the receive that
    claimed it fails with the reason instead of waiting out its deadline."""
    tr, peer = _transport_and_peer()
    try:
        peer.sendall(wire.pack_header(wire.COLL, 1, 2, 3, 0, 5, 4096) + b"x" * 10)
        _wait_until(lambda: len(tr.peers[1].links[0].coll_stash) == 1)
        pr = tr.post_coll(1, memoryview(bytearray(4096)), 1, 2, 5, 3)
        peer.close()
        with pytest.raises(DistBackendError, match="lost its connection to rank 1"):
            tr.wait_coll(pr, time.monotonic() + 5)
    finally:
        tr.close(0.0)


def test_p2p_receive_of_a_message_still_arriving_returns_at_once():
    """irecv of a message whose first bytes are stashed returns immediately; its callback
    runs (with the sender named) once the whole message is in."""
    tr, peer = _transport_and_peer()
    try:
        payload = b"p" * 200_000
        peer.sendall(wire.pack_header(wire.P2P, 0, 0, 3, 9, 1, len(payload)) + payload[:100])
        _wait_until(lambda: len(tr.peers[1].p2p_stash) == 1)
        dest = bytearray(len(payload))
        landed = threading.Event()
        pr = tr.post_p2p(None, 9, 3, memoryview(dest), lambda _pr: landed.set())
        assert not landed.is_set()
        peer.sendall(payload[100:])
        assert landed.wait(5)
        assert pr.error is None and pr.source == 1 and bytes(dest) == payload
    finally:
        tr.close(0.0)
        peer.close()


# ------------------------------------------------------------------ streams
def test_stream_count_from_option_or_environment(monkeypatch):
    from tdist_tcp.net.mesh import STREAMS_ENV, stream_count

    monkeypatch.delenv(STREAMS_ENV, raising=False)
    assert stream_count({}) == 1
    assert stream_count({"streams": "4"}) == 4
    monkeypatch.setenv(STREAMS_ENV, "3")
    assert stream_count({}) == 3
    assert stream_count({"streams": 2}) == 2  # the option wins
    for bad in (0, -1, 65, "two"):
        with pytest.raises(ValueError, match="streams must be a whole number from 1 to 64"):
            stream_count({"streams": bad})


def test_hello_names_the_stream_and_refuses_impossible_ones():
    from tdist_tcp.protocol.auth import MAX_STREAMS, make_hello, parse_hello

    nonce = b"n" * 16
    hello = parse_hello(make_hello(nonce, 1, 4, True, 2, 3), nonce, 4)
    assert hello is not None and (hello.rank, hello.stream, hello.streams) == (1, 2, 3)
    assert parse_hello(make_hello(nonce, 1, 4, False), nonce, 4).streams == 1  # type: ignore[union-attr]
    assert parse_hello(make_hello(nonce, 1, 4, True, 3, 3), nonce, 4) is None
    assert parse_hello(make_hello(nonce, 1, 4, True, 0, MAX_STREAMS + 1), nonce, 4) is None


def test_segments_take_turns_on_the_links_of_a_pair():
    """With two links to a peer, segment k of a collective travels on link k % 2 both
    ways: frames on one link complete their receives while the other link is silent,
    and a link that ends without a goodbye breaks the group naming the peer."""
    import socket

    from tdist_tcp.net.transport import Transport

    pairs = [socket.socketpair() for _ in range(2)]
    tr = Transport(0, 2, {1: [mine for mine, _ in pairs]}, 10.0)
    theirs = [peer for _, peer in pairs]
    try:
        dests = [bytearray(4) for _ in range(4)]
        prs = [tr.post_coll(1, memoryview(d), 1, 2, 5, 3, k) for k, d in enumerate(dests)]
        for k in (1, 3):  # link 1 only
            theirs[1].sendall(wire.pack_header(wire.COLL, 1, 2, 3, k, 5, 4) + bytes([k]) * 4)
        for k in (1, 3):
            tr.wait_coll(prs[k], time.monotonic() + 5)
        assert prs[0].done.locked() and prs[2].done.locked()
        for k in (0, 2):
            theirs[0].sendall(wire.pack_header(wire.COLL, 1, 2, 3, k, 5, 4) + bytes([k]) * 4)
        for k in (0, 2):
            tr.wait_coll(prs[k], time.monotonic() + 5)
        assert [bytes(d) for d in dests] == [bytes([k]) * 4 for k in range(4)]

        header = wire.pack_header(wire.COLL, 1, 2, 3, 7, 5, 4)
        tr.send(1, header, memoryview(b"abcd"), part=7)  # segment 7: link 1
        theirs[1].settimeout(5)
        assert theirs[1].recv(64) == header + b"abcd"

        theirs[1].close()
        _wait_until(lambda: tr.broken is not None)
        assert "lost its connection to rank 1" in str(tr.broken)
    finally:
        tr.close(0.0)
        for sock in theirs:
            sock.close()
