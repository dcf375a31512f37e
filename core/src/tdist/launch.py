r"""``tdist.launch``: start several processes of a training script on each node.

A drop-in for ``torch.distributed.launch``, run as ``python -m tdist.launch`` or
``tdistrun``::

    tdistrun --nproc_per_node=4 train.py --backend tcp      # one node, free port picked

    # two nodes (run on each, with its --node_rank):
    tdistrun --nproc_per_node=4 --nnodes=2 --node_rank=0 \
        --master_addr=192.168.1.1 --master_port=1234 train.py --backend tcp

Every worker gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK`` (the node rank), ``MASTER_ADDR`` and ``MASTER_PORT``, so the script
calls ``tdist.init_process_group(backend)`` (``env://``). The script also
receives ``--local_rank=N`` as its first argument, unless ``--use_env`` is given
(then it reads ``os.environ["LOCAL_RANK"]``). Accept both spellings in the script::

    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)

Beyond ``torch.distributed.launch``:

- with ``--nnodes=1`` and no ``--master_port``, a free port is picked;
- each output line of a worker is prefixed with its rank (``[rank 2] ...``, on
  stdout and stderr), live (``PYTHONUNBUFFERED=1``); ``--no_prefix`` turns that
  off: workers then write to the launcher's streams directly, with Python's
  usual buffering (set ``PYTHONUNBUFFERED=1`` yourself for live output);
- when a worker exits with a non-zero status, the others get SIGTERM, then
  SIGKILL after ``--grace_period`` seconds, and the launcher exits with the
  failed worker's status, naming its rank;
- SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to the workers, with the
  same grace period; each worker runs in its own session, and everything in
  those sessions is gone when the launcher returns (on Linux the workers also
  die if the launcher itself is killed with SIGKILL).

Options use underscores as in ``torch.distributed.launch``; the dashed spellings
(``--nproc-per-node``, ...) are accepted too.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Optional, Sequence

from ._launch.workers import WorkerGroup, WorkerSpec, free_port

__all__ = ["main", "launch", "parse_args", "get_args_parser", "worker_specs", "DEFAULT_MASTER_PORT"]

#: The port used when several nodes take part and none is given (torch's default).
DEFAULT_MASTER_PORT = 29500
_FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def _both(name: str) -> list[str]:
    """``--nproc_per_node`` and ``--nproc-per-node``."""
    spellings = [f"--{name}"]
    if "_" in name:
        spellings.append(f"--{name.replace('_', '-')}")
    return spellings


def get_args_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tdistrun",
        description="Start several processes of a tdist (torch.distributed) training script on each node.",
        epilog="Every worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, "
        "MASTER_PORT in its environment, and --local_rank=N as first argument unless --use_env is given.",
        allow_abbrev=False,
    )
    parser.add_argument("--nnodes", type=int, default=1, help="number of nodes (default: 1)")
    parser.add_argument(*_both("node_rank"), dest="node_rank", type=int, default=0,
                        help="rank of this node, 0..nnodes-1 (default: 0)")
    parser.add_argument(*_both("nproc_per_node"), dest="nproc_per_node", type=int, default=1,
                        help="number of processes to start on this node (default: 1)")
    parser.add_argument(*_both("master_addr"), dest="master_addr", default="127.0.0.1",
                        help="address of the node of rank 0 (default: 127.0.0.1)")
    parser.add_argument(*_both("master_port"), dest="master_port", type=int, default=None,
                        help="free port on the node of rank 0 (default: a free port when --nnodes=1, "
                        f"else {DEFAULT_MASTER_PORT})")
    parser.add_argument(*_both("use_env"), dest="use_env", action="store_true",
                        help="do not pass --local_rank; the script reads LOCAL_RANK from the environment")
    parser.add_argument("-m", "--module", action="store_true",
                        help="run the script as a module, like 'python -m'")
    parser.add_argument(*_both("no_python"), dest="no_python", action="store_true",
                        help="run the script as an executable, not through the Python interpreter "
                        "(requires --use_env)")
    parser.add_argument(*_both("no_prefix"), dest="no_prefix", action="store_true",
                        help="do not prefix each output line with '[rank N] ' (workers write to the "
                        "launcher's stdout and stderr directly)")
    parser.add_argument(*_both("grace_period"), dest="grace_period", type=float, default=5.0,
                        help="seconds between SIGTERM and SIGKILL when stopping workers (default: 5)")
    parser.add_argument("training_script", help="the script (or module with -m) to run, then its arguments")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the launcher's command line (``sys.argv[1:]`` by default)."""
    parser = get_args_parser()
    args = parser.parse_args(argv)
    if args.nnodes < 1:
        parser.error(f"--nnodes must be at least 1, got {args.nnodes}")
    if args.nproc_per_node < 1:
        parser.error(f"--nproc_per_node must be at least 1, got {args.nproc_per_node}")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"--node_rank {args.node_rank} is out of range for --nnodes {args.nnodes} (0..{args.nnodes - 1})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.grace_period < 0:
        parser.error(f"--grace_period must not be negative, got {args.grace_period}")
    if args.no_python and args.module:
        parser.error("--no_python and --module cannot be used together")
    if args.no_python and not args.use_env:
        parser.error("--no_python requires --use_env (a program that is not Python gets LOCAL_RANK, not --local_rank)")
    return args


def worker_specs(args: argparse.Namespace, environ: Optional[dict[str, str]] = None) -> list[WorkerSpec]:
    """The command and environment of each worker of this node.

    ``args.master_port`` must be set (see :func:`launch`).
    """
    base = dict(os.environ if environ is None else environ)
    world_size = args.nnodes * args.nproc_per_node
    base.update(
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(args.nproc_per_node),
        GROUP_RANK=str(args.node_rank),
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port),
    )
    if not args.no_prefix:
        # Line by line through the pipes. Not with --no_prefix, where workers share
        # the launcher's streams: unbuffered, one print() is several writes that
        # interleave with the other workers' (torch's launcher runs "python -u").
        base["PYTHONUNBUFFERED"] = "1"
    if args.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
        base["OMP_NUM_THREADS"] = "1"  # as torch.distributed.launch: don't oversubscribe the cores
    specs = []
    for local_rank in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local_rank
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(local_rank))
        if args.no_python:
            cmd = [args.training_script]
        elif args.module:
            cmd = [sys.executable, "-m", args.training_script]
        else:
            cmd = [sys.executable, args.training_script]
        if not args.use_env:
            cmd.append(f"--local_rank={local_rank}")
        cmd.extend(args.training_script_args)
        specs.append(WorkerSpec(rank=rank, local_rank=local_rank, cmd=cmd, env=env))
    return specs


def launch(args: argparse.Namespace) -> int:
    """Run the workers of this node described by ``args``; return the exit status.

    Installs handlers for SIGINT, SIGTERM and SIGHUP while the workers run
    (when called from the main thread) and restores the previous ones after.
    """
    if args.master_port is None:
        args.master_port = free_port("") if args.nnodes == 1 else DEFAULT_MASTER_PORT
    group = WorkerGroup(worker_specs(args), prefix=not args.no_prefix, grace_period=args.grace_period)
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for name in _FORWARDED_SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:
                previous[signum] = signal.signal(signum, group.on_signal)
    try:
        group.start()
        return group.run()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``tdistrun`` and ``python -m tdist.launch``."""
    try:
        return launch(parse_args(argv))
    except OSError as exc:  # e.g. the script's interpreter cannot be started
        print(f"tdistrun: cannot start the workers: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
