"""Hook implementations of tdist-nccl (entry point ``nccl = "tdist_nccl.plugin"``).

Only registration happens here. Availability is checked when the core first lists
backends (CuPy is found without being imported; torch is imported only if CuPy is
there); CuPy, NCCL and the backend modules load in the factory, when a group is built.
"""

from __future__ import annotations

from typing import Any

from tdist import BackendSpec, hookimpl

from . import BACKEND_NAME, OPERATIONS, unavailable_reason

TDIST_HOOKSPEC_VERSION = "1.0"

DESCRIPTION = "NCCL (through CuPy) on CUDA tensors: collectives, point-to-point and the multi-GPU collectives"


def create_nccl_backend(**kwargs: Any) -> Any:
    """``factory(store=, rank=, world_size=, timeout=, options=, global_ranks=)``."""
    from .backend import create_backend

    return create_backend(**kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    """Register the ``nccl`` backend (unavailable, with the reason, without CuPy or a GPU);
    CuPy and the GPU are probed when the backend is first asked about."""
    registry.add_deferred(BACKEND_NAME, _spec)


def _spec() -> BackendSpec:
    return BackendSpec(
        name=BACKEND_NAME,
        factory=create_nccl_backend,
        operations=OPERATIONS,
        description=DESCRIPTION,
        available=unavailable_reason(),
        extra={
            "options": ("device_id",),
            # finer features the conformance kit asks about (tdist.testing.capabilities)
            "unsupported": {
                "p2p_tags": "NCCL has no message tags: messages between two ranks match in order",
                "dtype.int16": "NCCL has no 16-bit integer type",
                **{f"reduce_op.{op}": "NCCL has no bitwise reductions" for op in ("BAND", "BOR", "BXOR")},
                "shrink_group": "not yet: the survivors' communicator needs ncclCommAbort of the old one, "
                "untested without a GPU",
            },
        },
    )


@hookimpl
def tdist_default_backend(device: str) -> Any:
    """``nccl`` for CUDA tensors when it is usable here; no opinion otherwise."""
    if device == "cuda" and unavailable_reason() is None:
        return BACKEND_NAME
    return None
