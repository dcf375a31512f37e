"""tdist.testing: the conformance kit.

- :class:`World`: N worker processes started once that run many test bodies
  (``world.run(fn, **kwargs)`` -> per-rank results); ``World.spawn`` for
  one-off worlds in failure scenarios.
- :func:`body`: register a module-level function as a conformance body;
  :mod:`tdist.testing.conformance` holds the built-in ones, written once and
  run against every backend and world size.
- :func:`collect`: generate one pytest test per body in a test module; the
  pytest plugin (:mod:`tdist.testing.pytest_plugin`, entry point ``tdist``)
  provides ``--tdist-backend``/``--tdist-world-sizes`` and the ``tdist_world`` fixture.
- :mod:`tdist.testing.processes`: whole programs (a script under a launcher, ``mpirun``)
  as processes with a hard timeout, killed with everything they started.
- :mod:`tdist.testing.cluster`: a simulated cluster (hosts as network namespaces on
  this machine) for tests across hosts; the plugin's ``tdist_cluster`` fixture.
- :func:`dist_module`: the module under test (``tdist``, or ``torch.distributed``
  via ``$TDIST_TESTING_DIST_MODULE`` to validate the kit against the reference).

Importing this package starts nothing and imports neither torch nor a backend.
"""

from __future__ import annotations

from ._collect import collect, collect_conformance, collect_failures, collect_tutorial, run_body, run_scenario
from ._common import DIST_MODULE_ENV, dist, dist_module, dist_module_name, is_tdist
from ._registry import Body, bodies, body
from .capabilities import Capabilities, capabilities, supports
from .helpers import Sub, assert_tensor, assert_true, check_world_works, raises, value
from .scenarios import Scenario, ScenarioContext, scenario, scenarios
from .world import (
    LAUNCHERS,
    RankFailure,
    World,
    WorldError,
    WorldRunError,
    WorldStartError,
    WorldTimeoutError,
    find_mpirun,
    free_port,
)

__all__ = [
    # worlds
    "World",
    "RankFailure",
    "WorldError",
    "WorldRunError",
    "WorldTimeoutError",
    "WorldStartError",
    "LAUNCHERS",
    "free_port",
    "find_mpirun",
    # the module under test
    "dist",
    "dist_module",
    "dist_module_name",
    "is_tdist",
    "DIST_MODULE_ENV",
    # bodies and scenarios
    "body",
    "bodies",
    "Body",
    "scenario",
    "scenarios",
    "Scenario",
    "ScenarioContext",
    # pytest collection
    "collect",
    "collect_conformance",
    "collect_tutorial",
    "collect_failures",
    "run_body",
    "run_scenario",
    # capabilities
    "Capabilities",
    "capabilities",
    "supports",
    # helpers for bodies
    "Sub",
    "assert_tensor",
    "assert_true",
    "check_world_works",
    "raises",
    "value",
]
