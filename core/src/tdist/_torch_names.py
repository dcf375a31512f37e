"""torch.distributed's remaining public names, so that ``import tdist as dist`` runs
programs that use them.

Three kinds:

- tdist's own implementation, working with or without the torch bridge:
  :func:`breakpoint` and torch's private but widely used :func:`_coalescing_manager`;
- torch's own objects (:data:`FROM_TORCH`, and every subpackage of torch.distributed),
  looked up on first use: subpackages (``rpc``, ``algorithms``, ``device_mesh``, ...), the ``*Options``
  classes, the debug levels, ``DeviceMesh``/``init_device_mesh``. They work on tdist's
  groups where the bridge has attached (torch's default group is then tdist's);
- :data:`NOT_PROVIDED`: names tdist does not offer, each with the reason.
"""

from __future__ import annotations

import contextlib
import pdb
import sys
from datetime import timedelta
from typing import Any, Iterator, Optional

from ._dispatch import coalescing
from ._groups import resolve_group
from ._work import Work

__all__ = ["FROM_TORCH", "NOT_PROVIDED", "breakpoint", "from_torch", "torch_names_here"]

#: torch.distributed's names that are torch's own objects in tdist too.
FROM_TORCH = frozenset(
    {
        # subpackages and modules
        "algorithms",
        "autograd",
        "c10d_logger",
        "config",
        "constants",
        "device_mesh",
        "distributed_c10d",
        "logging_handlers",
        "remote_device",
        "rpc",
        "utils",
        # device meshes, DDP's C++ parts, options and configuration
        "DeviceMesh",
        "init_device_mesh",
        "GradBucket",
        "Reducer",
        "Logger",
        "BuiltinCommHookType",
        "AllToAllOptions",
        "AllreduceCoalescedOptions",
        "AllreduceOptions",
        "BarrierOptions",
        "BroadcastOptions",
        "GatherOptions",
        "ReduceOptions",
        "ReduceScatterOptions",
        "ScatterOptions",
        "BackendConfig",
        "get_backend_config",
        "GroupName",
        "RankType",
        "ProcessGroupGloo",
        "ProcessGroupNCCL",  # these three: torch's CUDA builds only
        "ProcessGroupNCCL2",
        "ProcessGroupNCCLLazy",
        "is_ucc_available",
        "is_xccl_available",
        "record_comm",
        # debug levels (TORCH_DISTRIBUTED_DEBUG)
        "DebugLevel",
        "get_debug_level",
        "set_debug_level",
        "set_debug_level_from_env",
    }
)

#: torch.distributed's public names tdist does not offer, and why.
NOT_PROVIDED = {
    "register_rendezvous_handler": "torch's rendezvous registry; tdist's init methods are plugins "
    "(entry point group 'tdist', hook tdist_register_rendezvous)",
    # imports inside torch/distributed/__init__.py that leak into its namespace, not API
    **{
        name: "a module torch.distributed imports, not its API"
        for name in ("contextlib", "log", "logging", "sys", "torch")
    },
    **{name: "a name torch.distributed imports, not its API" for name in ("timedelta", "traceback", "typing")},
}


def from_torch(name: str) -> Any:
    """``torch.distributed.<name>`` for a name in :data:`FROM_TORCH` or a subpackage of
    torch.distributed (``elastic``, ``launcher``, ``run``, ...); AttributeError otherwise."""
    import importlib
    import importlib.util

    import torch.distributed as torch_dist

    if name not in FROM_TORCH and (
        name.startswith("_") or importlib.util.find_spec(f"torch.distributed.{name}") is None
    ):
        raise AttributeError(f"module 'tdist' has no attribute {name!r}")

    try:
        return getattr(torch_dist, name)
    except AttributeError:  # a subpackage torch.distributed does not import eagerly
        try:
            return importlib.import_module(f"torch.distributed.{name}")
        except ImportError:
            raise AttributeError(f"module 'tdist' has no attribute {name!r} (this torch has none)") from None


def torch_names_here() -> set[str]:
    """The names of :data:`FROM_TORCH` this interpreter's torch has (none without torch):
    what ``dir(tdist)`` lists, so that ``getattr(tdist, name)`` works for each."""
    import importlib.util

    try:
        import torch.distributed as torch_dist
    except ImportError:
        return set()
    present = set(dir(torch_dist))
    return {
        name
        for name in FROM_TORCH
        if name in present or importlib.util.find_spec(f"torch.distributed.{name}") is not None
    }


class _RankPdb(pdb.Pdb):
    """pdb on the terminal, also in a worker whose stdin a launcher replaced."""

    def interaction(self, *args: Any, **kwargs: Any) -> None:
        saved = sys.stdin
        try:
            with open("/dev/stdin") as sys.stdin:
                super().interaction(*args, **kwargs)
        finally:
            sys.stdin = saved


_breakpoints_seen: dict[str, int] = {}


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: Optional[float] = 3600) -> None:  # noqa: A001 - torch's name
    """Stop in pdb on rank ``rank`` of the default group only; the other ranks wait (up to
    ``timeout_s`` seconds, through the store, so the group's timeout does not cut the
    session short) until it continues. The first ``skip`` calls from one place are skipped."""
    if skip > 0:
        caller = sys._getframe(1)
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        _breakpoints_seen[where] = _breakpoints_seen.get(where, 0) + 1
        if _breakpoints_seen[where] <= skip:
            return
    world = resolve_group(None)
    assert world is not None
    count = world.next_seq()
    key = f"tdist/breakpoint/{count}"
    if world.rank == rank:
        debugger = _RankPdb()
        debugger.message(f"\n!!! rank {rank}: type 'up' to reach the frame that called tdist.breakpoint(rank={rank})\n")
        debugger.set_trace()  # pdb stops at the next line, until the user continues
        world.store.set(key, b"continue")
        return
    world.store.wait([key], timeout=timedelta(seconds=timeout_s) if timeout_s is not None else None)


class _CoalescingManager:
    """What ``_coalescing_manager`` yields: the Works issued inside (``wait()`` waits for them)."""

    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Optional[Work]) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


@contextlib.contextmanager
def _coalescing_manager(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[_CoalescingManager]:
    """torch's private context manager (FSDP and DTensor use it): the collectives issued
    on ``group`` inside run asynchronously as they are issued (tdist's backends need no
    batching to be correct); on exit the manager waits for them, or, with ``async_ops``,
    leaves them to ``cm.wait()``. ``device`` is accepted for torch's signature."""
    pg = resolve_group(group)
    manager = _CoalescingManager()
    if pg is None:
        yield manager
        return
    if pg in coalescing:
        raise ValueError(f"_coalescing_manager: group {pg.name!r} is already coalescing")
    coalescing[pg] = manager.works
    try:
        yield manager
    finally:
        coalescing.pop(pg, None)
    if not async_ops:
        manager.wait()
