"""The shared-memory engine's waiting policy (tdist_tcp.shared.shmwait): a waiter spins only while
every rank of the host can have a CPU, and the engines (the Python steps and the C part)
wait as the policy says. Decisions only: how fast each choice is goes into the benchmarks
(``python -m tdist.bench --ddp``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _tcp_harness import ProcWorld, run_threads
from tdist_tcp.shared import shm as S
from tdist_tcp.shared import shmwait as W

pytestmark = pytest.mark.timeout(120)

needs_shm = pytest.mark.skipif(
    not S.shm_enabled({"shm": True}), reason="shared memory needs Linux x86-64, memfd and /proc"
)


def test_more_ranks_than_cpus_never_spins():
    """4 ranks on a host whose usable CPUs are 2: straight to sleep (after one yield)."""
    pol = W.decide(4, 2)
    assert pol.spin == 0 and not pol.adaptive and pol.yield_first
    assert W.oversubscribed(4, 2) and W.oversubscribed(3, 2)


def test_as_many_cpus_as_ranks_spins_while_a_cpu_is_free():
    """2 ranks on 2 CPUs (or fewer ranks than CPUs): spin, but only while no thread waits for a CPU."""
    for ranks, cpus in ((2, 2), (2, 16), (4, 4)):
        pol = W.decide(ranks, cpus)
        assert pol.spin == W.DEFAULT_SPIN_US * 1e-6 and pol.adaptive and not pol.yield_first
        assert not W.oversubscribed(ranks, cpus)


def test_threads_of_one_process_and_the_option_override():
    assert W.decide(2, 16, same_process=True).spin == 0  # they share one GIL
    assert W.decide(4, 2, spin_us=250).spin == pytest.approx(250e-6)  # the option wins, even oversubscribed
    assert not W.decide(4, 2, spin_us=250).adaptive
    assert W.decide(2, 16, spin_us=0).spin == 0


@pytest.mark.parametrize(
    "files, want",
    [
        ({"cpu.max": "200000 100000"}, 2),
        ({"cpu.max": "150000 100000"}, 2),  # a fraction of a CPU more is one more to run on
        ({"cpu.max": "50000 100000"}, 1),
        ({"cpu.max": "max 100000"}, None),
        ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),
        ({"cpu,cpuacct/cpu.cfs_quota_us": "-1", "cpu,cpuacct/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
    ids=["v2-2", "v2-1.5", "v2-0.5", "v2-max", "v1-3", "v1-none", "none"],
)
def test_cgroup_quota(tmp_path, files, want):
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    (tmp_path / "self-cgroup").write_text("0::/\n")
    assert W.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "self-cgroup")) == want


def test_cgroup_quota_of_the_process_cgroup(tmp_path):
    """cgroup v2: the quota of the process's own cgroup (``/proc/self/cgroup``), not only the root's."""
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "self-cgroup").write_text("0::/job\n")
    assert W.cgroup_cpu_limit(str(tmp_path), str(tmp_path / "self-cgroup")) == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_usable_cpus_is_the_union_of_the_members_affinities():
    """A rank pinned to CPU 0 whose peer is pinned to CPU 0 has one CPU to share; with the
    peer on another CPU, two."""
    cpus = sorted(os.sched_getaffinity(0))
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        probe = "import os, sys; os.sched_setaffinity(0, {%d}); from tdist_tcp.shared import shmwait; print(shmwait.usable_cpus([%d]))"
        os.sched_setaffinity(peer.pid, {cpus[0]})
        one = subprocess.run([sys.executable, "-c", probe % (cpus[0], peer.pid)], capture_output=True, text=True)
        assert one.stdout.strip() == "1", one.stderr
        if len(cpus) > 1 and W.cgroup_cpu_limit() in (None, *range(2, 4096)):
            os.sched_setaffinity(peer.pid, {cpus[1]})
            two = subprocess.run([sys.executable, "-c", probe % (cpus[0], peer.pid)], capture_output=True, text=True)
            assert two.stdout.strip() == "2", two.stderr
    finally:
        peer.kill()
        peer.wait()


def test_run_queue_counts_the_running_reader():
    rq = W.run_queue()
    if not os.path.exists("/proc/loadavg"):
        pytest.skip("no /proc/loadavg")
    assert rq.runnable() >= 1  # this thread is running while it reads
    assert rq.cpus == W.online_cpus()
    assert isinstance(rq.busy(), bool)


@needs_shm
@pytest.mark.parametrize("world", [2, 4])
def test_engines_wait_as_the_policy_says(tmp_path, world):
    """Real groups of processes: ranks more than usable CPUs never spin (neither in Python nor
    in the C part) and take the bigger buffers; otherwise they spin adaptively."""
    pw = ProcWorld(world, str(tmp_path))
    try:
        results = pw.run("shm_wait_policy_job", timeout=60)
    finally:
        pw.close()
    for spin, adaptive, yield_first, c_part, usable, members, slot in results:
        assert members == world
        if world > usable:
            assert (spin, adaptive, yield_first) == (0.0, False, True)
            assert slot == S.DEFAULT_SLOT_BYTES_OVERSUBSCRIBED
        else:
            assert spin > 0 and adaptive and not yield_first
            assert slot == S.DEFAULT_SLOT_BYTES
        if c_part is not None:
            assert c_part == (int(spin * 1e9), adaptive)


@needs_shm
def test_ranks_that_are_threads_of_one_process_never_spin():
    results = run_threads(2, lambda b, r: (b.uses_shm, b._shm.policy.spin if b._shm is not None else None))
    assert results == [(True, 0.0), (True, 0.0)]
