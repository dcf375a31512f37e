"""The tdist hook implementations of tdist-gloo (entry point ``gloo`` in group ``tdist``)."""

from __future__ import annotations

from typing import Any

from tdist.plugin import BackendSpec, flag, hookimpl

from . import BACKEND_NAME, CHECK_ENV, OPERATIONS, unavailable_reason

TDIST_HOOKSPEC_VERSION = "1.0"


def _factory(**kwargs: Any) -> Any:
    from .backend import create_backend  # imports torch: only when a group is built

    return create_backend(**kwargs)


def _unsupported_features() -> dict[str, str]:
    """Features the conformance kit checks that gloo lacks (some unless asked for)."""
    size_check = {
        "p2p_size_check": (
            "torch's gloo aborts the receiving process (std::terminate in its transport thread) when a "
            "message is larger than the receive buffer; make sender and receiver agree on sizes"
        )
    }
    size_check["p2p_dtype_check"] = (
        "gloo moves bytes: a receive into another dtype of the same byte size reinterprets them"
    )
    size_check["timeout_names_ranks"] = (
        "gloo's timeouts say 'Timed out waiting Nms for recv operation' (or, once a peer gave up, "
        "'Connection closed by peer'), never which ranks did not arrive"
    )
    size_check["abort"] = (
        "gloo fails only the operations waiting on a closed connection: aborting a group fails this rank's "
        "pending operations, a peer waiting on a third rank waits for its timeout"
    )
    if flag(CHECK_ENV):
        return size_check
    return {
        **size_check,
        "collective_mismatch": (
            "gloo does not detect ranks issuing different sizes or dtypes (it may abort or return "
            f"corrupted data); set {CHECK_ENV}=1 or pg_options={{'gloo_check_collectives': True}} to check "
            "every collective first (about +150 us per call)"
        ),
    }


@hookimpl
def tdist_register_backends(registry: Any) -> None:
    """Register ``gloo``; torch is asked whether it has gloo when the backend is first asked about."""
    registry.add_deferred(BACKEND_NAME, _spec)


def _spec() -> BackendSpec:
    return BackendSpec(
        name=BACKEND_NAME,
        factory=_factory,
        operations=OPERATIONS,
        description="torch's gloo (ProcessGroupGloo): CPU collectives and point-to-point, CUDA collectives",
        available=unavailable_reason(),
        extra={"unsupported": _unsupported_features()},
    )
