"""Registers the ``broken`` backend (entry point ``broken = tdist_broken.plugin``)."""

from __future__ import annotations

from typing import Any

from tdist.plugin import ANY_SOURCE_OP, OPERATIONS, BackendSpec, hookimpl

from . import BACKEND_NAME, violation

TDIST_HOOKSPEC_VERSION = "1.0"


def create_broken_backend(**kwargs: Any) -> Any:
    """``factory(store=, rank=, world_size=, timeout=, options=, global_ranks=)``."""
    from .backend import BrokenBackend

    return BrokenBackend(**kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    unsupported = {}
    if violation() == "declares_int16_unsupported":
        unsupported["dtype.int16"] = "declared on purpose, wrongly"
    registry.add(
        BackendSpec(
            name=BACKEND_NAME,
            factory=create_broken_backend,
            operations={"cpu": frozenset(OPERATIONS) | {ANY_SOURCE_OP}},
            description=f"the tcp backend, broken on purpose ({violation() or 'nothing broken'})",
            extra={"unsupported": unsupported},
        )
    )
