"""The tcp backend's share of the store at init (issue 32): a constant number of round trips
per rank whatever the world size, and only rank 0 reads every rank's record; every other
rank reads rank 0's record, its lower ring neighbour's and rank 0's answer."""

import json
import os

import pytest
from tdist.testing.processes import python_job

HERE = os.path.dirname(os.path.abspath(__file__))


def _traffic(world_size: int) -> dict:
    results = python_job([os.path.join(HERE, "_tcp_traffic_rank.py")], world_size, timeout=240)
    out = {}
    for r in results:
        assert r.returncode == 0, r.output[-4000:]
        [line] = r.lines("TRAFFIC ")
        got = json.loads(line[len("TRAFFIC ") :])
        out[got["rank"]] = got
    assert sorted(out) == list(range(world_size))
    return out


@pytest.mark.timeout(600)
def test_round_trips_and_bytes_per_rank_do_not_grow_with_the_world():
    small, large = _traffic(3), _traffic(6)
    for traffic in (small, large):
        assert traffic[0]["requests"] == 4, traffic  # its record, one wait and one multi_get of all, the answer
        for rank in range(1, len(traffic)):
            # rank 0's record, its own, its lower ring neighbour's (not for rank 1: that is rank 0), the answer
            assert traffic[rank]["requests"] <= 4, traffic
    for rank in (1, 2):  # the same ranks read as much in a world twice the size
        assert large[rank]["bytes"] <= small[rank]["bytes"] + 64, (small, large)
    assert large[0]["bytes"] > small[0]["bytes"]  # rank 0 reads every record
    print({"world 3": small, "world 6": large})
