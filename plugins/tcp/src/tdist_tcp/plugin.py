"""Hook implementations of tdist-tcp (entry point ``tcp = "tdist_tcp.plugin"``).

Only registration happens here; torch and the backend modules are imported by the
factory, when a process group is created.
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
    """Register the ``tcp`` backend."""
    registry.add(
        BackendSpec(
            name="tcp",
            factory=create_tcp_backend,
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
                    "hierarchy",
                    "host_id",
                    "ranks_per_host",
                )
            },
        )
    )
