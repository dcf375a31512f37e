"""tdist-mpi: registration without MPI_Init, every operation under mpirun -n 2 and 4,
the serialised thread mode, the tutorial, abort on an uncaught exception, rank checks.

Every multi-process test starts its own ``mpirun`` with a hard timeout and kills it
(its process group) when it runs over.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpi_helpers import run_mpi

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    import os

    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, env=full
    )


# ------------------------------------------------------------------ registration
def test_plugin_import_and_registration_do_not_initialise_mpi():
    proc = _python(
        """
        import sys
        import tdist_mpi.plugin
        assert "mpi4py" not in sys.modules, "importing the plugin imported mpi4py"
        import tdist
        spec = tdist.get_backend_spec("mpi")
        assert spec.available is None, spec.available
        assert "mpi4py.MPI" not in sys.modules, "the availability check imported mpi4py.MPI (MPI_Init)"
        assert spec.default_init_method == "mpi://"
        assert spec.distribution == "tdist-mpi"
        ops = spec.operations["cpu"]
        assert set(tdist.OPERATIONS) <= ops and tdist.ANY_SOURCE_OP in ops, sorted(ops)
        assert "cuda" not in spec.operations  # this MPI library is not CUDA-aware
        from tdist._plugins import plugins
        assert "mpi" in plugins().rendezvous.schemes()
        print("OK")
        """
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "setup, reason",
    [
        ("sys.modules['mpi4py'] = None", "mpi4py is not installed"),
        ("os.environ['MPI4PY_LIBMPI'] = '/nonexistent/libmpi.so'", "cannot load an MPI library"),
    ],
    ids=["no-mpi4py", "no-libmpi"],
)
def test_unavailable_backend_registers_with_a_reason(setup, reason):
    proc = _python(
        f"""
        import os, sys
        {setup}
        import tdist
        spec = tdist.get_backend_spec("mpi")
        print("AVAILABLE:", spec.available)
        assert not tdist.is_backend_available("mpi")
        try:
            tdist.init_process_group("mpi")
        except tdist.DistError as exc:
            print("INIT ERROR:", exc)
        """
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert reason in proc.stdout, proc.stdout
    assert "INIT ERROR: backend 'mpi' is installed but unavailable" in proc.stdout, proc.stdout


# -------------------------------------------------------------- the operations
@pytest.mark.parametrize("n", [2, 4])
def test_all_operations(mpi_ready, n):
    result = run_mpi(n, "ops.py", timeout=300)
    assert result.returncode == 0, result.output[-6000:]
    assert len(result.lines("ALL OK")) == n, result.output[-6000:]
    assert "thread level MPI_THREAD_MULTIPLE" in result.output


def test_serialised_thread_level_and_collective_checks(mpi_ready):
    # mpi4py reads MPI4PY_RC_THREAD_LEVEL: ask for MPI_THREAD_SERIALIZED, so the backend
    # serialises every MPI call through its lock (the threaded check runs too); with
    # TDIST_MPI_CHECK_COLLECTIVES=1 every collective is verified first (no false alarm).
    env = {"MPI4PY_RC_THREAD_LEVEL": "serialized", "TDIST_MPI_CHECK_COLLECTIVES": "1"}
    result = run_mpi(2, "ops.py", "0,2,3,4,7,9", env=env, timeout=200)
    assert result.returncode == 0, result.output[-6000:]
    assert "thread level MPI_THREAD_SERIALIZED" in result.output, result.output[-3000:]
    assert len(result.lines("ALL OK")) == 2


def test_mismatched_collectives_raise_with_the_check(mpi_ready):
    kinds = ["op", "size", "dtype_float64", "dtype_int32", "root"]
    result = run_mpi(2, "mismatch.py", ",".join(kinds), env={"TDIST_MPI_CHECK_COLLECTIVES": "1"}, timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    for kind in kinds:
        assert len(result.lines(f"MISMATCH DETECTED {kind}")) == 2, result.output[-4000:]
    assert "issued different collectives (rank(s) [0]: " in result.output
    assert len(result.lines("STILL WORKS")) == 2


def test_mpi_init_does_not_hold_the_gil(mpi_ready):
    """Rank 0 serves a TCPStore (as under env://) and starts MPI while rank 1 still needs
    that store: MPI_Init, collective, must let rank 0's store threads run."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_mpi(2, "init_gil.py", str(port), timeout=90)
    assert result.returncode == 0, result.output[-4000:]
    assert len(result.lines("INIT OK")) == 2, result.output[-4000:]


# ---------------------------------------------------------------- the tutorial
@pytest.mark.parametrize("mode", ["init_mpi", "mpi4py_first"])
def test_init_order_and_the_allreduce_algorithm(mpi_ready, mode, monkeypatch):
    """tdist_mpi.init_mpi() sets Open MPI's fast nonblocking allreduce; importing mpi4py.MPI
    first keeps Open MPI's default, and init_process_group warns how to fix it."""
    monkeypatch.delenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", raising=False)
    result = run_mpi(2, "init_order.py", mode, timeout=90)
    assert result.returncode == 0, result.output[-3000:]
    lines = result.lines("RESULT")
    assert len(lines) == 2, result.output[-3000:]
    for line in lines:
        if mode == "init_mpi":
            assert "algorithm=3 warnings=0" in line, line
        else:
            assert "algorithm=unset warnings=1" in line and "tdist_mpi.init_mpi()" in line, line


def test_tutorial_init_without_rank_or_world_size(mpi_ready):
    result = run_mpi(3, "tutorial.py", "no-args", timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert len(result.lines("TUTORIAL OK")) == 3, result.output[-4000:]


def test_tutorial_verbatim_init_process_0_0(mpi_ready):
    """The tutorial's own line: init_process(0, 0, run, backend='mpi') on every rank."""
    result = run_mpi(2, "tutorial.py", timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert len(result.lines("TUTORIAL OK")) == 2, result.output[-4000:]


# ------------------------------------------------------------ errors and abort
@pytest.mark.parametrize("mode, n", [("recv", 3), ("collective", 2)])
def test_uncaught_exception_aborts_the_job(mpi_ready, mode, n):
    result = run_mpi(n, "abort.py", mode, timeout=45)  # a hang raises JobTimeoutError
    assert result.returncode != 0, result.output[-4000:]
    assert f"boom on rank {n - 1}" in result.output, result.output[-4000:]
    assert "calling MPI_Abort" in result.output, result.output[-4000:]
    assert "NOT ABORTED" not in result.output


def test_rank_that_disagrees_with_mpi_is_an_error_on_every_rank(mpi_ready):
    result = run_mpi(3, "abort.py", "mismatch", "3", timeout=90)
    assert result.returncode == 0, result.output[-4000:]
    errors = result.lines("MISMATCH ERROR")
    assert len(errors) == 3, result.output[-4000:]
    assert any("rank=0 was passed but this process is MPI rank 1" in e for e in errors), errors
    wrong_size = run_mpi(2, "abort.py", "mismatch", "5", timeout=90)
    assert len(wrong_size.lines("MISMATCH ERROR")) == 2, wrong_size.output[-4000:]
    assert "world_size=5 was passed but the MPI job has 2 ranks" in wrong_size.output


def test_started_by_a_launcher_that_is_not_mpi_is_refused(mpi_ready, tmp_path):
    """tdistrun sets RANK/WORLD_SIZE=2 but starts two MPI singletons: each would be rank 0
    of a 1-process world (all_reduce of ones = 1). Every process must refuse instead."""
    import os
    import signal
    import tempfile

    from mpi_helpers import PROGRAMS
    from tdist._local import mpirun_env

    env = mpirun_env(dict(os.environ, PYTHONUNBUFFERED="1"), tempfile.mkdtemp(dir=tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tdist.launch", "--nproc_per_node", "2", str(PROGRAMS / "all_reduce_ones.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert "RESULT" not in out, out[-4000:]
    assert proc.returncode != 0, out[-4000:]
    assert "the launcher set WORLD_SIZE=2 but MPI_COMM_WORLD has 1 rank(s)" in out, out[-4000:]
    assert "start the program with mpirun -n N" in out, out[-4000:]


# ------------------------------------------------------ fault tolerance (ULFM)
def _ulfm_or_skip() -> tuple[str, ...]:
    from tdist_mpi._ulfm import LAUNCH_ARGS, library_has_ulfm

    if not library_has_ulfm():
        pytest.skip("this MPI library has no fault tolerance (ULFM)")
    return LAUNCH_ARGS


@pytest.mark.parametrize("mode", ["kill", "stop", "kill0"])
def test_survivors_shrink_and_finish_under_ulfm(mpi_ready, mode):
    """mpirun --with-ft ulfm, 4 ranks: the last rank is SIGKILLed (or SIGSTOPped past the
    timeout; or rank 0 is SIGKILLed, the job's store being served outside the job) at step
    5 of 12; the survivors agree it failed, shrink the default group and a subgroup, redo
    the step and finish with the survivors' sums; the job exits 0."""
    from datetime import timedelta

    import tdist

    args = [mode]
    store = None
    if mode == "kill0":
        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
        args.append(str(store.port))
    try:
        result = run_mpi(4, "survive.py", *args, timeout=240, mpirun_args=_ulfm_or_skip())
    finally:
        if store is not None:
            store.close()
    out = result.output
    assert result.returncode == 0, out[-4000:]
    lost = 0 if mode == "kill0" else 3
    survivors = [r for r in range(4) if r != lost]
    failed = result.lines("FAILED")
    assert len(failed) == 3 and all(f" [{lost}] " in line for line in failed), out[-4000:]
    kind = "DistRankFailureTimeoutError" if mode == "stop" else "DistRankFailureError "
    assert all(kind in line + " " for line in failed), failed
    assert result.lines("PAIR") == [f"PAIR [{3 if lost == 0 else 0}]"], out[-4000:]
    before, after = 10.0, 10.0 - (lost + 1)  # 1+2+3+4, then without the lost rank from the redone step 5 on
    expected = [before] * 5 + [after] * 7
    for new, rank in enumerate(survivors):
        assert result.lines(f"SHRUNK {rank} -> {new}/3"), out[-4000:]
        assert result.lines(f"SUMS {rank} ") == [f"SUMS {rank} {expected}"], out[-4000:]
        assert result.lines(f"DONE {rank}"), out[-4000:]
    assert not result.lines(f"DONE {lost}"), out[-4000:]


def test_without_ulfm_shrink_and_abort_say_how_to_launch(mpi_ready, tmp_path):
    """Under a plain mpirun the spec declares shrink_group, abort and peer_failure
    unsupported, naming --with-ft ulfm, and shrink_group refuses before communicating."""
    _ulfm_or_skip()
    code = textwrap.dedent(
        """
        import tdist as dist
        spec = dist.get_backend_spec("mpi")
        unsupported = spec.extra["unsupported"]
        for key in ("shrink_group", "abort", "peer_failure"):
            assert "--with-ft ulfm" in unsupported[key], (key, unsupported.get(key))
        dist.init_process_group("mpi")
        try:
            dist.shrink_group([1 - dist.get_rank()])
        except TypeError as exc:
            print("REFUSED", dist.get_rank(), exc, flush=True)
        dist.barrier()
        dist.destroy_process_group()
        """
    )
    program = tmp_path / "refuse.py"
    program.write_text(code)
    result = run_mpi(2, str(program), timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    refused = result.lines("REFUSED")
    assert len(refused) == 2 and all("mpirun --with-ft ulfm" in line for line in refused), result.output[-4000:]


def test_spec_outside_a_job_declares_fault_tolerance(mpi_ready):
    """Outside mpirun (the kit's controller, the docs) a library with ULFM means the
    features are supported, and the spec tells the kit to launch with --with-ft ulfm;
    TDIST_MPI_ULFM=0 turns it off."""
    _ulfm_or_skip()
    check = """
        import tdist
        spec = tdist.get_backend_spec("mpi")
        print("UNSUPPORTED", sorted(spec.extra["unsupported"]))
        print("ARGS", list(spec.extra["mpirun_args"]))
        """
    on = _python(check)
    assert on.returncode == 0, on.stdout + on.stderr
    assert "'shrink_group'" not in on.stdout and "'abort'" not in on.stdout, on.stdout
    assert "ARGS ['--with-ft', 'ulfm']" in on.stdout, on.stdout
    off = _python(check, env={"TDIST_MPI_ULFM": "0"})
    assert "'shrink_group'" in off.stdout and "'abort'" in off.stdout and "'peer_failure'" in off.stdout, off.stdout


# -------------------------------------------------------------------- benchmark
def test_bench_overhead_runs(mpi_ready):
    result = run_mpi(2, str(ROOT / "bench_overhead.py"), "--sizes", "4,65536", "--rounds", "2", timeout=120)
    assert result.returncode == 0, result.output[-4000:]
    assert "raw mpi4py" in result.output and result.output.rstrip().endswith("x"), result.output[-4000:]


def test_a_request_a_revocation_leaves_pending_fails_at_once(mpi_ready):
    """With fault tolerance, a request whose communicator was revoked and that Test() still
    calls pending fails with MPI_ERR_REVOKED at the next poll (done-callback thread, blocked
    wait), not at the group's timeout; a completed one still succeeds."""
    result = run_mpi(1, "revoked.py", timeout=60)
    assert result.returncode == 0, result.output[-4000:]
    for line in ("POLL OK", "WAIT OK", "DONE OK"):
        assert result.lines(line), result.output[-4000:]
