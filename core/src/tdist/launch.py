r"""``tdistrun`` and ``python -m tdist.launch``: start the workers of a training script
on each node, with torchrun's options and semantics.

``tdistrun`` is ``torchrun`` (``torch.distributed.run``) built on the same
``torch.distributed.elastic`` agent: every torchrun option is accepted with torchrun's
meaning and default (``--nnodes MIN:MAX``, ``--standalone``, ``--rdzv-backend/-endpoint/-id/-conf``,
``--max-restarts``, ``--nproc-per-node auto``, ``--log-dir``, ``--redirects``, ``--tee``,
``--local-ranks-filter``, ``--role``, ``--run-path``, ``-m``, ``--no-python``, ...; also
from ``PET_*`` variables), and every worker gets the variables torchrun sets::

    tdistrun --nproc-per-node=4 train.py --backend tcp     # one node: a private c10d store
    tdistrun --standalone --nproc-per-node=auto train.py   # the same, one worker per CPU/GPU
    tdistrun --nproc-per-node=4 --max-restarts=3 train.py  # restart the whole group on failure

    # two nodes (run on each, with its --node-rank):
    tdistrun --nproc-per-node=4 --nnodes=2 --node-rank=0 \
        --master-addr=192.168.1.1 --master-port=29500 train.py

    # elastic: 1 to 4 nodes join one c10d rendezvous (run the same line on each node)
    tdistrun --nproc-per-node=4 --nnodes=1:4 --rdzv-backend=c10d \
        --rdzv-endpoint=192.168.1.1:29400 --rdzv-id=job42 train.py

``python -m tdist.launch`` is ``torch.distributed.launch``: the same launcher, which also
passes ``--local_rank=N`` to the script (the spelling of torch.distributed's 2017 launcher, unlike torch 2.x's
``--local-rank``) unless ``--use_env`` is given. ``--local-rank-arg local-rank`` passes
torch 2.x's ``--local-rank=N`` instead, with either launcher (``tdistrun`` passes no
argument unless asked, as torchrun). Accept both spellings in a script::

    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)

The workers' environment: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_NAME``, ``ROLE_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` (the agent's store), ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_USE_AGENT_STORE``,
``TORCHELASTIC_ERROR_FILE``, ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``OMP_NUM_THREADS=1``
with several workers (unless set), as torchrun sets them; and tdist's
``TDIST_STORE_PREFIX`` (the keys of this attempt in the agent's store) and
``TDIST_ERROR_FILE`` (where the worker records the exception that ends it), plus, with
``TDIST_STORE_TOKEN`` set, ``TDIST_STORE_ADDR``/``TDIST_STORE_PORT`` (below).
``tdist.init_process_group`` (``env://``) joins the agent's store as a client: the
store listens from the moment the agent starts to its end, so no port is ever free
for another process to take in between (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``,
which makes torchrun leave such a port free, is ignored).

Restarts: when a worker fails, every worker of the node is stopped (SIGTERM, SIGKILL
after the grace period) and, while restarts are left (``--max-restarts``, default 0),
the agents rendezvous again and start a fresh group; ``TORCHELASTIC_RESTART_COUNT``
says which attempt a worker belongs to. With no restarts left, the launcher names the
root cause -- the worker that failed first on its own (each worker records the exception
that ends it in ``TDIST_ERROR_FILE``: see :mod:`tdist._errorfile`), with the end of its
traceback, and the ranks that failed because it did -- and exits with its exit status.

Beyond torchrun:

- each output line of a worker reaches the console live, prefixed with its rank
  (``[rank 2] ...``; ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` changes it), tee'd and
  redirected streams included; ``--no-prefix`` lets workers write to the launcher's
  streams directly, with Python's usual buffering;
- every worker runs in its own session: stopping waits for everything the workers
  started, then SIGKILLs what is left; nothing outlives the launcher (on Linux the
  workers also die if the launcher is killed with SIGKILL);
- ``--grace-period`` (default 5 s; torchrun's ``--shutdown-timeout`` too) applies to
  every stop, not only to signals;
- signals in ``--signals-to-handle`` are forwarded to the workers and the launcher
  exits with ``128 + signal``; a second one SIGKILLs the workers at once;
- without ``--log-dir``, the log directory (error files) is removed at the end unless
  streams were redirected to it;
- with ``TDIST_STORE_TOKEN`` set, each agent also hosts an authenticated tdist store on
  a port it holds from its start; the workers get the address of group rank 0's store
  in ``TDIST_STORE_ADDR``/``TDIST_STORE_PORT``, which ``env://`` prefers to the agent
  store (torch's TCPStore cannot authenticate). torch programs keep using the agent
  store through ``MASTER_ADDR``/``MASTER_PORT``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._launch.workers import describe_status, exit_status, write_locked

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

__all__ = [
    "main",
    "launch_module_main",
    "launch",
    "parse_args",
    "get_args_parser",
    "launch_config",
    "DEFAULT_MASTER_PORT",
    "DEFAULT_GRACE_PERIOD",
]

#: torchrun's port for a static rendezvous when none is given.
DEFAULT_MASTER_PORT = 29500
#: Seconds between SIGTERM (or the forwarded signal) and SIGKILL when stopping workers.
DEFAULT_GRACE_PERIOD = 5.0
PROG = "tdistrun"
LAUNCH_MODULE_PROG = "python -m tdist.launch"
_RUN_PATH = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def log(message: str) -> None:
    """One line of the launcher's own, on stderr, never inside a worker's line."""
    try:
        write_locked(sys.stderr, f"tdistrun: {message}\n".encode())
    except (OSError, ValueError):
        pass


def get_args_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """torchrun's parser (``torch.distributed.run.get_args_parser``) with tdistrun's options."""
    from torch.distributed.run import get_args_parser as torchrun_parser

    parser = torchrun_parser()
    parser.prog = prog
    parser.description = "Start the workers of a training script on this node, as torchrun does (tdist's launcher)."
    parser.epilog = (
        "Workers get torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, "
        "TORCHELASTIC_*, ...). See tdist's docs: guide/launch."
    )
    parser.add_argument(
        "--use-env",
        "--use_env",
        dest="use_env",
        action="store_true",
        help="do not pass --local_rank to the script (python -m tdist.launch; tdistrun never passes "
        "it unless --local-rank-arg is given)",
    )
    parser.add_argument(
        "--local-rank-arg",
        "--local_rank_arg",
        dest="local_rank_arg",
        default=None,
        choices=("local_rank", "local-rank"),
        help="pass --local_rank=N (python -m tdist.launch's default) or torch 2.x's --local-rank=N to the script",
    )
    parser.add_argument(
        "--no-prefix",
        "--no_prefix",
        dest="no_prefix",
        action="store_true",
        help="do not prefix each output line with '[rank N] ' (workers write to the launcher's "
        "stdout and stderr directly)",
    )
    parser.add_argument(
        "--grace-period",
        "--grace_period",
        dest="grace_period",
        type=float,
        default=None,
        help="seconds between SIGTERM (or a forwarded signal) and SIGKILL when stopping workers "
        "(default: --shutdown-timeout, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, "
        f"else {DEFAULT_GRACE_PERIOD:g})",
    )
    parser.add_argument(
        "--tolerate-failures",
        "--tolerate_failures",
        dest="tolerate_failures",
        type=int,
        default=0,
        metavar="N",
        help="the job survives up to N worker failures (a program that shrinks its groups, "
        "tdist.shrink_group): the other workers go on; more is a job failure as usual (default 0)",
    )
    parser.add_argument(
        "--replace-failed",
        "--replace_failed",
        dest="replace_failed",
        action="store_true",
        help="with --tolerate-failures: start a replacement for each tolerated failure, with "
        "TDIST_REPLACEMENT=<its rank> (tdist.replaced_rank()); it joins the running job "
        "(tdist.join_process_group) when the others call tdist.grow_group",
    )
    parser.add_argument(
        "--debug-dump",
        "--debug_dump",
        dest="debug_dump",
        default=None,
        metavar="DIR",
        help="turn tdist-debug's flight recorder on in every worker (dumps to DIR on failure, "
        "timeout, SIGUSR1 and exit) and print its analysis when the job fails",
    )
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, launch_module: bool) -> None:
    """Reject bad options before anything starts (exit status 2, as argparse)."""
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.run import parse_min_max_nnodes

    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        parser.error(f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}")
    if not 0 < min_nodes <= max_nodes:
        parser.error(f"--nnodes {args.nnodes}: need 0 < MIN <= MAX")
    if str(args.nproc_per_node).isdigit() and int(args.nproc_per_node) < 1:
        parser.error(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
    if args.rdzv_backend == "static" and not args.standalone and not 0 <= args.node_rank < max_nodes:
        parser.error(f"--node_rank {args.node_rank} is out of range for --nnodes {args.nnodes} (0..{max_nodes - 1})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master_port must be in 1..65535, got {args.master_port}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must not be negative, got {args.max_restarts}")
    if args.tolerate_failures < 0:
        parser.error(f"--tolerate-failures must not be negative, got {args.tolerate_failures}")
    if args.replace_failed and not args.tolerate_failures:
        parser.error("--replace-failed needs --tolerate-failures N (N >= 1)")
    for name in ("grace_period", "shutdown_timeout"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    for name in ("redirects", "tee"):
        try:
            Std.from_str(getattr(args, name))
        except ValueError:
            parser.error(
                f"--{name} {getattr(args, name)!r}: expected 0-3 (1 stdout, 2 stderr, 3 both) "
                "or local_rank:value pairs such as 0:3,1:1"
            )
    if args.local_ranks_filter:
        try:
            {int(r) for r in args.local_ranks_filter.split(",")}
        except ValueError:
            parser.error(
                f"--local-ranks-filter must be local ranks separated by commas (0,1,2), got {args.local_ranks_filter!r}"
            )
    if args.no_python and args.module:
        parser.error("--no_python and --module cannot be used together")
    if args.use_env and args.local_rank_arg:
        parser.error("--use_env and --local-rank-arg contradict each other")
    if args.debug_dump is not None:
        from ._launch.debug import missing_reason

        reason = missing_reason()
        if reason:
            parser.error(reason)
    if launch_module and args.no_python and not args.use_env and not args.local_rank_arg:
        parser.error("--no_python requires --use_env (a program that is not Python gets LOCAL_RANK, not --local_rank)")


def parse_args(argv: Optional[Sequence[str]] = None, *, launch_module: bool = False) -> argparse.Namespace:
    """Parse and check the launcher's command line (``sys.argv[1:]`` by default).

    ``launch_module``: as ``python -m tdist.launch`` (which passes ``--local_rank=N``
    unless ``--use_env``) rather than ``tdistrun``. ``args.local_rank_arg`` is then the
    spelling of the argument the script gets, or None.
    """
    parser = get_args_parser(LAUNCH_MODULE_PROG if launch_module else PROG)
    args = parser.parse_args(argv)
    _check(parser, args, launch_module)
    if launch_module and not args.use_env and args.local_rank_arg is None:
        args.local_rank_arg = "local_rank"
    return args


def _grace_period(args: argparse.Namespace) -> float:
    if args.grace_period is not None:
        return float(args.grace_period)
    if args.shutdown_timeout is not None:
        return float(args.shutdown_timeout)
    return float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", DEFAULT_GRACE_PERIOD))


def _worker_command(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The workers' program and arguments, as torchrun builds them (``${local_rank}`` is
    replaced per worker)."""
    local_rank = [f"--{args.local_rank_arg}=${{local_rank}}"] if args.local_rank_arg else []
    python = os.getenv("PYTHON_EXEC", sys.executable)
    unbuffered = [] if args.no_prefix else ["-u"]
    if args.run_path:
        return python, [*unbuffered, "-c", _RUN_PATH, args.training_script, *local_rank, *args.training_script_args]
    if args.no_python:
        return args.training_script, [*local_rank, *args.training_script_args]
    module = ["-m"] if args.module else []
    return python, [*unbuffered, *module, args.training_script, *local_rank, *args.training_script_args]


def launch_config(args: argparse.Namespace) -> tuple["LaunchConfig", str, list[str]]:
    """torchrun's ``LaunchConfig`` for ``args`` (``torch.distributed.run.config_from_args``,
    after torchrun's choice of rendezvous: ``--standalone``, or one node without a
    ``--master-port``, is a c10d rendezvous on a port the agent binds itself), and the
    workers' program and arguments."""
    from torch.distributed.run import config_from_args, determine_local_world_size, parse_min_max_nnodes

    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and parse_min_max_nnodes(args.nnodes)[1] == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = DEFAULT_MASTER_PORT
    args.nproc_per_node = str(determine_local_world_size(args.nproc_per_node))
    if int(args.nproc_per_node) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun (which also prints a banner about it)
    use_env = getattr(args, "use_env", False)
    args.use_env = True  # config_from_args' own command is not used
    try:
        config, _, _ = config_from_args(args)
    finally:
        args.use_env = use_env
    program, program_args = _worker_command(args)
    return config, program, program_args


def _host_tdist_store(config: "LaunchConfig") -> Any:
    """Token mode: an authenticated tdist store, listening from now to the launcher's end
    (on the loopback interface when the job has one node)."""
    from ._store import TCPStoreServer

    host = "127.0.0.1" if config.max_nodes == 1 else (config.local_addr or "")
    return TCPStoreServer(host, 0).start()


def _signal_handlers(names: str) -> dict[int, Any]:
    """The current handlers of the signals in ``names`` (torch's process context replaces
    them when the workers start, with handlers that raise SignalException for the agent
    to forward; before that, a signal has its usual effect, as in torchrun: a handler
    would not run while torch's C++ rendezvous code blocks)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    signums = (getattr(signal, name.strip(), None) for name in names.split(","))
    return {s: signal.getsignal(s) for s in signums if isinstance(s, signal.Signals)}


#: Lines of the root cause's traceback the launcher prints.
TRACEBACK_LINES = 8


def _report(agent: Any, result: Any) -> int:
    """The launcher's exit status for the agent's ``result``, with the root cause when it
    failed: the earliest failure that is not the consequence of another rank's (by the
    workers' error records; else the first seen), its traceback's last lines, and how
    each other failed worker followed."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    from ._errorfile import root_cause

    if result.state == WorkerState.SUCCEEDED:
        return 0
    after = f" after {agent.restarts_done} restart(s)" if agent.restarts_done else ""
    failures = agent.failures()
    root = root_cause(failures)
    if root is None or root.exitcode is None:
        log(f"the worker group ended {result.state.name}{after}")
        return 1
    headline = f": {root.headline}" if root.headline else ""
    code = root.exitcode
    status = f" with {describe_status(code)}"
    if root.stopped and root.record is not None:  # it raised, and was still exiting when the others were stopped
        status, headline, code = "", f"{headline} (it was still exiting when the launcher stopped it)", 1
    if not root.consequence:
        log(f"root cause: rank {root.rank} failed{status}{after}{headline}")
    else:  # every failure here followed another rank's (one on another node, or one that recorded nothing)
        cause = f"rank {root.peer}" if root.peer is not None else "another rank"
        log(f"rank {root.rank} failed first here{status}{after}, because {cause} failed{headline}")
    for line in root.traceback_tail(TRACEBACK_LINES):
        log(f"  {line}")
    for other in failures:
        if other is root:
            continue
        what = f": {other.headline}" if other.headline else f" ({describe_status(other.exitcode or 0)})"
        if other.consequence:
            if not root.consequence:
                cause = f"rank {root.rank}"
            else:
                cause = f"rank {other.peer}" if other.peer is not None else "another rank"
            log(f"rank {other.rank} failed because {cause} did{what}")
        else:
            log(f"rank {other.rank} failed too, after rank {root.rank}{what}")
    return exit_status(code)


def launch(args: argparse.Namespace) -> int:
    """Run this node's agent and its workers as ``args`` say; return the exit status.

    While workers run, the signals of ``--signals-to-handle`` are forwarded to them
    (torch's process context installs the handlers); the previous handlers are
    restored at the end (when called from the main thread).
    """
    from torch.distributed.elastic.multiprocessing import SignalException

    from ._launch.agent import DEFAULT_PREFIX_TEMPLATE, create_agent, run_agent
    from ._store.tcp_store import TOKEN_ENV

    if os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
        log(
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is ignored: the workers join the agent's store, which listens "
            "from the agent's start (torchrun would pick a free port and leave it free until rank 0 binds it)"
        )
    own_log_dir = None
    if args.log_dir is None:
        own_log_dir = args.log_dir = tempfile.mkdtemp(prefix="tdistrun-")
    error_dir = tempfile.mkdtemp(prefix="tdistrun-errors-")  # mode 0700: the workers' error records
    previous = _signal_handlers(args.signals_to_handle)
    tdist_store = agent = None
    try:
        config, program, program_args = launch_config(args)
        if os.environ.get(TOKEN_ENV):
            tdist_store = _host_tdist_store(config)
        template = (
            None if args.no_prefix else os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", DEFAULT_PREFIX_TEMPLATE)
        )
        extra_env = {}
        if args.debug_dump is not None:
            from ._launch import debug

            debug.clear_old_dumps(args.debug_dump)
            extra_env = debug.worker_env(args.debug_dump)
        agent = create_agent(
            config,
            program,
            program_args,
            grace_period=_grace_period(args),
            prefix_template=template,
            tdist_store=tdist_store,
            log=log,
            extra_env=extra_env,
            error_dir=error_dir,
            tolerate_failures=args.tolerate_failures,
            replace_failed=args.replace_failed,
        )
        status = _report(agent, run_agent(agent, config))
        if status and args.debug_dump is not None:
            debug.verdict(args.debug_dump, log)
        return status
    except SignalException as exc:  # forwarded by the agent; a second one ends up here at once
        if agent is not None:
            agent.kill_all()
        log(f"received {exc.sigval.name}; forwarded it to {agent.signalled if agent else 0} running worker(s)")
        if agent is not None and args.debug_dump is not None:
            from ._launch.debug import verdict

            verdict(args.debug_dump, log)
        return 128 + int(exc.sigval)
    except KeyboardInterrupt:  # SIGINT before the workers started
        log("interrupted before the workers started")
        return 128 + int(signal.SIGINT)
    except Exception as exc:  # rendezvous, store or start failures: one line, not a traceback
        if agent is not None:
            agent.kill_all()
        log(f"{type(exc).__name__}: {exc}")
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if tdist_store is not None:
            tdist_store.stop()
        shutil.rmtree(error_dir, ignore_errors=True)
        if own_log_dir is not None:
            if args.redirects == "0" and args.tee == "0":
                shutil.rmtree(own_log_dir, ignore_errors=True)
            else:
                log(f"worker logs are in {own_log_dir}")


def _main(argv: Optional[Sequence[str]], launch_module: bool) -> int:
    try:
        import torch.distributed.elastic  # noqa: F401
    except ImportError as exc:
        print(f"tdistrun: needs torch (torch.distributed.elastic runs the workers): {exc}", file=sys.stderr)
        return 1
    return launch(parse_args(argv, launch_module=launch_module))


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``tdistrun`` (torchrun's semantics)."""
    return _main(argv, launch_module=False)


def launch_module_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m tdist.launch`` (passes ``--local_rank=N`` unless ``--use_env``)."""
    return _main(argv, launch_module=True)


if __name__ == "__main__":
    sys.exit(launch_module_main())
