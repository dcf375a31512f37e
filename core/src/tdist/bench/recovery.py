"""``--recovery``: how long a job takes to train again after losing a rank, without
restarting (the survivors shrink) against the torchrun way (``tdistrun --max-restarts 1``:
every worker restarts and reloads a checkpoint), side by side in one run.

World 4 on one host, torch's DDP (through the bridge) on a ~4.2M-parameter MLP
(4 x Linear(1024, 1024)), SGD with momentum. At step ``KILL_STEP`` the last rank records
the time and SIGKILLs itself after its forward pass (the others are in backward's
all-reduces).

- ``shrink`` (per backend): the survivors catch DDP's error, ``shrink_group`` the ranks
  :func:`tdist.failed_ranks` names away, build a new DDP and redo the step. Measured:
  the kill to the survivors' error (*detect*) and to their first completed step on the
  shrunken group (*recover*). A backend whose ranks share one ``mpirun`` (mpi) runs
  under it, with what its spec asks for (``--with-ft ulfm``).
- ``restart``: the same program under ``tdistrun --max-restarts 1``, checkpointing
  (model and optimizer, ``torch.save``) after every step; after the kill the launcher
  stops and restarts every worker, which re-import torch, rendezvous again and load the
  checkpoint. Measured: the kill to the first completed step of the new attempt.
- ``cut`` (``--recovery --hosts 2``, :mod:`tdist.bench.recovery_hosts`): the same loop on
  simulated hosts, where instead of a kill the last host's link is cut while its ranks
  are in the step; the survivors find out by the group's timeout.

    python -m tdist.bench --recovery
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from typing import Optional, Sequence

from .._local import mpirun_env
from ..testing.processes import JOB_MARKER, kill_marked
from .ddp import LAYERS, WIDTH, _model

__all__ = [
    "recovery_bench",
    "recovery_backends",
    "format_recovery",
    "KILL_STEP",
    "LOST_AT",
    "TIMES",
    "CUT_ME",
    "CUT_TIMEOUT_S",
    "CUT_WINDOW_S",
]

KILL_STEP, STEPS, BATCH = 3, 6, 16
#: the files of a run's directory: when the rank was lost, rank 0's times, and (``cut``) the
#: last rank's call to cut its host's link now
LOST_AT, TIMES, CUT_ME = "killed_at", "times.json", "cut_me"
#: the group's timeout and the failure window in the ``cut`` runs: a lost link is found by them
CUT_TIMEOUT_S, CUT_WINDOW_S = 5.0, 2.0
_TDISTRUN = [sys.executable, "-c", "import sys; from tdist.launch import main; sys.exit(main())"]


def recovery_bench(backends: list[str], world: int = 4, timeout: float = 300.0) -> list[dict]:
    """One row per way: ``shrink`` on each of ``backends``, then ``restart`` (tcp)."""
    from tdist.testing import free_port

    rows = []
    for backend in backends:
        mpirun = _mpirun_command(backend, world)
        rows.append(_run(["shrink", backend], world, timeout, free_port(), launcher=False, mpirun=mpirun))
    rows.append(_run(["restart", "tcp"], world, timeout, free_port(), launcher=True))
    return rows


def recovery_backends(candidates: Sequence[str] = ("tcp", "gloo", "mpi")) -> list[str]:
    """The ``candidates`` that can shrink a group here (available, ``shrink_group`` not
    declared unsupported, ``mpirun`` found where the backend needs it); the others are
    named on stderr."""
    import tdist
    from tdist.testing import find_mpirun

    usable = []
    for name in candidates:
        try:
            spec = tdist.get_backend_spec(name)
        except tdist.DistError as exc:
            print(f"tdist.bench --recovery: {name} skipped: {exc}", file=sys.stderr)
            continue
        why = spec.available or (spec.extra or {}).get("unsupported", {}).get("shrink_group")
        if not why and spec.launcher == "mpirun" and not find_mpirun():
            why = "mpirun not found"
        if why:
            print(f"tdist.bench --recovery: {name} skipped: {why}", file=sys.stderr)
        else:
            usable.append(name)
    return usable


def _mpirun_command(backend: str, world: int) -> Optional[list[str]]:
    """``mpirun -n world ...`` for a backend whose ranks share one mpirun, else None."""
    import tdist
    from tdist.testing import find_mpirun

    spec = tdist.get_backend_spec(backend)
    if spec.launcher != "mpirun":
        return None
    extra = [str(a) for a in (spec.extra or {}).get("mpirun_args", ())]
    return [find_mpirun() or "mpirun", "-n", str(world), "--oversubscribe", "--bind-to", "none", *extra]


def _run(
    args: list[str], world: int, timeout: float, port: int, launcher: bool, mpirun: Optional[list[str]] = None
) -> dict:
    tmp = tempfile.mkdtemp(prefix="tdist-bench-recovery-")
    worker = [sys.executable, "-m", "tdist.bench.recovery", "--worker", tmp, *args]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    if launcher:
        cmd = [*_TDISTRUN, "--nproc-per-node", str(world), "--max-restarts", "1", "--no-prefix"]
        cmd += ["--master-port", str(port), "-m", "tdist.bench.recovery", "--worker", tmp, *args]
        procs = [subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)]
    elif mpirun is not None:  # every rank under one mpirun; MPI gives the ranks
        env = mpirun_env({**env, JOB_MARKER: tmp}, tmp)
        procs = [subprocess.Popen([*mpirun, *worker], env=env, start_new_session=True)]
    else:
        procs = [
            subprocess.Popen(worker, env={**env, "RANK": str(r), "WORLD_SIZE": str(world)}, start_new_session=True)
            for r in range(world)
        ]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(max(0.1, deadline - time.monotonic()))
        row = read_row(tmp, args[0], args[1], world)
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        raise RuntimeError(f"tdist.bench --recovery: {' '.join(args)} did not finish: {exc}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        if mpirun is not None:
            kill_marked(tmp)  # mpirun's ranks are not in its process group
        shutil.rmtree(tmp, ignore_errors=True)
    return row


def read_row(tmp: str, way: str, backend: str, world: int) -> dict:
    """A run's row from the files its workers (and the bench) left in ``tmp``."""
    with open(os.path.join(tmp, TIMES)) as f:
        times = json.load(f)
    with open(os.path.join(tmp, LOST_AT)) as f:
        lost = float(f.read())
    detect = times.get("caught_at")
    return {
        "way": way,
        "backend": backend,
        "world": world,
        "detect_s": None if detect is None else detect - lost,
        "recover_s": times["recovered_at"] - lost,
    }


def format_recovery(rows: list[dict]) -> str:
    restart = next((r["recover_s"] for r in rows if r["way"] == "restart"), None)
    lost = "a host cut off the network" if rows[0]["way"] == "cut" else "a SIGKILLed rank"
    lines = [
        f"recovery from {lost}, world {rows[0]['world']}, torch DDP, "
        f"{LAYERS} x Linear({WIDTH}, {WIDTH}) (4.2M parameters):",
        f"  {'way':<28}  {'detect':>9}  {'first step':>10}  {'vs restart':>10}",
    ]
    for row in rows:
        name = "tdistrun --max-restarts 1" if row["way"] == "restart" else f"{row['way']} ({row['backend']})"
        if row["way"] == "cut":
            name = f"link cut, shrink ({row['backend']})"
        detect = "-" if row["detect_s"] is None else f"{row['detect_s'] * 1e3:6.0f} ms"
        ratio = f"{row['recover_s'] / restart:9.3f}x" if restart else "-"
        lines.append(f"  {name:<28}  {detect:>9}  {row['recover_s'] * 1e3:7.0f} ms  {ratio:>10}")
    lines.append(
        "  (detect: the loss to the survivors' error; first step: to the first completed step after it,\n"
        "   on the shrunken group or in the restarted attempt; targets: <= 1 s on tcp, <= 0.1x the restart)"
    )
    if any(r["way"] == "cut" for r in rows):
        hosts = next(r["hosts"] for r in rows if r["way"] == "cut")
        lines.append(
            f"  (link cut: {hosts} simulated hosts, the last host's link cut mid-step; from the cut; the group's\n"
            f"   timeout is {CUT_TIMEOUT_S:g} s and TDIST_FAILURE_WINDOW {CUT_WINDOW_S:g} s: a silent link is found by them)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- worker side
def _worker(tmp: str, way: str, backend: str) -> None:
    import torch
    import torch.nn.functional as F

    import tdist

    torch.set_num_threads(1)
    tdist.init_process_group(backend, timeout=timedelta(seconds=CUT_TIMEOUT_S if way == "cut" else 10.0))
    first_rank, n = tdist.get_rank(), tdist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    net = _model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    checkpoint = os.path.join(tmp, "checkpoint.pt")
    step = 0
    if way == "restart" and os.path.exists(checkpoint):
        state = torch.load(checkpoint, weights_only=False)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    times: dict[str, Optional[float]] = {"caught_at": None}
    first_after: Optional[float] = None
    while step < STEPS:
        rank, world = tdist.get_rank(), tdist.get_world_size()
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH * n, WIDTH, generator=gen), torch.randn(BATCH * n, WIDTH, generator=gen)
        opt.zero_grad()
        try:
            out = ddp(x[rank::world])
            if step == KILL_STEP and first_rank == n - 1 and attempt == 0:
                _lose_this_rank(tmp, way)
            F.mse_loss(out, y[rank::world]).backward()
        except Exception:  # torch's DDP raises a RuntimeError naming tdist's DistRankFailureError
            times["caught_at"] = time.time()
            tdist.shrink_group(tdist.failed_ranks())
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            continue
        opt.step()
        step += 1
        if first_after is None and (times["caught_at"] is not None or attempt > 0):
            first_after = time.time()
        if way == "restart" and first_rank == 0:
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step}, checkpoint + ".tmp")
            os.replace(checkpoint + ".tmp", checkpoint)
    if first_rank == 0 and first_after is not None:
        times["recovered_at"] = first_after
        with open(os.path.join(tmp, TIMES), "w") as f:
            json.dump(times, f)
    tdist.destroy_process_group()


def _lose_this_rank(tmp: str, way: str) -> None:
    """Kill this process; or (``cut``) have the bench cut this host's link, and go on into
    the step's all-reduces once it has (they then reach nobody)."""
    if way != "cut":
        with open(os.path.join(tmp, LOST_AT), "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    open(os.path.join(tmp, CUT_ME), "w").close()
    deadline = time.monotonic() + 60.0
    while not os.path.exists(os.path.join(tmp, LOST_AT)) and time.monotonic() < deadline:
        time.sleep(0.005)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        _worker(*sys.argv[2:])
    else:
        sys.exit("usage: python -m tdist.bench --recovery (this module is its worker)")
