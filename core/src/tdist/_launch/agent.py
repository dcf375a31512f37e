"""tdistrun's elastic agent: torch's ``LocalElasticAgent`` (rendezvous, whole-group
restarts, exit barrier, events) starting its workers as :class:`WorkerProcesses`.

Beyond torchrun's variables, each worker gets (see ``docs/pages/guide/launch.md``):

- ``TDIST_STORE_PREFIX``: where this round's workers keep their keys in the agent's
  store. The agent store outlives a restart, so the keys of a failed attempt are still
  there; a fresh prefix per round, chosen by the agent of group rank 0 and read by the
  others, keeps the next attempt from reading them. (torchrun's own
  ``TORCHELASTIC_RESTART_COUNT`` can differ between nodes after a restart: a node that
  restarts because another one re-joined does not count it.)
- with ``TDIST_STORE_TOKEN`` set, ``TDIST_STORE_ADDR``/``TDIST_STORE_PORT``: an
  authenticated tdist TCPStore that the agent of group rank 0 has listened on since it
  started (torch's agent store cannot authenticate). ``env://`` prefers it.
- with an ``error_dir``, ``TDIST_ERROR_FILE``: where the worker's uncaught exception is
  recorded (:mod:`tdist._errorfile`; a fresh file per worker and start), so that the
  launcher names the rank that failed first on its own.
"""

from __future__ import annotations

import json
import os
import uuid
from string import Template
from typing import Any, Callable, Optional

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.utils import macros
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port

from .._errorfile import ENV as ERROR_FILE_ENV
from .._errorfile import Failure
from .._store import TCPStoreServer
from .processes import WorkerProcesses

__all__ = ["TdistAgent", "create_agent", "run_agent", "ROUND_KEY", "DEFAULT_PREFIX_TEMPLATE"]

#: The agent-store key under which the agent of group rank 0 publishes what the workers
#: of a round share (static rendezvous: one key per restart, its store outlives rounds).
ROUND_KEY = "tdist/round"
#: A worker's console lines start with this (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``
#: replaces it, with torchrun's ``${rank}``, ``${local_rank}``, ``${role_name}``).
DEFAULT_PREFIX_TEMPLATE = "[rank ${rank}] "


class TdistAgent(LocalElasticAgent):
    """``LocalElasticAgent`` whose workers are :class:`WorkerProcesses` (prefixed live
    output, process-group cleanup, failures named by rank); everything else, rendezvous
    and restarts included, is torch's.

    ``grace_period``: seconds between the first signal and SIGKILL on every stop.
    ``prefix_template``: the console prefix of each line (None: no prefix).
    ``tdist_store``: the authenticated store this agent hosts (token mode), else None.
    ``log``: receives the launcher's messages. ``extra_env``: more variables for every
    worker (``--debug-dump``'s). ``error_dir``: a directory only this user can enter, where
    the workers record their uncaught exceptions (None: they do not).
    ``tolerate_failures``: how many worker failures the job survives (the program shrinks
    its groups); ``replace_failed``: start a replacement for each (it joins the job).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        config: LaunchConfig,
        *,
        grace_period: float,
        prefix_template: Optional[str],
        tdist_store: Optional[TCPStoreServer],
        log: Callable[[str], None],
        extra_env: Optional[dict[str, str]] = None,
        error_dir: Optional[str] = None,
        tolerate_failures: int = 0,
        replace_failed: bool = False,
    ) -> None:
        super().__init__(
            spec,
            logs_specs=config.logs_specs,  # type: ignore[arg-type]
            start_method=config.start_method,
            log_line_prefix_template=prefix_template,
            shutdown_timeout=max(1, int(grace_period + 0.999)),
        )
        self.grace_period = grace_period
        self.tdist_store = tdist_store
        self.log = log
        self.extra_env = dict(extra_env or {})
        self.error_dir = error_dir
        self.tolerate_failures = tolerate_failures
        self.replace_failed = replace_failed
        self._starts = 0  # worker group starts so far (restarts that are not counted too)

    # ------------------------------------------------------------------ starting
    def _share_round(self, worker_group: WorkerGroup, restart_count: int) -> dict[str, Any]:
        """What every worker of this round must agree on, published by the agent of group rank 0."""
        static = worker_group.spec.rdzv_handler.get_backend() == "static"
        key = f"{ROUND_KEY}/{restart_count}" if static else ROUND_KEY
        store: Any = worker_group.store  # set by the agent before workers start
        if worker_group.group_rank == 0:
            shared: dict[str, Any] = {"prefix": f"tdist/{uuid.uuid4().hex}"}
            if self.tdist_store is not None:  # listening on every interface: reachable where MASTER_ADDR is
                host = self.tdist_store.host
                shared.update(
                    addr=host if host not in ("", "0.0.0.0", "::") else worker_group.master_addr,
                    port=self.tdist_store.port,
                )
            store.set(key, json.dumps(shared))
        return json.loads(store.get(key))

    def _worker_env(
        self, worker_group: WorkerGroup, worker: Any, restart_count: int, shared: dict[str, Any]
    ) -> dict[str, str]:
        """The variables torchrun's LocalElasticAgent sets, and tdist's."""
        spec = worker_group.spec
        env: dict[str, Any] = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(worker_group.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(worker_group.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": worker_group.master_addr,
            "MASTER_PORT": str(worker_group.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", str(1)),
            "TDIST_STORE_PREFIX": shared["prefix"],
        }
        self._set_local_rank_env(env, worker.local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        if self._log_line_prefix_template is not None:
            env["PYTHONUNBUFFERED"] = "1"  # lines go through our pipes: let them come as they are printed
        if "port" in shared:
            env.update(TDIST_STORE_ADDR=shared["addr"], TDIST_STORE_PORT=str(shared["port"]))
        if self.error_dir is not None:
            env[ERROR_FILE_ENV] = os.path.join(self.error_dir, f"start{self._starts}-rank{worker.global_rank}.json")
        env.update(self.extra_env)
        return env

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        restart_count = spec.max_restarts - self._remaining_restarts
        shared = self._share_round(worker_group, restart_count)
        self._starts += 1
        envs: dict[int, dict[str, str]] = {}
        args: dict[int, tuple] = {}
        template = self._log_line_prefix_template
        prefixes: Optional[dict[int, str]] = None if template is None else {}
        for worker in worker_group.workers:
            envs[worker.local_rank] = self._worker_env(worker_group, worker, restart_count, shared)
            args[worker.local_rank] = tuple(macros.substitute(list(spec.args), str(worker.local_rank)))
            if prefixes is not None and template is not None:
                prefixes[worker.local_rank] = Template(template).safe_substitute(
                    role_name=spec.role, rank=worker.global_rank, local_rank=worker.local_rank
                )
        self._setup_local_watchdog(envs=envs)
        self._setup_healthcheck()
        if not isinstance(spec.entrypoint, str):
            raise TypeError("tdistrun starts workers from a command line, not a Python function")
        self._pcontext = WorkerProcesses(
            spec.role,
            spec.entrypoint,
            args,
            envs,
            self._logs_specs,
            prefixes,
            grace_period=self.grace_period,
            log=self.log,
            numa_options=spec.numa_options,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            tolerate_failures=self.tolerate_failures,
            replace_failed=self.replace_failed,
        )
        self._pcontext.start()
        return self._pcontext.pids()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's check, after giving a replaced worker (``--replace-failed``) its new pid."""
        pcontext = self._pcontext
        if isinstance(pcontext, WorkerProcesses) and pcontext.tolerated:
            pids = pcontext.pids()
            for worker in worker_group.workers:
                worker.id = pids.get(worker.local_rank, worker.id)
        return super()._monitor_workers(worker_group)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            done = spec.max_restarts - self._remaining_restarts
            self.log(f"restarting the worker group (restart {done} of {spec.max_restarts})")
        else:
            self.log("nodes are waiting to join: restarting the worker group with them (not counted as a restart)")
        super()._restart_workers(worker_group)

    # ------------------------------------------------------------------ outcome
    def first_failure(self) -> Optional[tuple[int, ProcessFailure]]:
        """(global rank, failure) of the first worker of the last attempt that failed on its own."""
        pcontext = self._pcontext
        if not isinstance(pcontext, WorkerProcesses) or pcontext.first_failure is None:
            return None
        return pcontext.rank_of(pcontext.first_failure.local_rank), pcontext.first_failure

    def failures(self) -> list[Failure]:
        """The workers of the last attempt that failed on their own, earliest first."""
        pcontext = self._pcontext
        return pcontext.failures() if isinstance(pcontext, WorkerProcesses) else []

    @property
    def restarts_done(self) -> int:
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    @property
    def signalled(self) -> int:
        """How many running workers the last stop signalled."""
        return self._pcontext.signalled if isinstance(self._pcontext, WorkerProcesses) else 0

    def kill_all(self) -> None:
        """SIGKILL every worker's process group now."""
        if isinstance(self._pcontext, WorkerProcesses):
            self._pcontext.kill_all()


def create_agent(
    config: LaunchConfig,
    entrypoint: str,
    args: list[str],
    *,
    grace_period: float,
    prefix_template: Optional[str],
    tdist_store: Optional[TCPStoreServer],
    log: Callable[[str], None],
    extra_env: Optional[dict[str, str]] = None,
    error_dir: Optional[str] = None,
    tolerate_failures: int = 0,
    replace_failed: bool = False,
) -> TdistAgent:
    """The agent for ``config`` (as torch's ``launch_agent`` builds its LocalElasticAgent).
    Creating a c10d rendezvous handler connects to (or hosts) its store."""
    rdzv_parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(rdzv_parameters)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv_parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    return TdistAgent(
        spec,
        config,
        grace_period=grace_period,
        prefix_template=prefix_template,
        tdist_store=tdist_store,
        log=log,
        extra_env=extra_env,
        error_dir=error_dir,
        tolerate_failures=tolerate_failures,
        replace_failed=replace_failed,
    )


def run_agent(agent: TdistAgent, config: LaunchConfig) -> RunResult:
    """Run ``agent`` to the end, with torch's ``launch_agent`` bookkeeping (metrics, events,
    closing the rendezvous unless the launcher was signalled, so other nodes may go on)."""
    shutdown_rdzv = True
    rdzv_handler = agent.get_worker_group().spec.rdzv_handler
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        return result
    except SignalException:
        shutdown_rdzv = False
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            rdzv_handler.shutdown()
