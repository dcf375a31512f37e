"""The conformance suite: every body, written once, run against every backend
and world size.

Importing this module registers the bodies of:

- :mod:`~tdist.testing.conformance_p2p` (queries, send/recv, isend/irecv, any-source, order, tags, batch)
- :mod:`~tdist.testing.conformance_collectives` (every collective, world and subgroup, async, sizes, views)
- :mod:`~tdist.testing.conformance_coalesced` (all_reduce/all_gather_coalesced, the ``*_single`` names)
- :mod:`~tdist.testing.conformance_objects` (the object collectives and object send/recv)
- :mod:`~tdist.testing.conformance_reduce` (every ReduceOp x dtype, AVG, PREMUL_SUM, invalid pairs)
- :mod:`~tdist.testing.conformance_groups` (groups, non-members, monitored_barrier, multi-GPU names)
- :mod:`~tdist.testing.conformance_errors` (bad arguments raise without communicating)
- :mod:`~tdist.testing.conformance_contract` (the contract's musts that results alone do not show)
- :mod:`~tdist.testing.tutorial` (the tutorial's programs; suite "tutorial")
- :mod:`~tdist.testing.torch_utilities` (torch's DDP, FSDP, DCP, ... over the groups; suite "torch")
- :mod:`~tdist.testing.scenarios` (failure scenarios in one-off worlds)

Use :func:`tdist.testing.collect` to turn them into pytest tests, or run one
directly: ``World("tcp", 2).run(conformance_p2p.message_order)``.
"""

from __future__ import annotations

from . import (  # noqa: F401  (imported for their registrations)
    conformance_coalesced,
    conformance_collectives,
    conformance_contract,
    conformance_errors,
    conformance_groups,
    conformance_objects,
    conformance_p2p,
    conformance_reduce,
    scenarios,
    torch_utilities,
    tutorial,
)
from ._registry import Body, bodies
from .scenarios import Scenario
from .scenarios import scenarios as failure_scenarios

__all__ = [
    "bodies",
    "failure_scenarios",
    "Body",
    "Scenario",
    "conformance_p2p",
    "conformance_collectives",
    "conformance_coalesced",
    "conformance_reduce",
    "conformance_groups",
    "conformance_objects",
    "conformance_errors",
    "conformance_contract",
    "tutorial",
    "torch_utilities",
    "scenarios",
]
