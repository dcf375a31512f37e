"""Hook implementations of tdist-tcp (entry point ``tcp = "tdist_tcp.plugin"``).

Only registration happens here. The backend's modules (no torch: that is imported when a
group first moves a tensor) are imported when the backend is first asked about: by
``init_process_group``'s argument check, before the rendezvous, so that a rank imports
them while it would wait for the others anyway, not after the last rank arrived.
"""

from __future__ import annotations

from typing import Any

from tdist.plugin import ANY_SOURCE_OP, OPERATIONS, BackendSpec, hookimpl

TDIST_HOOKSPEC_VERSION = "1.0"

DESCRIPTION = (
    "pure-Python collectives and point-to-point over TCP sockets, collectives through shared memory "
    "between ranks on one host (CPU tensors, every dtype)"
)


def create_tcp_backend(**kwargs: Any) -> Any:
    """``factory(store=, rank=, world_size=, timeout=, options=, global_ranks=)``."""
    from .factory import create_backend

    return create_backend(**kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    """Register the ``tcp`` backend (its spec, and so its modules, when first asked about)."""
    registry.add_deferred("tcp", _spec)


def _spec() -> BackendSpec:
    from .factory import create_backend

    return BackendSpec(
        name="tcp",
        factory=create_backend,
        operations={"cpu": frozenset(OPERATIONS) | {ANY_SOURCE_OP}},
        description=DESCRIPTION,
        extra={
            "options": (
                "host",
                "ifname",
                "port",
                "socket_buffer",
                "streams",
                "unix",
                "ring_threshold",
                "segment_bytes",
                "grace",
                "linger",
                "shm",
                "shm_slot_bytes",
                "shm_direct_bytes",
                "shm_block_bytes",
                "shm_spin_us",
                "native",
                "cma",
                "hierarchy",
                "host_id",
                "ranks_per_host",
            )
        },
    )
