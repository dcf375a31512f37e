"""The tcp backend's hierarchical collectives (tdist_tcp.collectives.hierarchy, tdist_tcp.shared.topology) on
one machine: ``ranks_per_host`` makes every N consecutive ranks a "host" (their segments
are real, the exchange between "hosts" goes over sockets), so every layout, uniform or
not, runs here. Across separate (simulated) hosts: tests/test_multihost.py and
``python -m tdist.bench --hosts``."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import _tcp_jobs as J
import pytest
import torch
from _tcp_harness import ProcWorld, run_threads
from tdist._reduce_op import ReduceOp, Reduction
from tdist_tcp.shared import segment
from tdist_tcp.shared import shm as S
from tdist_tcp.shared.topology import Layout, hierarchy_mode, host_id

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not S.shm_enabled({"shm": True}), reason="shared memory needs Linux x86-64, memfd and /proc"),
]

# world size, ranks per host -> the layout every rank must see
LAYOUTS = {
    "2x2": (4, 2, [[0, 1], [2, 3]]),
    "3+1": (4, 3, [[0, 1, 2], [3]]),
    "2+2+1": (5, 2, [[0, 1], [2, 3], [4]]),
    "3x2": (6, 2, [[0, 1], [2, 3], [4, 5]]),
}
# the large-message algorithms at small sizes: rings, padding and many segment rounds
SMALL = {"ring_threshold": 256, "segment_bytes": 1024, "shm_slot_bytes": 16384, "shm_direct_bytes": 256}


def _check(results, layout):
    digests = set()
    for rank, (hosts, (uses_shm, failures, digest, files, _mappings)) in enumerate(results):
        assert hosts == layout, (rank, hosts)
        alone = any(m == [rank] for m in layout)
        assert uses_shm is not alone, f"rank {rank}: shared memory with no host peer, or none with them"
        assert failures == [], (rank, failures[:10])
        assert files == [], f"rank {rank}: segments still in /dev/shm: {files}"
        digests.add(digest)
    assert len(digests) == 1, "ranks disagree bitwise on all_reduce results"


@pytest.mark.parametrize("small", [False, True], ids=["default", "small-buffers"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_suites_on_every_layout(name, small):
    world, per_host, layout = LAYOUTS[name]
    options = {"ranks_per_host": per_host, **(SMALL if small else {})}
    sizes = (5, 1001, 30001) if small else (5, 70001)

    def body(b, rank):
        return b.hosts, J.shm_suites_job(b, rank, sizes=sizes, n=700, blocking=rank % 2 == 1)

    _check(run_threads(world, body, timeout=170, backend_timeout=60, options=options), layout)


def test_suites_in_processes():
    """Real processes (each with its own C part and segment mapping) on 2 "hosts" of 2."""
    world = ProcWorld(4, os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tcp-hier-{os.getpid()}"))
    try:
        results = world.run("hierarchy_suites_job", timeout=170, options={"ranks_per_host": 2})
    finally:
        world.close()
    _check(results, [[0, 1], [2, 3]])
    for rank, (_hosts, (*_rest, mappings)) in enumerate(results):
        assert mappings == 1, f"rank {rank} maps {mappings} segments (expected its host's only)"


@pytest.mark.timeout(330)  # the whole kit, its failure scenarios included
@pytest.mark.parametrize("per_host", [2, 3])
def test_conformance_kit_on_hierarchical_groups(per_host):
    """The whole conformance kit (tdist.testing's suite, 4 ranks) with every group's ranks
    on "hosts" of ``per_host``: the hierarchy is invisible to torch.distributed programs.
    Uneven hosts (3 + 1) run the bodies; the failure scenarios (the kit's slow part, about
    2 minutes) run once, on even hosts."""
    env = dict(os.environ, TDIST_TCP_RANKS_PER_HOST=str(per_host))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "tdist.testing.suite"]
    command += ["--tdist-backend", "tcp", "--tdist-world-sizes", "4"]
    if per_host == 3:
        command += ["-m", "not slow"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


def test_results_match_the_flat_algorithms():
    """Sums of integers are exact whatever the order: hierarchical == flat, element for element."""

    def body(b, rank):
        g = torch.Generator().manual_seed(rank)
        outs = []
        for n in (3, 5000, 70001):
            t = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64)
            b.all_reduce(t, Reduction(ReduceOp.SUM)).wait()
            outs.append(t)
        return b.hosts, outs

    hier = run_threads(4, body, options={"ranks_per_host": 2})
    flat = run_threads(4, body, options={"shm": False})
    assert hier[0][0] == [[0, 1], [2, 3]] and flat[0][0] is None
    for (_, a), (_, b) in zip(hier, flat):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "options",
    [{"ranks_per_host": 2, "hierarchy": "off"}, {"ranks_per_host": 2, "shm": False}, {"ranks_per_host": 1}],
    ids=["hierarchy-off", "shm-off", "one-rank-per-host"],
)
def test_flat_where_asked_or_not_worth_it(options):
    results = run_threads(4, lambda b, r: (b.hosts, b.uses_shm, J.all_reduce_suite(b, r, sizes=(5,))), options=options)
    assert results == [(None, False, [])] * 4


def test_host_id_names_the_host():
    results = run_threads(2, lambda b, r: (b.hosts, b.uses_shm), options={"host_id": "same"})
    assert results == [(None, True)] * 2  # one "host": the whole group's segment, as without the option


def test_timeout_names_the_missing_rank():
    """Rank 3 never comes: rank 0, waiting on its host's segment for rank 1 (which waits on
    rank 3 over a socket), names rank 3."""

    def body(b, rank):
        if rank == 3:
            time.sleep(4.0)
            return None
        return J.describe_error(lambda: b.all_reduce(torch.ones(100000), Reduction(ReduceOp.SUM)).wait())

    results = run_threads(4, body, backend_timeout=1.5, timeout=60, options={"ranks_per_host": 2})
    for rank in (0, 1, 2):
        name, text, elapsed = results[rank]
        assert name == "DistBackendTimeoutError" and "rank 3" in text, (rank, name, text)
        assert elapsed < 8, (rank, elapsed)


def test_killed_rank_fails_every_host(tmp_path):
    world = ProcWorld(4, str(tmp_path))
    try:
        pids = world.pids()
        results = world.run(
            "dead_peer_job", 3, "sigkill", backend_timeout=60, dead_ok=[3], timeout=60, options={"ranks_per_host": 2}
        )
    finally:
        world.close()
    assert results[3] == "dead"
    for rank in (0, 1, 2):
        (name, text, elapsed), later = results[rank]
        assert name == "DistBackendError" and "rank 3" in text, (rank, text)
        assert elapsed < 8, elapsed
        assert later[0] == "DistBackendError"
    assert J.shm_files(pids + [os.getpid()]) == []


# ---------------------------------------------------------------------- units
def test_layout():
    layout = Layout(((0, 2), (1, 3)))
    assert layout.host_of(3) == 1 and layout.leaders() == [0, 1] and layout.uniform and layout.worth_it
    assert not Layout(((0, 1, 2), (3,))).uniform
    assert not Layout(((0,), (1,))).worth_it and not Layout(((0, 1),)).worth_it
    with pytest.raises(ValueError, match="rank 5"):
        layout.host_of(5)


def test_host_ids():
    """Every N consecutive ranks with ranks_per_host N; else the given host id, else the scope."""
    assert host_id({"ranks_per_host": 2}, 5) == host_id({"ranks_per_host": "2"}, 4) != host_id({}, 5)
    assert host_id({"host_id": "b"}, 0) == "id:b" and host_id({}, 0).startswith("scope:")


@pytest.mark.parametrize(
    "value,mode",
    [(None, "auto"), ("auto", "auto"), (True, "on"), ("1", "on"), ("on", "on"), (False, "off"), ("flat", "off")],
)
def test_hierarchy_mode(value, mode):
    assert hierarchy_mode({} if value is None else {"hierarchy": value}) == mode


def test_bad_options_are_refused_before_any_communication():
    with pytest.raises(ValueError, match="hierarchy"):
        hierarchy_mode({"hierarchy": "sometimes"})
    with pytest.raises(ValueError, match="ranks_per_host"):
        host_id({"ranks_per_host": "0"}, 0)


def test_scope_is_this_host():
    assert segment.scope() == segment.scope() and len(segment.scope()) == 16
