"""The tdist-mpi plugin: registers backend ``mpi`` and the ``mpi://`` init method.

Importing this module loads neither mpi4py nor libmpi. Registration checks that
mpi4py can load an MPI library (dlopen only, never MPI_Init); MPI is initialised
by the ``mpi://`` rendezvous or the backend factory.
"""

from __future__ import annotations

from typing import Any

from tdist import ANY_SOURCE_OP, OPERATIONS, BackendSpec, hookimpl

TDIST_HOOKSPEC_VERSION = "1.0"

_OPS = frozenset(OPERATIONS) | {ANY_SOURCE_OP}


def _factory(**kwargs: Any) -> Any:
    from .backend import create_backend

    return create_backend(**kwargs)


def _mpi_rendezvous(url: Any, **kwargs: Any) -> Any:
    from .rendezvous import mpi_rendezvous

    return mpi_rendezvous(url, **kwargs)


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    """Register ``mpi``; the MPI library is probed (dlopen) when the backend is first asked about."""
    registry.add_deferred("mpi", _spec)


def _spec() -> BackendSpec:
    from ._runtime import CHECK_ENV, availability, check_collectives_default, cuda_aware

    reason = availability()
    operations = {"cpu": _OPS}
    if reason is None and cuda_aware():
        operations["cuda"] = _OPS
    unsupported = {
        "shrink_group": (
            "a communicator without a lost rank needs MPI's fault tolerance (ULFM: Comm.Revoke/Shrink/Agree), "
            "which tdist-mpi does not use yet; and under mpirun a rank lost to a signal ends the whole job"
        ),
        "abort": (
            "MPI cannot cancel a collective in flight: aborting a group releases this rank's side only, "
            "the peers' pending operations wait (MPI_Abort would end the whole job)"
        ),
        "timeout_names_ranks": "an MPI request that did not complete does not tell which ranks have not arrived",
        "p2p_dtype_check": (
            "MPI checks a message's size, not its datatype: a receive into another dtype of the same "
            "byte size reinterprets the bytes"
        ),
    }
    if not check_collectives_default():
        unsupported["collective_mismatch"] = (
            "MPI does not detect ranks issuing different collectives (op, dtype, root); "
            f"set {CHECK_ENV}=1 to check every collective first"
        )
    return BackendSpec(
        name="mpi",
        factory=_factory,
        operations=operations,
        description="MPI through mpi4py (nonblocking MPI calls, zero-copy buffers); launch with mpirun",
        available=reason,
        default_init_method="mpi://",
        launcher="mpirun",
        extra={"unsupported": unsupported},
    )


@hookimpl
def tdist_register_rendezvous(registry: Any) -> None:
    registry.add("mpi", _mpi_rendezvous)
