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
    from ._ulfm import LAUNCH_ARGS, library_has_ulfm
    from ._ulfm import problem as ulfm_problem

    reason = availability()
    operations = {"cpu": _OPS}
    if reason is None and cuda_aware():
        operations["cuda"] = _OPS
    unsupported: dict[str, str] = {}
    no_ft = ulfm_problem() if reason is None else reason
    if no_ft:  # MPI's fault tolerance (ULFM) is what keeps a job, and its groups, alive after a loss
        unsupported.update(
            peer_failure=f"a rank lost to a signal ends the whole job under mpirun ({no_ft})",
            shrink_group=f"a group without a lost rank needs MPI's fault tolerance (ULFM): {no_ft}",
            abort=(
                "MPI cannot cancel a collective in flight without its fault tolerance (ULFM's MPI_Comm_revoke): "
                f"aborting a group releases this rank's side only ({no_ft})"
            ),
        )
    unsupported |= {
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
        description=(
            "MPI through mpi4py (nonblocking MPI calls, zero-copy buffers); launch with mpirun, "
            "with --with-ft ulfm for fault tolerance (surviving a lost rank, shrink_group, abort)"
        ),
        available=reason,
        default_init_method="mpi://",
        launcher="mpirun",
        # what mpirun needs for the declared features (the conformance kit launches with it)
        extra={"unsupported": unsupported, "mpirun_args": LAUNCH_ARGS if reason is None and library_has_ulfm() else ()},
    )


@hookimpl
def tdist_register_rendezvous(registry: Any) -> None:
    registry.add("mpi", _mpi_rendezvous)
