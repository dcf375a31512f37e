"""The tdist hook implementations of tdist-gloo (entry point ``gloo`` in group ``tdist``)."""

from __future__ import annotations

from typing import Any

from tdist import BackendSpec, hookimpl

from . import BACKEND_NAME, OPERATIONS, unavailable_reason

TDIST_HOOKSPEC_VERSION = "1.0"


def _factory(**kwargs: Any) -> Any:
    from .backend import create_backend  # imports torch: only when a group is built

    return create_backend(**kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    registry.add(
        BackendSpec(
            name=BACKEND_NAME,
            factory=_factory,
            operations=OPERATIONS,
            description="torch's gloo (ProcessGroupGloo): CPU collectives and point-to-point, CUDA collectives",
            available=unavailable_reason(),
        )
    )
