"""The tcp backend across real processes (spawned once per module, torch imported once):
the suites, a peer that dies mid-collective, mismatch across processes, thread cleanup,
and the plugin registration."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
import torch
from tdist.plugin import HashStore
from _tcp_harness import ProcWorld

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def world3(tmp_path_factory):
    world = ProcWorld(3, str(tmp_path_factory.mktemp("tcp-world3")))
    try:
        yield world
    finally:
        world.close()


def test_suites_across_processes(world3):
    """(with a secret: every connection authenticated)"""
    assert world3.run("suites_job", timeout=90, secret=b"s" * 32) == [[]] * 3


def test_suites_across_processes_segmented(world3):
    options = {"ring_threshold": 64, "segment_bytes": 100}
    assert world3.run("suites_job", timeout=90, options=options) == [[]] * 3


@pytest.mark.parametrize("how,unix", [("exit", True), ("exit", False), ("sigkill", True), ("exit-mid-send", True)])
def test_dead_peer_fails_survivors_promptly(world3, how, unix):
    victim = 2 if how != "exit-mid-send" else 1
    results = world3.run(
        "dead_peer_job", victim, how, backend_timeout=60, dead_ok=[victim], timeout=60, options={"unix": unix}
    )
    assert results[victim] == "dead"
    for rank, result in enumerate(results):
        if rank == victim:
            continue
        first, later = result
        name, text, elapsed = first
        assert name == "DistBackendError", (rank, first)
        assert f"rank {victim}" in text, text
        assert elapsed < 8, f"rank {rank} needed {elapsed:.1f} s (timeout is 60 s)"
        assert later[0] == "DistBackendError" and later[2] < 1, later


def test_sigkill_from_outside_while_peers_wait(world3):
    def kill_rank1(world, store_dir):
        from _tcp_harness import dir_store

        dir_store(store_dir).wait(["test/waiting/1"], timeout=50)  # rank 1 is connected and idle
        time.sleep(0.2)
        os.kill(world.pids()[1], signal.SIGKILL)

    results = world3.run("wait_forever_job", backend_timeout=60, dead_ok=[1], during=kill_rank1, timeout=60)
    for rank in (0, 2):
        name, text, elapsed = results[rank]
        assert name == "DistBackendError" and "rank 1" in text and elapsed < 8, results[rank]


@pytest.mark.parametrize("shm", [True, False], ids=["shm", "sockets"])
def test_stopped_peer_gives_every_waiting_rank_a_timeout_naming_it(world3, shm):
    """Rank 2 is stopped (SIGSTOP) while ranks 0 and 1 all_reduce 16 MiB: each of them raises
    DistBackendTimeoutError naming rank 2 (and only rank 2) as the rank that did not
    arrive, and the collective with its real size; once continued, rank 2 raises too."""
    from _tcp_harness import dir_store

    def stop_rank2(world, store_dir):
        store, pid = dir_store(store_dir), world.pids()[2]
        store.wait(["test/ready"], timeout=50)
        os.kill(pid, signal.SIGSTOP)
        try:
            store.set("test/stopped", "1")
            store.wait(["test/done/0", "test/done/1"], timeout=50)
        finally:
            os.kill(pid, signal.SIGCONT)
            store.set("test/continued", "1")

    nbytes, timeout = 16 << 20, 4.0
    world3.run("shm_state_job", timeout=60)  # every worker is up (a replaced one needs seconds to start)
    results = world3.run(
        "stopped_peer_job", 2, nbytes, backend_timeout=timeout, during=stop_rank2, timeout=90, options={"shm": shm}
    )
    for rank in (0, 1):
        name, text, elapsed = results[rank]
        assert name == "DistBackendTimeoutError", (rank, name, text)
        assert re.search(r"rank 2 \(no answer[^)]*\) did not arrive", text), text
        assert "rank 0 (" not in text and "rank 1 (" not in text, text
        assert f"all_reduce(SUM)#2 float32 x {nbytes} bytes" in text, text
        assert elapsed < timeout + 4, elapsed
    name, text, _ = results[2]
    assert name in ("DistBackendTimeoutError", "DistBackendError") and "rank 2" in text, text


def test_mismatch_across_processes(world3):
    results = world3.run("mismatch_job", "size", backend_timeout=30)
    for _first, later, _ in results:
        assert later[0] == "DistBackendError"
    assert any("x 16 bytes" in first[1] and "x 20 bytes" in first[1] for first, _, _ in results)


def test_no_threads_left_in_processes(world3):
    assert world3.run("threads_after_shutdown_job") == [[]] * 3


def test_plugin_registers_tcp_backend_lazily():
    import sys

    import tdist_tcp.plugin as plugin
    from tdist._backend import ANY_SOURCE_OP, OPERATIONS
    from tdist._plugins import BackendRegistry

    assert plugin.TDIST_HOOKSPEC_VERSION == "1.0"
    registry = BackendRegistry()
    plugin.tdist_register_backends(registry=registry)
    spec = registry.get("tcp")
    assert spec is not None and spec.available is None
    assert spec.operations["cpu"] == frozenset(OPERATIONS) | {ANY_SOURCE_OP}

    backend = spec.factory(store=HashStore(), rank=0, world_size=1, timeout=5.0, options={}, global_ranks=[0])
    try:
        t = torch.ones(2)
        from tdist._reduce_op import ReduceOp, Reduction

        backend.all_reduce(t, Reduction(ReduceOp.AVG)).wait()
        assert t.tolist() == [1.0, 1.0]
    finally:
        backend.shutdown()
    assert "tdist_tcp.backend" in sys.modules


def test_plugin_import_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, tdist_tcp.plugin; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
