"""The tcp backend's shared-memory collectives (tdist_tcp.shared.shm): correctness across sizes,
dtypes and reduce ops (in one round of the segment's buffers and in many), opt-out,
the whole group falling back when one rank declines, mismatch, dead peers, timeouts,
and no segment left mapped or open after destroy or a killed peer.

Each behaviour is checked on the queued path (``.wait()`` on a Work) and as a caller
that waits issues it (``blocking``: the quick path, one C call per small collective),
with the C part and without it (``native=False``: the same protocol in Python)."""

from __future__ import annotations

import os
import time

import _tcp_jobs as J
import pytest
import torch
from tdist.plugin import HashStore
from _tcp_harness import ProcWorld, run_threads
from tdist._errors import DistBackendTimeoutError
from tdist._reduce_op import ReduceOp, Reduction
from tdist_tcp.shared import native, segment, shmstep
from tdist_tcp.shared import shm as S

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not S.shm_enabled({"shm": True}), reason="shared memory needs Linux x86-64, memfd and /proc"),
]

SMALL = {"shm_slot_bytes": 16384, "shm_direct_bytes": 256}  # many rounds, two-step all_reduce early
PYTHON = {"native": False}  # no C part: the engine's Python steps only
SUITE_SIZES = ((5, 1000, 5000), 3000)  # shm_suites_job's all_reduce sizes and collectives' n
HAS_NATIVE = native.native_module({}) is not None
# (options, blocking): how the suites run
MODES = {
    "default": ({}, False),
    "small-buffers": (SMALL, False),
    "blocking": ({}, True),
    "blocking-small-buffers": (SMALL, True),
    "blocking-python": (PYTHON, True),
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    world = ProcWorld(2, str(tmp_path_factory.mktemp("tcp-shm-world2")))
    try:
        yield world
    finally:
        world.close()


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    world = ProcWorld(3, str(tmp_path_factory.mktemp("tcp-shm-world3")))
    try:
        yield world
    finally:
        world.close()


def _check_suites(results, world):
    digests = set()
    for rank, (uses_shm, failures, digest, files, mappings) in enumerate(results):
        assert uses_shm, f"rank {rank} did not use shared memory"
        assert failures == [], (rank, failures[:10])
        assert files == [], f"rank {rank}: segments still in /dev/shm: {files}"
        assert mappings == 1, f"rank {rank} maps {mappings} tdist-tcp segments (expected only its group's)"
        digests.add(digest)
    assert len(digests) == 1, "ranks disagree bitwise on all_reduce results"
    assert len(results) == world


@pytest.mark.parametrize("mode", MODES)
def test_suites_processes_2(world2, mode):
    """(with a secret: the connections and the segment authenticated)"""
    options, blocking = MODES[mode]
    results = world2.run("shm_suites_job", *SUITE_SIZES, blocking, timeout=150, options=options, secret=b"s" * 32)
    _check_suites(results, 2)


@pytest.mark.parametrize("mode", MODES)
def test_suites_processes_3(world3, mode):
    options, blocking = MODES[mode]
    _check_suites(world3.run("shm_suites_job", *SUITE_SIZES, blocking, timeout=150, options=options), 3)


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
def test_suites_threads_4(blocking):
    """Ranks that are threads of one process (they never spin: a quick collective always
    finishes through the Python wait) and 4 ranks."""
    results = run_threads(
        4, lambda b, r: J.shm_suites_job(b, r, sizes=(5, 2000), n=700, blocking=blocking), timeout=150, options=SMALL
    )
    for rank, (uses_shm, failures, _digest, _files, _maps) in enumerate(results):
        assert uses_shm and failures == [], (rank, failures[:10])
    assert len({r[2] for r in results}) == 1


@pytest.mark.skipif(not HAS_NATIVE, reason="tdist_tcp.shared._shmfast is not built")
@pytest.mark.parametrize("buffers", [{}, SMALL], ids=["one-step", "small-buffers"])
def test_c_and_python_steps_agree_bitwise_and_mix_in_one_group(world3, buffers):
    """The C part and the Python steps give bitwise identical results (random floats,
    SUM and AVG), and ranks with and without it share a group: they follow one protocol.
    With small buffers the all_reduces take two steps per round, each rank reducing its
    slice in C (``combine``) or with numpy."""
    digests = {}
    for label, options in (("c", buffers), ("python", {**buffers, **PYTHON})):
        results = world3.run("shm_suites_job", (5, 1000), 9, True, timeout=150, options=options)
        _check_suites(results, 3)
        digests[label] = results[0][2]
    assert digests["c"] == digests["python"]
    per_rank = [buffers, {**buffers, **PYTHON}, buffers]

    def body(b, rank):
        result = J.shm_suites_job(b, rank, sizes=(5, 1000), n=9, blocking=True)[:3]
        return (b._shm.fast.runs if b._shm.fast is not None else None), result

    out = run_threads(3, body, timeout=120, backend_timeout=20.0, options=per_rank)
    runs = [r for r, _ in out]
    quick = 100 if not buffers else 50  # collectives small enough for one C call (fewer with small buffers)
    assert runs[1] is None and runs[0] > quick and runs[2] > quick, runs
    for rank, (_fast, (uses_shm, failures, digest)) in enumerate(out):
        assert uses_shm and failures == [], (rank, failures[:10])
        assert digest == digests["c"], rank


@pytest.mark.skipif(not HAS_NATIVE, reason="tdist_tcp.shared._shmfast is not built")
def test_a_queued_small_all_reduce_takes_one_c_call():
    """An all_reduce waited for through its Work (as torch's API does through the bridge)
    makes the same single C call as a blocking caller's when it is small enough, and the
    Python steps otherwise."""

    def body(b, rank):
        before = b._shm.fast.runs
        small = torch.full((8,), float(rank + 1))
        b.all_reduce(small, Reduction(ReduceOp.SUM)).wait()
        avg = torch.full((8,), float(rank))
        b.all_reduce(avg, Reduction(ReduceOp.AVG)).wait()
        large = torch.ones(70000)  # over the C call's 64 KiB
        b.all_reduce(large, Reduction(ReduceOp.SUM)).wait()
        return b._shm.fast.runs - before, small.tolist(), avg.tolist(), large.unique().tolist()

    assert run_threads(2, body) == [(2, [3.0] * 8, [0.5] * 8, [2.0])] * 2


def test_large_all_reduce_matches_socket_path():
    """A multi-round all_reduce (random floats, SUM and AVG) gives what the socket path gives
    up to rounding, and every rank the same bits."""
    n = 3 * (1 << 20) + 5
    g = torch.Generator().manual_seed(7)
    inputs = [torch.randn(n, generator=g) for _ in range(2)]
    want = inputs[0] + inputs[1]

    def body(b, rank):
        t = inputs[rank].clone()
        b.all_reduce(t, Reduction(ReduceOp.SUM)).wait()
        a = inputs[rank].clone()
        b.all_reduce(a, Reduction(ReduceOp.AVG)).wait()
        return b.uses_shm, t, a

    results = run_threads(2, body, timeout=120)
    assert all(r[0] for r in results)
    assert torch.equal(results[0][1], results[1][1]) and torch.equal(results[0][2], results[1][2])
    assert torch.allclose(results[0][1], want) and torch.allclose(results[0][2], want / 2)


@pytest.mark.skipif(not HAS_NATIVE, reason="tdist_tcp.shared._shmfast is not built")
def test_large_all_reduces_read_and_write_the_peers_memory(world3):
    """Processes of one host reduce large all_reduces in their peers' own memory
    (tdist_tcp.shared.cma) from the second one on, with every result right, and the bits the
    same as the segment's way (``cma=False``) gives."""
    on = world3.run("cma_job", timeout=150)
    off = world3.run("cma_job", timeout=150, options={"cma": False})
    for results, state in ((on, "on"), (off, "off")):
        assert [r[0] for r in results] == [state] * 3
        assert all(r[1] == [] for r in results), [r[1][:5] for r in results]
        assert len({r[2] for r in results}) == 1
    assert on[0][2] == off[0][2]


@pytest.mark.parametrize("decliner", [None, 1], ids=["all-able", "one-declines"])
def test_cross_memory_is_the_whole_groups_or_nobodys(decliner):
    """Ranks that are threads of one process read each other's memory too; one rank that
    says no (``cma=False``, or no C part) keeps the whole group to the segment's way."""
    options = [{"cma": rank != decliner} for rank in range(3)]
    out = run_threads(3, J.cma_job, timeout=120, backend_timeout=20.0, options=options)
    state = "on" if decliner is None and HAS_NATIVE else "off"
    assert [r[0] for r in out] == [state] * 3 and all(r[1] == [] for r in out), [(r[0], r[1][:3]) for r in out]


@pytest.mark.parametrize("world", [3, 4])
def test_in_place_reduce_scatter_and_all_gather(world):
    """Outputs that are views of the inputs (rank r's chunk), as NCCL-style in-place calls make them."""
    n = 1000

    def body(b, rank):
        big = torch.cat([torch.full((n,), float(10 * rank + j)) for j in range(world)])
        out = big[rank * n : (rank + 1) * n]
        b.reduce_scatter_tensor(out, big, Reduction(ReduceOp.SUM)).wait()
        want = float(sum(10 * k + rank for k in range(world)))
        ok_rs = bool((out == want).all())
        gathered = torch.zeros(world * n)
        gathered[rank * n : (rank + 1) * n] = rank + 1
        b.all_gather_into_tensor(gathered, gathered[rank * n : (rank + 1) * n]).wait()
        ok_ag = torch.equal(gathered, torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(n))
        return b.uses_shm, ok_rs, ok_ag

    assert run_threads(world, body) == [(True, True, True)] * world


# ------------------------------------------------------------------ opting out
def test_opt_out_option():
    results = run_threads(2, lambda b, r: (b.uses_shm, J.all_reduce_suite(b, r, sizes=(5,))), options={"shm": False})
    assert results == [(False, [])] * 2


def test_opt_out_env(monkeypatch):
    monkeypatch.setenv(S.SHM_ENV, "0")
    results = run_threads(2, lambda b, r: b.uses_shm)
    assert results == [False, False]


@pytest.mark.parametrize("decliner", [0, 2])
def test_one_rank_declining_keeps_the_whole_group_on_sockets(decliner):
    options = [{"shm": rank != decliner} for rank in range(3)]
    out = run_threads(
        3, lambda b, r: (b.uses_shm, J.collectives_suite(b, r, n=9)), timeout=60, backend_timeout=20.0, options=options
    )
    assert out == [(False, [])] * 3
    assert J.shm_files([os.getpid()]) == []


def test_ranks_with_different_tuning_still_agree():
    """The algorithm-deciding sizes are rank 0's on every rank (no silent desync when a
    program passes different options per rank)."""
    options = [{"shm_direct_bytes": 64, "shm_slot_bytes": 1 << 16}, {"shm_direct_bytes": 1 << 20}]
    out = run_threads(
        2,
        lambda b, r: (b.uses_shm, J.all_reduce_suite(b, r, sizes=(5, 1000, 30000))),
        timeout=120,
        backend_timeout=20.0,
        options=options,
    )
    assert out == [(True, [])] * 2


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
@pytest.mark.parametrize("kind", ["op", "size", "dtype", "root", "redop"])
def test_mismatch_raises_everywhere(kind, blocking):
    results = run_threads(3, lambda b, r: (b.uses_shm, J.mismatch_job(b, r, kind, blocking)), backend_timeout=20)
    for rank, (uses_shm, (first, later, _p2p)) in enumerate(results):
        assert uses_shm
        assert first[0] == "DistBackendError" and first[2] < 10, (rank, first)
        assert later[0] == "DistBackendError", (rank, later)


def test_all_to_all_split_mismatch_raises():
    def body(b, rank):
        outs = [torch.empty(4) for _ in range(2)]
        ins = [torch.ones(4 if rank == 0 else 5) for _ in range(2)]
        return J.describe_error(lambda: b.all_to_all(outs, ins).wait())

    results = run_threads(2, body, backend_timeout=20)
    for name, text, elapsed in results:
        assert name == "DistBackendError" and elapsed < 10, (name, text)
    assert any("split sizes" in text for _n, text, _e in results), results


@pytest.mark.parametrize("blocking", [False, True], ids=["queued", "blocking"])
def test_timeout_when_a_peer_never_comes(blocking):
    def body(b, rank):
        if rank == 1:
            time.sleep(3.0)
            return None
        if blocking:
            b = J.Blocking(b)
        return J.describe_error(lambda: b.all_reduce(torch.ones(1000), Reduction(ReduceOp.SUM)).wait())

    results = run_threads(2, body, backend_timeout=1.0, timeout=60)
    name, text, elapsed = results[0]
    assert name == "DistBackendTimeoutError", (name, text)
    assert "shared memory" in text and "rank 1" in text
    assert 0.5 < elapsed < 6


@pytest.mark.parametrize("how", ["exit", "sigkill", "exit-cma"])
def test_killed_peer_fails_survivors_and_leaks_nothing(world3, how):
    pids = world3.pids()
    results = world3.run("dead_peer_job", 2, how, backend_timeout=60, dead_ok=[2], timeout=60)
    assert results[2] == "dead"
    for rank in (0, 1):
        (name, text, elapsed), later = results[rank]
        assert name == "DistBackendError" and "rank 2" in text, (rank, text)
        assert elapsed < 8, elapsed
        assert later[0] == "DistBackendError"
    assert J.shm_files(pids + [os.getpid()]) == []
    # the survivors released the dead group's mapping
    after = world3.run("shm_state_job", timeout=60)
    assert [(u, f, m) for u, f, m in after] == [(True, [], 1)] * 3
    assert J.shm_files(world3.pids()) == []


def test_destroy_releases_everything():
    def body(b, rank):
        b.all_reduce(torch.ones(100000), Reduction(ReduceOp.SUM)).wait()
        return b.uses_shm

    assert run_threads(2, body) == [True, True]
    assert J.shm_files([os.getpid()]) == []
    assert J.shm_mappings() == 0


def test_init_destroy_cycles_release_every_segment_at_once(world2):
    """20 init_process_group/destroy_process_group cycles in real processes, with the
    garbage collector off: after every destroy the segment is unmapped and its
    descriptor closed (it used to stay until a collection, 20-40 of them after 20 cycles)."""
    assert world2.run("init_destroy_cycles_job", 20, timeout=120) == [[], []]


_SETUP_PROGRAM = """
import sys, time
sys.path.insert(0, sys.argv[3])
from _tcp_harness import dir_store, make_backend, record
from tdist_tcp.protocol.auth import group_key
from tdist_tcp.shared.shm import take_offer

rank, store = int(sys.argv[1]), dir_store(sys.argv[2])
if rank == 0:
    make_backend(store, 0, 2, 120.0)  # creates the segment, offers it, then waits for rank 1's record
else:  # maps the offered segment, never publishes its record
    first = record(store, 0, 60.0)
    mm, _, _ = take_offer(first.offer, 1, 2, {}, first.nonce, group_key(b"", first.nonce), 1)
    assert mm is not None
    time.sleep(120)
"""


def _holders(name: str) -> list[str]:
    """The processes of this host that hold segment ``name`` open or mapped."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
        except OSError:  # gone meanwhile, or not ours to look at
            continue
        if f"/memfd:{name} " in maps or any(link.startswith(f"/memfd:{name} ") for link in links):
            found.append(pid)
    return found


def test_every_rank_killed_during_setup_leaves_nothing(tmp_path):
    """Both ranks are SIGKILLed while rank 0 waits in the shared-memory setup, the segment
    created and published: nothing named after the job is in /dev/shm, and no process
    holds the segment (it was never a file: the kernel freed it with its last user)."""
    import signal
    import subprocess
    import sys

    from _tcp_harness import dir_store, record

    store_dir = str(tmp_path / "store")
    store = dir_store(store_dir)
    procs = [
        subprocess.Popen([sys.executable, "-c", _SETUP_PROGRAM, str(r), store_dir, os.path.dirname(__file__)])
        for r in (0, 1)
    ]
    try:
        first = record(store, 0, 60.0)
        nonce, where = first.nonce.hex(), first.offer
        time.sleep(0.5)  # rank 0 is waiting for rank 1's record, rank 1 has mapped the segment
    finally:
        for p in procs:
            p.send_signal(signal.SIGKILL)
            p.wait(30)
    name = where.split("|")[0].split(":")[-1]
    assert name.startswith("tdist-tcp-" + nonce[:16]), where
    assert J.shm_files([p.pid for p in procs]) == []
    assert [n for n in os.listdir("/dev/shm") if nonce[:16] in n] == []
    assert _holders(name) == []


def test_setup_with_a_missing_rank_releases_the_segment():
    """Rank 0 creates the segment, its peer never answers: the setup times out and this
    process neither maps it nor holds a descriptor of it any more."""
    from tdist_tcp.net.transport import Transport

    store = HashStore()
    tr = Transport(0, 2, {}, 1.0)
    try:
        with pytest.raises(Exception) as info:
            S.open_shm(store, 0, 2, 0.5, {}, tr, b"\xab" * 16, b"k" * 32)
        assert isinstance(info.value, DistBackendTimeoutError), info.value
        assert "ranks [1]" in str(info.value)
    finally:
        tr.close(0.0)
    assert J.shm_mapped() == set() and J.shm_fds() == set()


def test_segment_of_another_group_or_key_is_refused():
    """A segment whose header carries another nonce or size, or whose proof was made with
    another key, is not attached; neither is a descriptor that is not a tdist segment."""
    nonce, key = b"x" * 16, b"k" * 32
    total = shmstep.layout(2, 65536)[2]
    name, fd, mm = segment.create(total, 2, 65536, nonce, key)
    where = segment.locator(name, fd)
    try:
        assert segment.attach(where, total, 2, 65536, b"y" * 16, key) is None
        assert segment.attach(where, total, 3, 65536, nonce, key) is None
        assert segment.attach(where, total, 2, 65536, nonce, b"j" * 32) is None
        other = segment.attach(where, total, 2, 65536, nonce, key)
        assert other is not None
        other.close()
        pid, _fd, scope, _name = where.split(":")
        with open(__file__, "rb") as f:  # a real descriptor, but not a segment
            assert segment.attach(f"{pid}:{f.fileno()}:{scope}:{name}", total, 2, 65536, nonce, key) is None
        for bad in (
            "",
            "x",
            f"{pid}:{fd}:{scope}:../../etc/passwd",
            f"1:{fd}:{scope}:{name}",
            f"{pid}:99999:{scope}:{name}",
            f"{pid}:{fd}:{'0' * 16}:{name}",
        ):  # last: another host/namespace
            assert segment.attach(bad, total, 2, 65536, nonce, key) is None, bad
    finally:
        mm.close()
        segment.close_fd(fd)
    assert name not in J.shm_mapped() | J.shm_fds()
