"""The hook implementations of tdist-template (entry point ``store`` in group ``tdist``).

This module is what the entry point names: the core imports it, checks
``TDIST_HOOKSPEC_VERSION`` and calls the hooks it defines. Keep it cheap to
import: no torch, no backend module, no network (the factory imports them).
"""

from __future__ import annotations

from typing import Any, Optional

from tdist import ANY_SOURCE_OP, OPERATIONS, BackendSpec, hookimpl

from . import BACKEND_NAME, SCHEME

#: The hook contract this plugin was written for: the core loads it when the major
#: version equals its own and this minor version is not newer than its own.
TDIST_HOOKSPEC_VERSION = "1.0"

DESCRIPTION = "every operation through the group's key-value store: slow, simple, complete (CPU tensors)"


def unavailable_reason() -> Optional[str]:
    """None when the backend can run here, else why not (shown by ``python -m tdist info``).

    Check for dependencies without importing them: ``importlib.util.find_spec``.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return "torch is not installed (pip install torch)"
    return None


def create_backend(**kwargs: Any) -> Any:
    """The backend factory: imports torch and the backend only when a group is built."""
    from .backend import create_backend as create

    return create(**kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    """Register the ``store`` backend."""
    registry.add(
        BackendSpec(
            name=BACKEND_NAME,
            factory=create_backend,
            operations={"cpu": frozenset(OPERATIONS) | {ANY_SOURCE_OP}},
            description=DESCRIPTION,
            available=unavailable_reason(),
            extra={
                # Finer capabilities this backend lacks (see tdist.testing.capabilities):
                # the conformance kit still runs their tests and expects a clean failure.
                "unsupported": {
                    "peer_failure": "a dead peer is noticed only at the group's timeout "
                    "(the store gives no liveness signal)",
                },
            },
        )
    )


@hookimpl
def tdist_register_rendezvous(registry: Any) -> None:
    """Register the ``indexed://`` init method."""
    from .rendezvous import indexed_rendezvous  # cheap: no torch, no network at import

    registry.add(SCHEME, indexed_rendezvous)
