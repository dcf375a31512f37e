"""The analyser on dumps written by real recorders (one per simulated rank, fed
tdist.WorkInfo objects as the core builds them): every kind of divergence it names,
point-to-point waits, ring wrap-around and a rank missing its dump."""

from __future__ import annotations

import json

import pytest
from tdist_debug import analyze, load_dumps
from tdist_debug.recorder import Recorder
from tdist_debug.settings import Settings

from tdist import DistBackendTimeoutError, WorkInfo

RANKS = (0, 1, 2)


def _info(
    rank: int,
    seq: int,
    op: str = "all_reduce",
    dtype: str = "torch.float32",
    nbytes: int = 16,
    reduce_op=None,
    root=None,
    peer=None,
    shapes=((4,),),
) -> WorkInfo:
    return WorkInfo(
        op,
        "pg0",
        seq,
        [tuple(s) for s in shapes],
        dtype,
        nbytes,
        "tcp",
        rank=rank,
        group_ranks=RANKS,
        reduce_op=reduce_op,
        root=root,
        peer=peer,
        tag=0 if peer is not None else None,
    )


def _recorders(tmp_path, capacity: int = 100) -> dict[int, Recorder]:
    recorders = {r: Recorder(Settings(capacity, str(tmp_path))) for r in RANKS}
    for rank, recorder in recorders.items():
        recorder.group_created("pg0", list(RANKS), rank, "tcp")
    return recorders


def _run(recorder: Recorder, info: WorkInfo, ok: bool = True) -> None:
    recorder.issued(info)
    if ok:
        recorder.completed(info, 0.001)


@pytest.mark.parametrize(
    "field, values, words",
    [
        (
            "op",
            ("all_reduce", "broadcast"),
            "disagree on the operation: rank(s) [0, 2] called all_reduce; rank(s) [1] called broadcast",
        ),
        (
            "dtype",
            ("torch.float32", "torch.int64"),
            "disagree on the dtype: rank(s) [0, 2] passed torch.float32; rank(s) [1] passed torch.int64",
        ),
        ("nbytes", (16, 32), "disagree on the size: rank(s) [0, 2] passed 16 B; rank(s) [1] passed 32 B"),
        (
            "reduce_op",
            ("SUM", "MAX"),
            "disagree on the reduction: rank(s) [0, 2] reduced with SUM; rank(s) [1] reduced with MAX",
        ),
    ],
)
def test_divergence_names_the_field_and_both_sides(tmp_path, field, values, words):
    recorders = _recorders(tmp_path)
    for rank, recorder in recorders.items():
        _run(recorder, _info(rank, 1))
        _run(recorder, _info(rank, 2, **{field: values[rank == 1]}), ok=False)
        recorder.dump("test")
    verdict = analyze(load_dumps(str(tmp_path)))
    assert f"DIVERGED at collective #2 of group pg0: the ranks {words}" in verdict, verdict


def test_ring_keeps_the_last_n_a_timeout_dumps_and_p2p_waits_are_shown(tmp_path):
    recorders = _recorders(tmp_path, capacity=3)
    stuck = {rank: _info(rank, 5) for rank in (0, 1)}  # the core holds an op's WorkInfo until it ends
    for seq in range(1, 6):
        for rank, recorder in recorders.items():
            if seq < 5:
                _run(recorder, _info(rank, seq))
            elif rank in stuck:
                recorder.issued(stuck[rank])
    receive = _info(2, 1, op="recv", peer=0)
    recorders[2].issued(receive)
    recorders[2].dump("SIGUSR1")
    error = DistBackendTimeoutError("all_reduce timed out: rank 2 did not arrive")
    recorders[0].failed(stuck[0], error, 3.0)
    dump = json.loads((tmp_path / "rank0.json").read_text())
    assert dump["reason"].startswith("all_reduce #5 of group pg0 timed out")
    assert [(e["seq"], e["state"]) for e in dump["entries"]] == [(3, "completed"), (4, "completed"), (5, "failed")]
    assert dump["entries"][-1]["duration"] == 3.0
    verdict = analyze(load_dumps(str(tmp_path)))
    assert "rank(s) [1] left no dump" in verdict, verdict
    assert "rank 2: in recv from rank 0 (tag 0), waiting" in verdict, verdict
    assert "rank 2 NEVER ENTERED collective #5 of group pg0: its last collective there is all_reduce #4" in verdict


def test_agreeing_dumps_and_an_empty_directory(tmp_path):
    recorders = _recorders(tmp_path)
    for rank, recorder in recorders.items():
        _run(recorder, _info(rank, 1, op="all_to_all_single", nbytes=16 * (rank + 1)))  # sizes may differ here
        recorder.dump("exit")
    assert "the ranks agree" in analyze(load_dumps(str(tmp_path)))
    with pytest.raises(ValueError, match="no tdist-debug dump"):
        load_dumps(str(tmp_path / "nothing"))
