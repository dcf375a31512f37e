"""torch.compile on tdist's groups: functional collectives, in-place collectives and group
lookups inside compiled functions, with the aot_eager and inductor backends, on 2 real processes.

Compiling is slow, so one job runs every case: each rank runs this file as a program
(``python tests/test_torch_compile.py --out DIR --port PORT``), which initialises tdist on tcp,
compiles and runs each case and compares it with eager, destroys the group, does the same after
``torch.distributed.init_process_group("tdist-tcp")``, and writes ``DIR/rank<N>.json``. The
tests assert on those files. What a case expects (see :data:`CASES`): "graph" -- one graph,
no graph break (torch traces it: the functional collectives and torch.distributed's in-place
collectives on tdist's groups, tdist's queries on the default group); "break" -- a clean graph
break at tdist's call, which runs eagerly (tdist's own communication functions, queries on
another group). Either way the result is eager's, and Dynamo compiles no frame of tdist's code
but the queries' (which it traces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any, Callable

import pytest

JOB_TIMEOUT = 300
WORLD_SIZE = 2

#: case -> what it expects ("graph" or "break"); the functions are in :func:`_functions`.
CASES = {
    "functional_all_reduce_world": "graph",
    "functional_all_reduce_new_group": "graph",
    "functional_all_gather_world": "graph",
    "functional_reduce_scatter_new_group": "graph",
    "torch_all_reduce_world": "graph",
    "torch_all_reduce_default": "graph",
    "torch_all_reduce_new_group": "graph",
    "tdist_all_reduce_world": "break",
    "tdist_all_reduce_new_group": "break",
    "queries_world": "graph",
    "queries_new_group": "break",
}
#: (entry, backend) -> the cases run there: every case with aot_eager after tdist's init;
#: fewer where compiling costs more (inductor) or adds nothing new (torch's entry).
RUNS = {
    ("tdist", "aot_eager"): list(CASES),
    ("tdist", "inductor"): ["functional_all_reduce_world", "torch_all_reduce_world", "tdist_all_reduce_world"],
    ("torch", "aot_eager"): [
        "functional_all_reduce_world",
        "torch_all_reduce_world",
        "tdist_all_reduce_world",
        "queries_world",
    ],
}
#: What tdist's marked functions say when Dynamo breaks the graph at them (tdist._torch.dynamo).
BREAK_REASON = "run eagerly under torch.compile"


# ---------------------------------------------------------------------------- the program (each rank)
def _functions() -> dict[str, Callable[..., Any]]:
    """Each case: ``fn(t, group)`` with ``group`` a tdist.new_group() group; the others look
    their group up inside the compiled function."""
    import torch.distributed as td
    import torch.distributed._functional_collectives as fc

    import tdist

    def queries_world(t, g):
        world = tdist.group.WORLD
        return t * tdist.get_rank() + tdist.get_world_size() + tdist.get_world_size(world) * (world is not None)

    def queries_new_group(t, g):
        return t * tdist.get_rank(g) + tdist.get_world_size(g)

    def torch_all_reduce(group_of: Callable[[Any], Any], **kwargs: Any) -> Callable[..., Any]:
        def fn(t, g):
            t = t * 2
            td.all_reduce(t, group=group_of(g), **kwargs)
            return t + 1

        return fn

    def tdist_all_reduce(group_of: Callable[[Any], Any], **kwargs: Any) -> Callable[..., Any]:
        def fn(t, g):
            t = t * 2
            tdist.all_reduce(t, group=group_of(g), **kwargs)
            return t + 1

        return fn

    world = lambda g: tdist.group.WORLD  # noqa: E731 - looked up inside the compiled function
    given = lambda g: g  # noqa: E731
    return {
        "functional_all_reduce_world": lambda t, g: fc.all_reduce(t * 2, "sum", tdist.group.WORLD) + 1,
        "functional_all_reduce_new_group": lambda t, g: fc.all_reduce(t - 1, "max", g) * 3,
        "functional_all_gather_world": lambda t, g: fc.all_gather_tensor(t + 1, 0, tdist.group.WORLD) * 2,
        "functional_reduce_scatter_new_group": lambda t, g: fc.reduce_scatter_tensor(t * 3, "sum", 0, g) - 1,
        "torch_all_reduce_world": torch_all_reduce(world),
        "torch_all_reduce_default": torch_all_reduce(lambda g: None),
        "torch_all_reduce_new_group": torch_all_reduce(given, op=td.ReduceOp.MAX),
        "tdist_all_reduce_world": tdist_all_reduce(world),
        "tdist_all_reduce_new_group": tdist_all_reduce(given, op=tdist.ReduceOp.MAX),
        "queries_world": queries_world,
        "queries_new_group": queries_new_group,
    }


def _tdist_dirs() -> tuple[str, ...]:
    import tdist
    import tdist_tcp

    return tuple(os.path.dirname(m.__file__) for m in (tdist, tdist_tcp))


def _run_case(name: str, fn: Callable[..., Any], backend: str, group: Any, rank: int) -> dict:
    """Eager, then compiled: both results, the graphs and graph breaks Dynamo made, and the
    frames of tdist's code it compiled."""
    import torch
    import torch._dynamo
    from torch._dynamo import convert_frame
    from torch._dynamo.utils import counters

    x = torch.arange(4, dtype=torch.float32) + 10 * rank
    result: dict = {}
    try:
        eager = fn(x.clone(), group)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(fn, backend=backend)(x.clone(), group)
        result["eager"], result["compiled"] = eager.tolist(), compiled.tolist()
        result["equal"] = torch.equal(eager, compiled)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result["error"] = f"{type(exc).__name__}: {str(exc)[:3000]}"
    result["graphs"] = counters["stats"]["unique_graphs"]
    result["breaks"] = list(counters["graph_break"])  # each reason Dynamo gave
    seen = getattr(getattr(convert_frame, "input_codes", None), "seen", [])  # the frames Dynamo compiled
    dirs = _tdist_dirs()
    codes = [ref() for ref in seen]
    result["tdist_frames"] = [f"{c.co_filename}:{c.co_name}" for c in codes if c and c.co_filename.startswith(dirs)]
    return result


def _compile_unavailable(backend: str) -> str | None:
    """Why torch.compile cannot run with ``backend`` here, or None."""
    import torch
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return f"torch.compile is not supported on this Python/platform (torch {torch.__version__})"
    try:
        torch._dynamo.reset()
        torch.compile(lambda t: t * 2 + 1, backend=backend)(torch.ones(3))
    except Exception as exc:  # noqa: BLE001 - e.g. inductor without a C++ compiler
        return f"torch.compile(backend={backend!r}) fails here: {type(exc).__name__}: {str(exc)[:500]}"
    return None


def _run_entry(entry: str, port: int, rank: int, unavailable: dict) -> dict:
    import torch.distributed as td

    import tdist

    if entry == "tdist":
        tdist.init_process_group("tcp")
    else:
        td.init_process_group("tdist-tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    report: dict = {"same_world": tdist.group.WORLD is td.group.WORLD}
    group = tdist.new_group(list(range(WORLD_SIZE)))
    functions = _functions()
    for (where, backend), names in RUNS.items():
        if where != entry or backend in unavailable:
            continue
        for name in names:
            report[f"{backend}/{name}"] = _run_case(name, functions[name], backend, group, rank)
    tdist.barrier()
    tdist.destroy_process_group()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    warnings.simplefilter("ignore")  # the functional collectives' deprecations, Dynamo's hints
    backends = sorted({backend for _, backend in RUNS})
    unavailable = {b: why for b in backends if (why := _compile_unavailable(b)) is not None}
    result: dict = {"rank": rank, "unavailable": unavailable}
    if "aot_eager" not in unavailable:
        for entry in ("tdist", "torch"):
            result[entry] = _run_entry(entry, args.port, rank, unavailable)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Both ranks' reports of one job (see the module's docstring)."""
    pytest.importorskip("torch")
    from repo_paths import TESTS

    from tdist._torch.features import features
    from tdist.testing import free_port
    from tdist.testing.processes import python_job

    if not features().attachable:
        pytest.skip(f"the bridge does not attach to torch {features().version}")
    out = tmp_path_factory.mktemp("compile")
    script = [os.path.join(TESTS, "test_torch_compile.py"), "--out", str(out), "--port", str(free_port())]
    job = python_job(script, WORLD_SIZE, timeout=JOB_TIMEOUT)
    for res in job:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
    if "aot_eager" in reports[0]["unavailable"]:
        pytest.skip(reports[0]["unavailable"]["aot_eager"])
    return reports


def _cases(results: list[dict], entry: str, backend: str) -> list[tuple[str, dict]]:
    if backend in results[0]["unavailable"]:
        pytest.skip(results[0]["unavailable"][backend])
    names = RUNS[(entry, backend)]
    return [(name, report[entry][f"{backend}/{name}"]) for report in results for name in names]


def _in_groups_module(frame: str) -> bool:
    return os.path.normpath(frame.rsplit(":", 1)[0]).endswith(os.path.join("tdist", "_groups.py"))


def _check(name: str, case: dict) -> None:
    assert "error" not in case, (name, case)
    assert case["equal"], (name, case)
    # Dynamo compiles no tdist frame but those of the queries it traces (tdist._groups), which
    # it compiles as frames of their own after a graph break in them (queries_new_group)
    compiled_here = [frame for frame in case["tdist_frames"] if not _in_groups_module(frame)]
    assert compiled_here == [], (name, "Dynamo compiled tdist's code", case)
    if CASES[name] == "graph":
        assert case["graphs"] == 1 and case["breaks"] == [], (name, "expected one graph, no break", case)
    else:
        assert any(BREAK_REASON in reason for reason in case["breaks"]), (name, "expected tdist's graph break", case)


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_collectives_on_tdists_groups(results, backend):
    """After tdist.init_process_group: every case, compiled, gives eager's result (checked
    against the expected sums for the first), with one graph where torch can trace it."""
    for name, case in _cases(results, "tdist", backend):
        _check(name, case)
    total = [2.0 * (i + (i + 10)) + 1 for i in range(4)]  # rank r's input: arange(4) + 10 * r
    for report in results:
        assert report["tdist"][f"{backend}/functional_all_reduce_world"]["eager"] == total


@pytest.mark.slow
@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_compiled_collectives_after_torchs_init_process_group(results):
    """A torch program's init_process_group("tdist-tcp"): tdist's groups are the same, and compile alike."""
    assert all(report["torch"]["same_world"] and report["tdist"]["same_world"] for report in results)
    for name, case in _cases(results, "torch", "aot_eager"):
        _check(name, case)


if __name__ == "__main__":
    sys.exit(main())
