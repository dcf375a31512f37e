"""Multi-process tests of the gloo backend: 2-3 processes each, a one-off
tdist.testing World started without a process group (the bodies make their own),
killed when the test ends, fails or times out."""

from __future__ import annotations

import pytest

import gloo_bodies as bodies
from tdist.testing import RankFailure, World, free_port

pytestmark = pytest.mark.slow


def run_world(body, world_size: int, timeout: float, env=None, **kwargs) -> list:
    """``body(**kwargs)`` on every rank of a fresh world; the results by rank."""
    with World.spawn("gloo", world_size, init=False, env=env) as world:
        return world.run(body, timeout=timeout, **kwargs)


@pytest.mark.timeout(240)
def test_emulated_reductions():
    counts = run_world(bodies.emulated_reductions, 2, timeout=200)
    assert counts[0] == counts[1] > 50


@pytest.mark.timeout(180)
def test_premul_avg_complex_and_rejections():
    counts = run_world(bodies.premul_avg_complex, 2, timeout=150)
    assert counts[0] == counts[1] > 20


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [2, 3])
def test_data_movement_of_every_dtype(world_size):
    counts = run_world(bodies.data_movement, world_size, timeout=200)
    assert len(set(counts)) == 1 and counts[0] >= 6


@pytest.mark.timeout(180)
def test_work_semantics():
    results = run_world(bodies.work_semantics, 3, timeout=150)
    assert results[0]["senders"] == [1, 2]
    assert results[0]["irecv_any_source_rank"] == 2
    assert results[0]["polls"] > 0
    assert 0.25 <= results[0]["timed_out_after"] < 1.0


@pytest.mark.timeout(120)
def test_gloo_timeout_becomes_backend_timeout_error():
    message = run_world(bodies.op_timeout, 2, timeout=90)[0]
    assert "Timed out" in message or "timed out" in message.lower()


@pytest.mark.timeout(120)
def test_dead_peer_becomes_backend_error():
    with World.spawn("gloo", 2, init=False) as world:
        message, rank1 = world.try_run(bodies.peer_dies, timeout=90)
    assert isinstance(rank1, RankFailure) and rank1.kind == "died", rank1
    assert message.startswith("Dist"), message


@pytest.mark.timeout(180)
def test_side_by_side_with_torch_distributed():
    results = run_world(bodies.side_by_side, 3, timeout=150, torch_port=free_port())
    assert results[0] == results[2] == [2.0, 2.0] and results[1] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scheme", ["env", "tcp", "file"])
def test_init_methods(scheme, tmp_path):
    if scheme == "env":
        method = "env://"
    elif scheme == "tcp":
        method = f"tcp://127.0.0.1:{free_port()}"
    else:
        method = f"file://{tmp_path / 'rendezvous'}"
    assert run_world(bodies.init_methods, 2, timeout=150, init_method=method) == [6.0, 6.0]


@pytest.mark.timeout(120)
def test_interface_option_and_env():
    assert run_world(bodies.interface_option, 2, timeout=90) == [2.0, 2.0]
    assert run_world(bodies.init_methods, 2, timeout=90, env={"GLOO_SOCKET_IFNAME": "lo"}, init_method="env://") == [
        6.0,
        6.0,
    ]
