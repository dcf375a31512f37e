"""Frameworks that pick the torch.distributed backend themselves, on a tdist backend.

Each case is a small real program (tests/clients/client_programs.py) run under torchrun
with 2 ranks twice: on torch's gloo, started the framework's own way, and on
``tdist-tcp``, set up by the recipe docs/pages/guide/frameworks.md gives for that
framework. Both ranks must end with the same parameters, and every parameter and every
value the framework synchronised must be bitwise equal to gloo's. A case skips when its
framework is not installed (``make venv`` installs them, pinned in constraints.txt).
"""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

from tdist.testing.processes import base_env, run_job  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAM = os.path.join(HERE, "client_programs.py")
JOB_TIMEOUT = 150  # one torchrun job; each takes 10-30 s on 2 busy cores
BACKENDS = ("gloo", "tdist-tcp")  # the reference first
# torch's own gloo (tdist not even imported) aborts at interpreter exit, after
# destroy_process_group returned, in about 1 run in 8 of the powersgd program on torch 2.13:
# the reference's results are written by then, so that abort alone does not fail the case
GLOO_EXIT_ABORT = "terminate called without an active exception"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(len(BACKENDS) * JOB_TIMEOUT + 60)]

# program -> the modules it needs beyond torch
CASES = {
    "lightning-trainer": ("pytorch_lightning",),
    "fabric": ("lightning_fabric",),
    "powersgd": (),
    "compile": (),
    "transformers": ("transformers", "accelerate"),
    "accelerate": ("accelerate",),
}


def run_program(program: str, backend: str, tmp_path) -> list[dict]:
    """``torchrun --standalone --nproc-per-node 2 client_programs.py program``; each rank's
    result. Past JOB_TIMEOUT, run_job kills torchrun, its workers and what they started."""
    out = tmp_path / backend
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs" / backend),
        PROGRAM,
        program,
        "--backend",
        backend,
        "--out",
        str(out),
    ]
    env = base_env(
        HF_HUB_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HOME=str(tmp_path / "hf"),
        TOKENIZERS_PARALLELISM="false",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
    )
    (res,) = run_job([cmd], [env], timeout=JOB_TIMEOUT, cwd=str(tmp_path))
    output = f"{res.stdout[-4000:]}\n{res.stderr[-6000:]}"
    files = [out / f"rank{rank}.pt" for rank in range(2)]
    aborted_at_exit = backend == "gloo" and GLOO_EXIT_ABORT in res.stderr and all(f.exists() for f in files)
    assert res.returncode == 0 or aborted_at_exit, f"{program} on {backend}:\n{output}"
    return [torch.load(f, weights_only=False) for f in files]


def assert_bitwise_equal(found: dict, expected: dict, what: str) -> None:
    assert sorted(found) == sorted(expected), what
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), f"{what}: {name} differs (max {(found[name] - tensor).abs().max()})"


@pytest.mark.parametrize("program", sorted(CASES))
def test_matches_gloo_bitwise(program, tmp_path):
    for module in CASES[program]:
        pytest.importorskip(module)
    results = {backend: run_program(program, backend, tmp_path) for backend in BACKENDS}
    reference = results["gloo"][0]
    for backend, ranks in results.items():
        for rank, result in enumerate(ranks):
            # what the framework made of the group (world size, DDP wrapper, steps): as on gloo
            view, expected = dict(result["view"]), dict(results["gloo"][rank]["view"])
            assert view.pop("torch_backend") == backend and expected.pop("torch_backend") == "gloo"
            assert view == expected and view["world_size"] == 2, (backend, rank, view, expected)
            assert_bitwise_equal(result["params"], reference["params"], f"{backend} rank {rank} parameters")
            assert_bitwise_equal(result["synced"], reference["synced"], f"{backend} rank {rank} synchronised values")
