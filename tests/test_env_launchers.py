"""env:// under other launchers: without RANK/WORLD_SIZE, the rank and world size
come from Open MPI (OMPI_COMM_WORLD_RANK/SIZE), PMI (PMI_RANK/PMI_SIZE: MPICH,
Intel MPI) or Slurm (SLURM_PROCID/SLURM_NTASKS) variables; under torchrun/tdistrun
(TORCHELASTIC_USE_AGENT_STORE=True) the store is the agent's, or tdistrun's
authenticated one (TDIST_STORE_ADDR/PORT).

Real 2-process jobs started with only those variables plus MASTER_ADDR/PORT,
as mpirun or srun would start them; then the error cases, which fail before
any network I/O (or at the first connection) and run in this process. Jobs under
the real torchrun and tdistrun are in test_torchrun.py.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import pytest

pytest.importorskip("torch")

import tdist  # noqa: E402

from tdist.testing import free_port  # noqa: E402
from tdist.testing.processes import base_env, run_job  # noqa: E402

BACKEND = "tcp"
JOB_TIMEOUT = 90
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 30)

WORKER = """
import json, sys
import torch
import tdist as dist

kwargs = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
dist.init_process_group(sys.argv[1], **kwargs)
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(json.dumps({"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": t.item()}))
dist.destroy_process_group()
"""

LAUNCHER_VARIABLES = {
    # name: (rank variable, size variable, extra variables the launcher also sets)
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", {"OMPI_COMM_WORLD_LOCAL_RANK": "{rank}"}),
    "pmi": ("PMI_RANK", "PMI_SIZE", {}),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", {"SLURM_LOCALID": "{rank}", "SLURM_NNODES": "1", "SLURM_STEP_ID": "0"}),
}


@pytest.fixture(autouse=True)
def _needs_backend():
    if not tdist.is_backend_available(BACKEND):
        pytest.fail(f"backend {BACKEND!r} is not installed/available: {tdist.available_backends()}")


def job(tmp_path, envs, args=()) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    results = run_job([[sys.executable, str(script), BACKEND, *args]] * len(envs), envs, timeout=JOB_TIMEOUT)
    reports = []
    for i, res in enumerate(results):
        assert res.returncode == 0, f"process {i} exited with {res.returncode}\n{res.stdout}\n{res.stderr}"
        reports.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return reports


def launcher_env(launcher: str, rank: int, size: int, port: int, **extra: str) -> dict[str, str]:
    rank_var, size_var, more = LAUNCHER_VARIABLES[launcher]
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update({rank_var: str(rank), size_var: str(size)})
    env.update({k: v.format(rank=rank) for k, v in more.items()})
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("launcher", sorted(LAUNCHER_VARIABLES))
def test_ranks_from_launcher_variables(tmp_path, launcher):
    port = free_port()
    reports = job(tmp_path, [launcher_env(launcher, r, 2, port) for r in range(2)])
    assert [r["rank"] for r in reports] == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in reports)


@pytest.mark.slow
def test_rank_and_world_size_take_precedence_over_launcher_variables(tmp_path):
    """RANK/WORLD_SIZE (set by tdistrun) win over OMPI_* (e.g. tdistrun inside an mpirun job)."""
    port = free_port()
    envs = [launcher_env("openmpi", r, 2, port, RANK=str(1 - r), WORLD_SIZE="2") for r in range(2)]
    reports = job(tmp_path, envs)
    assert [r["rank"] for r in reports] == [1, 0]


@pytest.mark.slow
def test_arguments_take_precedence_over_launcher_variables(tmp_path):
    """rank=/world_size= passed to init_process_group win over SLURM_* (a 1-process job in a 2-task allocation)."""
    env = launcher_env("slurm", 1, 2, free_port())
    reports = job(tmp_path, [env], args=[json.dumps({"rank": 0, "world_size": 1})])
    assert reports == [{"rank": 0, "world_size": 1, "sum": 1.0}]


@pytest.mark.slow
def test_three_rank_slurm_job(tmp_path):
    """srun -n 3: ranks 0..2 from SLURM_PROCID, the all_reduce sees all three."""
    port = free_port()
    reports = job(tmp_path, [launcher_env("slurm", r, 3, port) for r in range(3)])
    assert [r["rank"] for r in reports] == [0, 1, 2]
    assert all(r["world_size"] == 3 and r["sum"] == 6.0 for r in reports)


# --------------------------------------------------------------------------- errors, before any network I/O
RANK_VARIABLES = [v for rank_var, size_var, _ in LAUNCHER_VARIABLES.values() for v in (rank_var, size_var)]


@pytest.fixture
def clean_env(monkeypatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURM_STEP_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TDIST_STORE_ADDR",
        "TDIST_STORE_PORT",
        "TDIST_STORE_PREFIX",
        "TDIST_STORE_TOKEN",
        *RANK_VARIABLES,
    ):
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    if tdist.is_initialized():
        tdist.destroy_process_group()


def test_no_rank_anywhere(clean_env):
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="env:// rendezvous: environment variable RANK is not set"):
        tdist.init_process_group(BACKEND)


def test_no_world_size_anywhere(clean_env):
    clean_env.setenv("MASTER_PORT", str(free_port()))
    clean_env.setenv("PMI_RANK", "0")
    with pytest.raises(ValueError, match="PMI_RANK is set but PMI_SIZE is not"):
        tdist.init_process_group(BACKEND)


@pytest.mark.parametrize("launcher", sorted(LAUNCHER_VARIABLES))
def test_non_integer_launcher_variable_is_named(clean_env, launcher):
    rank_var, size_var, extra = LAUNCHER_VARIABLES[launcher]
    for name, value in extra.items():
        clean_env.setenv(name, value.format(rank=0))
    clean_env.setenv(rank_var, "zero")
    clean_env.setenv(size_var, "2")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match=f"{rank_var}='zero' is not an integer"):
        tdist.init_process_group(BACKEND)


def test_rank_out_of_range_from_launcher_variables(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "2")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    clean_env.setenv("MASTER_ADDR", "127.0.0.1")
    clean_env.setenv("MASTER_PORT", str(free_port()))  # nobody listens: a check after connecting times out
    with pytest.raises(ValueError, match="rank 2 is out of range for world_size 2"):
        tdist.init_process_group(BACKEND, timeout=timedelta(seconds=2))


def test_missing_master_port(clean_env):
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "1")
    clean_env.setenv("SLURM_STEP_ID", "0")
    with pytest.raises(ValueError, match="MASTER_PORT is not set"):
        tdist.init_process_group(BACKEND)


def test_missing_master_addr_on_a_nonzero_rank(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        tdist.init_process_group(BACKEND)


def test_slurm_batch_script_variables_are_ignored(clean_env):
    """Inside an sbatch script (no job step: SLURM_STEP_ID unset) SLURM_* do not make a world."""
    clean_env.setenv("SLURM_PROCID", "0")
    clean_env.setenv("SLURM_NTASKS", "4")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="RANK is not set"):
        tdist.init_process_group(BACKEND)


def test_rank_and_size_come_from_one_launcher(clean_env):
    """OMPI_COMM_WORLD_RANK without OMPI_COMM_WORLD_SIZE is an error, not mixed with another launcher's size."""
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "0")
    clean_env.setenv("PMI_SIZE", "2")
    clean_env.setenv("MASTER_PORT", str(free_port()))
    with pytest.raises(ValueError, match="OMPI_COMM_WORLD_RANK is set but OMPI_COMM_WORLD_SIZE is not"):
        tdist.init_process_group(BACKEND)


# --------------------------------------------------------------------------- torchrun's agent store
def agent_env(env, **extra: str) -> None:
    """The variables torchrun gives rank 1 of 2 (its agent store at MASTER_ADDR:MASTER_PORT)."""
    env.setenv("RANK", "1")
    env.setenv("WORLD_SIZE", "2")
    env.setenv("MASTER_ADDR", "127.0.0.1")
    env.setenv("MASTER_PORT", str(free_port()))
    env.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    for name, value in extra.items():
        env.setenv(name, value)


def test_token_with_torchruns_agent_store_is_refused(clean_env):
    """torch's TCPStore cannot authenticate: with a token set, env:// refuses it (no silent
    downgrade), before connecting to anything."""
    agent_env(clean_env, TDIST_STORE_TOKEN="secret")
    with pytest.raises(tdist.DistStoreError, match="TDIST_STORE_TOKEN is set, but .* cannot authenticate"):
        tdist.init_process_group(BACKEND)


def test_unreachable_agent_store_is_named(clean_env):
    agent_env(clean_env)
    port = os.environ["MASTER_PORT"]
    with pytest.raises(tdist.DistNetworkError, match=f"cannot join the launcher's agent store at 127.0.0.1:{port}"):
        tdist.init_process_group(BACKEND, timeout=timedelta(seconds=1))


def test_store_addr_needs_its_port(clean_env):
    agent_env(clean_env, TDIST_STORE_ADDR="127.0.0.1")
    with pytest.raises(ValueError, match="TDIST_STORE_ADDR is set but TDIST_STORE_PORT is not"):
        tdist.init_process_group(BACKEND)
