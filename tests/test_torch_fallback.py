"""The bridge fails safe on a torch it cannot attach to, and says which torch it supports.

A future torch cannot be installed here, so each program below makes the installed one
behave like such a release before tdist meets it (the only mocks in these tests): no
``torch.distributed._Work`` to subclass (the feature check finds it), and a ``torch.distributed.init_process_group`` that fails inside torch
(what no feature check foresees). Then, in a real 2-rank job: tdist's own API works, one
warning names the torch version and what does not carry over, and torch's
``init_process_group("tdist-tcp")`` raises a clear error naming the supported range.
"""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from tdist._version import TORCH_REQUIREMENT  # noqa: E402
from tdist.testing.processes import python_job  # noqa: E402

JOB_TIMEOUT = 120

_PROLOGUES = {
    # what the feature check finds missing
    "missing_feature": """
        import torch.distributed as td
        del td._Work  # a torch whose Work cannot be written in Python
    """,
    # what only torch's own init finds out
    "torch_refuses": """
        import torch.distributed as td
        def refuse(*args, **kwargs):
            raise RuntimeError("Could not find the default backend type 0 for Process Group")
        td.init_process_group = refuse
    """,
}

_BODY = """
    import json, os, sys, warnings
    from datetime import timedelta
    import torch
    import tdist
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tdist.init_process_group("tcp", timeout=timedelta(seconds=30))
        t = torch.ones(2) * (tdist.get_rank() + 1)
        tdist.all_reduce(t)
        g = tdist.new_group([0, 1])
        tdist.all_reduce(t, group=g)
        tdist.destroy_process_group()
        tdist.init_process_group("tcp", timeout=timedelta(seconds=30))  # the warning is not repeated
        tdist.barrier()
        tdist.destroy_process_group()
    ours = [str(w.message) for w in caught if str(w.message).startswith("tdist:")]
    torch_initialized = td.is_initialized()
    try:
        import torch.distributed.distributed_c10d as c10d
        c10d.init_process_group("tdist-tcp", store=td.HashStore(), rank=0, world_size=1)
        torch_error = None
    except Exception as exc:
        torch_error = (type(exc).__name__, str(exc), isinstance(exc, tdist.DistError))
    json.dump({"sum": t.tolist(), "warnings": ours, "torch_initialized": torch_initialized,
               "torch_error": torch_error}, open(sys.argv[1] + str(tdist_rank), "w"))
"""


@pytest.mark.parametrize("case", sorted(_PROLOGUES))
def test_tdist_works_where_the_bridge_cannot_attach(case, tmp_path):
    script = tmp_path / "program.py"
    script.write_text(
        textwrap.dedent(_PROLOGUES[case]) + "import os\ntdist_rank = os.environ['RANK']\n" + textwrap.dedent(_BODY)
    )
    out = tmp_path / "result"
    results = python_job([str(script), str(out)], 2, JOB_TIMEOUT)
    for rank, result in enumerate(results):
        assert result.returncode == 0, f"rank {rank}:\n{result.stderr}"
        outcome = json.loads((tmp_path / f"result{rank}").read_text())
        assert outcome["sum"] == [6.0, 6.0]
        assert not outcome["torch_initialized"]
        (warning,) = outcome["warnings"]  # once per process, however often tdist initialises
        import torch

        assert f"torch {torch.__version__}" in warning and "does not carry over" in warning
        assert "DistributedDataParallel" in warning
        if case == "missing_feature":
            name, text, is_dist_error = outcome["torch_error"]
            assert is_dist_error and "tdist-tcp" in text and TORCH_REQUIREMENT in text, text
            assert "Traceback" not in result.stderr, result.stderr


def test_the_feature_check_passes_on_this_torch():
    """The installed torch (every end of the tested range runs this file) has what the bridge needs."""
    from tdist._torch.features import features, in_tested_range

    found = features()
    assert found.attachable, found.missing
    assert in_tested_range(found.version), f"torch {found.version} is outside torch{TORCH_REQUIREMENT}"
    assert "attaches" in found.describe()


@pytest.mark.parametrize(
    "version, tested",
    [("2.12.1", False), ("2.13.0", True), ("2.13.0+cpu", True), ("2.15.0", True), ("2.16.0a0", False), ("3.0", False)],
)
def test_the_tested_range(version, tested):
    from tdist._torch.features import in_tested_range

    assert TORCH_REQUIREMENT == ">=2.13,<2.16"
    assert in_tested_range(version) is tested


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
