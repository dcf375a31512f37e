"""The conformance kit fails a backend that breaks a "must" of the contract, naming it.

``tests/broken_backend/tdist_broken`` is the tcp backend behind a wrapper that breaks one
must at a time (``TDIST_BROKEN=<violation>``). It is registered the way any third-party
backend is, through an installed distribution's entry point (a ``*.dist-info`` written
into a temporary directory on ``PYTHONPATH``), and the kit runs on it from outside the
repository, as an author runs it: ``pytest --pyargs tdist.testing.suite --tdist-backend broken``.

For each violation the kit's tests that check that must are run and must fail with the
message that names the violation; with nothing broken the same tests pass, so what
fails is the violation and not the wrapper.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PACKAGE_ROOT = HERE / "broken_backend"
sys.path.insert(0, str(PACKAGE_ROOT))
from tdist_broken import BACKEND_NAME, VIOLATIONS  # noqa: E402

sys.path.remove(str(PACKAGE_ROOT))


class Case:
    """The kit's tests (``-k`` expression of ``suite``) that must fail under ``violation``,
    and what their report must say."""

    def __init__(self, violation: str, select: str, says: str, *, suite: str = "test_conformance", sizes: str = "2"):
        self.violation, self.select, self.says, self.suite, self.sizes = violation, select, says, suite, sizes


CASES = [
    Case("blocks_async", "async_returns_at_once", "async calls blocked the caller"),
    Case("not_bit_identical", "results_bit_identical and small", "results are not bit-identical on every rank"),
    Case("pending_survive_destroy", "pending_fail_at_destroy", "was still pending 10 s later"),
    Case(
        "timeout_as_runtime_error",
        "collective_timeout",
        "raised RuntimeError",
        suite="test_failures",
    ),
    Case("timeout_names_nobody", "collective_timeout", "does not name the missing rank 2", suite="test_failures"),
    Case("lazy_send", "send_buffer_reusable", "the send completed before its buffer could be reused"),
    Case("single_threaded", "concurrent_threads", "concurrent operations failed"),
    Case("recv_accepts_anything", "recv_wrong_size_fails or recv_wrong_dtype_fails", "nothing was raised"),
    Case("no_source_rank", "any_source_arrival_order", "completed without a source rank", sizes="4"),
    Case("any_source_by_rotation", "any_source_arrival_order", "receives completed with senders [3, 2, 1]", sizes="4"),
    Case("declares_int16_unsupported", "reduce_ops and int16 and all_reduce", "the declaration is wrong"),
    Case("refuses_uint8", "reduce_ops and uint8 and all_reduce", "all_reduce on uint8 is not supported"),
    Case("early_is_completed", "is_completed_means_done", "is_completed() was True while"),
    Case("completes_only_in_wait", "is_completed_means_done", "never reported completion without wait()"),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory on PYTHONPATH holding the broken backend's distribution metadata."""
    root = tmp_path_factory.mktemp("broken-site")
    info = root / "tdist_broken-0.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tdist-broken\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[tdist]\n{BACKEND_NAME} = tdist_broken.plugin\n")
    return root


def _kit(site: Path, tmp_path: Path, violation: str, select: str, suite: str, sizes: str) -> tuple[int, str]:
    """Run the kit's ``suite`` on the broken backend from ``tmp_path``; (exit code, output)."""
    env = dict(os.environ, TDIST_BROKEN=violation)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "--pyargs",
        f"tdist.testing.suite.{suite}",
        "--tdist-backend",
        BACKEND_NAME,
        "--tdist-world-sizes",
        sizes,
        "-k",
        select,
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-q",
        "--tb=short",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    return proc.returncode, proc.stdout + proc.stderr


def test_every_violation_has_a_case() -> None:
    assert sorted(c.violation for c in CASES) == sorted(VIOLATIONS)


def test_nothing_broken_passes(site: Path, tmp_path: Path) -> None:
    """The wrapper itself keeps every must: the selected tests pass with no violation."""
    for suite, sizes in (("test_conformance", "2,4"), ("test_failures", "2")):
        select = " or ".join(sorted({f"({c.select})" for c in CASES if c.suite == suite}))
        rc, out = _kit(site, tmp_path, "", select, suite, sizes)
        assert rc == 0, f"the kit fails the unbroken wrapper ({suite}):\n{out[-6000:]}"
        assert " passed" in out and "failed" not in out, out[-3000:]


@pytest.fixture(scope="module")
def reports(site: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str]]:
    """Every case's kit run, three at a time (they mostly wait: for timeouts, late peers)."""

    def run(case: Case) -> tuple[int, str]:
        where = tmp_path_factory.mktemp(case.violation)
        return _kit(site, where, case.violation, case.select, case.suite, case.sizes)

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        return dict(zip([c.violation for c in CASES], pool.map(run, CASES)))


@pytest.mark.parametrize("case", CASES, ids=[c.violation for c in CASES])
def test_kit_fails_the_violation(reports: dict[str, tuple[int, str]], case: Case) -> None:
    rc, out = reports[case.violation]
    assert rc == 1, (
        f"TDIST_BROKEN={case.violation} ({VIOLATIONS[case.violation]}): the kit did not fail:\n{out[-6000:]}"
    )
    assert case.says in out, (
        f"TDIST_BROKEN={case.violation}: the kit failed without saying {case.says!r}:\n{out[-6000:]}"
    )
