"""The failure scenarios' registry and shared parts: :func:`scenario` registers a
controller-side function ``fn(ctx)`` (``ctx`` a :class:`ScenarioContext`); the ``_w_*``
worker-side helpers here are shared by :mod:`~tdist.testing.scenarios` and
:mod:`~tdist.testing.scenarios_ft`, which import this module and not each other.
"""

from __future__ import annotations

import itertools
import os
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from .world import RankFailure, World, free_port

__all__ = ["Scenario", "ScenarioContext", "scenario", "registered", "own_address"]


@dataclass
class Scenario:
    fn: Callable[["ScenarioContext"], Any]
    name: str
    params: list = field(default_factory=lambda: [{}])
    ids: Optional[list] = None
    requires: Sequence[str] = ()
    reference_xfail: Optional[str] = None
    tdist_only: Optional[str] = None
    timeout: float = 120.0
    doc: str = ""
    #: launcher -> why the scenario cannot run with it (e.g. mpirun aborts the job when a rank dies)
    not_with: dict = field(default_factory=dict)


_SCENARIOS: dict[str, Scenario] = {}


def scenario(
    *,
    params: Optional[Sequence[dict]] = None,
    ids: Optional[Sequence[str]] = None,
    requires: Sequence[str] = (),
    reference_xfail: Optional[str] = None,
    tdist_only: Optional[str] = None,
    timeout: float = 120.0,
    not_with: Optional[dict] = None,
) -> Callable:
    """Register a failure scenario (a controller-side function of a :class:`ScenarioContext`)."""

    def register(fn: Callable) -> Callable:
        _SCENARIOS[f"{fn.__module__}:{fn.__qualname__}"] = Scenario(
            fn=fn,
            name=fn.__name__,
            params=[dict(p) for p in params] if params else [{}],
            ids=list(ids) if ids else ([str(next(iter(p.values()))) for p in params] if params else None),
            requires=tuple(requires),
            reference_xfail=reference_xfail,
            tdist_only=tdist_only,
            timeout=timeout,
            not_with=dict(not_with or {}),
            doc=(fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "",
        )
        return fn

    return register


def registered() -> list[Scenario]:
    """The scenarios registered so far (:func:`tdist.testing.scenarios.scenarios` has them all)."""
    return list(_SCENARIOS.values())


@dataclass
class ScenarioContext:
    """What a scenario knows: the backend and how to start worlds for it."""

    backend: str
    dist_module: str
    launcher: str = "env"
    world_kwargs: dict = field(default_factory=dict)

    @property
    def strict(self) -> bool:
        """True when checking tdist's promises beyond torch.distributed's behaviour."""
        return self.dist_module.split(".")[0] == "tdist"

    def spawn(self, world_size: int, **kwargs: Any):
        """A one-off world; with the session's fixed ``init_method`` (``--tdist-init-method``)
        it gets an address of its own, since a pooled world may be using that one."""
        opts = dict(self.world_kwargs)
        if "init_method" in opts:
            opts["init_method"] = own_address(opts["init_method"])
        opts.update(kwargs)
        opts.setdefault("launcher", self.launcher)
        opts.setdefault("dist_module", self.dist_module)
        return World.spawn(self.backend, world_size, **opts)


_OWN = itertools.count(1)


def own_address(init_method: str) -> str:
    """``init_method`` made unique to one world: a ``tcp://`` URL with a fixed port gets a
    free port on the same host, a ``file://`` URL a file of its own; others unchanged."""
    parts = urllib.parse.urlsplit(init_method)
    if parts.scheme == "tcp" and parts.port:
        host = parts.hostname or ""
        host = f"[{host}]" if ":" in host else host
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{host}:{free_port()}"))
    if parts.scheme == "file" and parts.path:
        return urllib.parse.urlunsplit(parts._replace(path=f"{parts.path}.{os.getpid()}-{next(_OWN)}"))
    return init_method


def _info(exc: BaseException, started: float) -> dict:
    return {
        "type": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc),
        "at": time.time(),
        "elapsed": time.monotonic() - started,
    }


def _fmt(outcome: Any) -> str:
    if isinstance(outcome, RankFailure):
        return outcome.headline
    return repr(outcome)[:300]


# =========================================================================== peer killed
def _w_collectives_until_error(seconds: float = 60.0) -> dict:
    """Loop all_reduce until it fails (or ``seconds`` pass); report the error and when."""
    import torch

    from ._common import dist

    t = torch.ones(64 * 1024)
    started = time.monotonic()
    count = 0
    while time.monotonic() - started < seconds:
        try:
            dist.all_reduce(t)
            t.fill_(1.0)
            count += 1
        except Exception as exc:
            info = _info(exc, started)
            info["count"] = count
            return info
    return {"type": None, "count": count}


def _w_ready() -> int:
    from ._common import dist
    from .helpers import check_world_works

    check_world_works("warm-up")
    return dist.get_rank()
