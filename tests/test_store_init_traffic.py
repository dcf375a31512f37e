"""Store round trips of ``init_process_group`` per rank (issue 32): the rendezvous' share
(the incarnation and the join) must not grow with the world size.

Each rank counts its TCPStore requests by what they are for (``store_init_traffic_rank.py``);
the join costs the first member four (claim, one wait on every claim, one multi_get of them,
the verdict) and every other member two (claim, the verdict), at any world size. The
backend's own exchange ("other") is reported, not checked here (the backend's tests own it).
"""

import json
import os

import pytest

from tdist.testing.processes import python_job

HERE = os.path.dirname(os.path.abspath(__file__))


def _traffic(world_size: int) -> dict:
    results = python_job([os.path.join(HERE, "store_init_traffic_rank.py"), "tcp"], world_size, timeout=240)
    out = {}
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        [line] = r.lines("TRAFFIC ")
        got = json.loads(line[len("TRAFFIC ") :])
        out[got["rank"]] = got["init"]
    assert sorted(out) == list(range(world_size))
    return out


@pytest.mark.timeout(600)
def test_rendezvous_round_trips_per_rank_do_not_grow_with_the_world():
    small, large = _traffic(2), _traffic(4)
    for traffic in (small, large):
        first = traffic[0]
        assert first.get("incarnation", 0) == 1 and first.get("join", 0) == 4, traffic
        for rank in range(1, len(traffic)):
            assert traffic[rank].get("incarnation", 0) == 1 and traffic[rank].get("join", 0) == 2, traffic
            assert traffic[rank].get("process", 0) == 1, traffic
    print({"world 2": small, "world 4": large})
