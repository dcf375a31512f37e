"""tdist's collective check (``TDIST_CHECK_COLLECTIVES``, ``Backend.check_collectives``):
done once in the dispatch path for every backend, here on gloo (which cannot detect
mismatched collectives by itself)."""

from __future__ import annotations

import pytest

from tdist._mismatch import MISSING, mismatch, signature
from tdist.plugin import ReduceOp, as_reduction


def _mismatched_then_fine() -> dict:
    import torch

    import tdist

    r = tdist.get_rank()
    t = torch.full((4,), float(r + 1))
    try:
        tdist.broadcast(t, src=0) if r == 0 else tdist.all_reduce(t)
    except tdist.DistBackendError as exc:
        caught = str(exc)
    else:
        caught = ""
    t = torch.ones(4)
    tdist.all_reduce(t)  # a matching collective still works
    out = torch.empty(3 if r == 0 else 1)  # uneven all_to_all_single splits are not a mismatch
    tdist.all_to_all_single(out, torch.full((2,), float(r)), [2, 1] if r == 0 else [0, 1], [2, 0] if r == 0 else [1, 1])
    return {"caught": caught, "sum": t.tolist()}


@pytest.mark.timeout(120)
def test_every_rank_names_what_each_rank_issued():
    from tdist.testing import World

    with World.spawn("gloo", 2, pg_timeout=20, env={"TDIST_CHECK_COLLECTIVES": "1"}) as world:
        results = world.run(_mismatched_then_fine, timeout=60)
    for r in (0, 1):
        caught = results[r]["caught"]
        assert "issued different collectives" in caught, results
        assert "rank(s) [0]: broadcast, torch.float32, 4 elements, root 0" in caught, caught
        assert "rank(s) [1]: all_reduce, torch.float32, 4 elements, ReduceOp.SUM" in caught, caught
        assert results[r]["sum"] == [2.0] * 4


def test_signature_and_message():
    import torch

    row = signature("all_to_all_single", [torch.ones(3)], None, None)
    assert row[2] == MISSING  # sizes may differ between ranks
    same = signature("barrier", [], None, None)
    assert mismatch("barrier", "pg0", [0, 1], [same, same]) is None
    other = signature("reduce", [torch.ones(2, dtype=torch.int64)], as_reduction(ReduceOp.SUM), 1)
    message = mismatch("barrier", "pg3", [4, 7], [same, other])
    assert (
        message is not None and "rank(s) [4]: barrier; rank(s) [7]: reduce, torch.int64, 2 elements, root 1" in message
    )
