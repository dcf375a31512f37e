"""What a backend declares it supports, as the conformance kit asks it.

Capability keys are the operation names of :data:`tdist.OPERATIONS` plus
``recv_anysource`` (answered by the backend's :class:`tdist.BackendSpec`), and
finer features the spec has no column for:

``reduce_op.<NAME>``  a reduction operator (``reduce_op.PREMUL_SUM``, ``reduce_op.AVG``)
``dtype.<name>``      reductions on a dtype (``dtype.bfloat16``, ``dtype.complex64``)
``multigpu``          the ``*_multigpu`` API names
``monitored_barrier`` :func:`monitored_barrier`
``p2p_tags``          ``tag=`` matching in send/recv
``p2p_size_check``    a receive into a buffer that does not match the message's size raises
``p2p_dtype_check``   a receive into a buffer of another dtype (same byte size) raises
``collective_mismatch``  detecting ranks that issue different collectives / sizes / dtypes / roots
``peer_failure``      every survivor of a killed peer raises promptly (not after the timeout)
``timeout_names_ranks``  a collective whose peers never arrive raises DistBackendTimeoutError naming them
``shrink_group``      :func:`shrink_group`: the survivors of a lost rank build the group without it, no restart
``abort``             ``group.abort()`` on one rank fails its pending operations and its peers' within seconds

A tdist backend declares a finer feature unsupported by listing its key in
``BackendSpec.extra["unsupported"]``; an undeclared feature counts as supported.
When the module under test is ``torch.distributed`` (to validate the kit),
the table below describes torch's own backends.

An unsupported capability never skips a test silently: the body still runs and
must fail with a clear error on every rank (the test is then reported as
xfail, naming the capability); if it passes, the declaration is wrong and the
test fails. A failure scenario needing an unsupported capability also runs and
is reported as xfail when it fails (a pass is accepted there: detection may be partial).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from .._backend import ANY_SOURCE_OP, OPERATIONS
from .._flags import flag
from .._mismatch import CHECK_ENV
from ._common import dist_module_name

__all__ = ["Capabilities", "capabilities", "supports", "TORCH_BACKENDS"]

_ALL_OPS = frozenset(OPERATIONS) | {ANY_SOURCE_OP}

_GLOO_SIZE_CHECK = (
    "gloo aborts the receiving process (std::terminate in its transport thread) when a message "
    "is larger than the receive buffer"
)

#: torch.distributed's backends (torch 2.x, CPU tensors), measured with the kit:
#: per backend, the operations it has and the finer features it lacks (with why).
TORCH_BACKENDS: dict[str, dict[str, Any]] = {
    "gloo": {
        "operations": {"cpu": _ALL_OPS},
        "unsupported": {
            "collective_mismatch": "torch gloo aborts or returns wrong data on mismatched sizes/dtypes",
            "peer_failure": "torch gloo: ranks not connected to the dead one wait for the timeout",
            "p2p_size_check": _GLOO_SIZE_CHECK,
            "p2p_dtype_check": "torch gloo moves bytes: a receive into another dtype of the same size reinterprets them",
            "timeout_names_ranks": "torch gloo: 'Timed out waiting 2000ms for recv operation', naming no rank",
            "reduce_op.PREMUL_SUM": "torch gloo: 'Cannot use ReduceOp.PREMUL_SUM with Gloo'",
            "dtype.int16": "torch gloo has no int16 reductions: 'Invalid scalar type'",
            "multigpu": "torch.distributed 2.x removed the *_multigpu functions",
            "shrink_group": "torch's shrink_group is NCCL-only",
        },
    },
    "mpi": {
        "operations": {"cpu": _ALL_OPS - {"reduce_scatter", "reduce_scatter_tensor"}},
        "unsupported": {
            "reduce_op.PREMUL_SUM": "torch mpi has no PREMUL_SUM",
            "reduce_op.AVG": "torch mpi has no AVG",
            "multigpu": "torch.distributed 2.x removed the *_multigpu functions",
            "monitored_barrier": "monitored_barrier is gloo-only in torch",
            "collective_mismatch": "MPI does not check that ranks issue matching collectives",
            "timeout_names_ranks": "an MPI request does not tell which ranks have not arrived",
            "p2p_dtype_check": "MPI does not check that sender and receiver use one datatype",
            "shrink_group": "torch's shrink_group is NCCL-only",
            "peer_failure": "under mpirun a rank killed by a signal ends the whole job (torch's mpi has no ULFM)",
        },
    },
    "nccl": {
        "operations": {"cpu": frozenset()},
        "unsupported": {
            "multigpu": "torch.distributed 2.x removed the *_multigpu functions",
            "monitored_barrier": "monitored_barrier is gloo-only in torch",
        },
    },
}


class Capabilities:
    """Answers ``supports(key, device)`` for one backend of the module under test."""

    def __init__(self, backend: str, module_name: Optional[str] = None) -> None:
        self.backend = backend
        self.module_name = module_name or dist_module_name()
        self.spec: Any = None
        self.source = "default (no declaration found: everything counts as supported)"
        self._torch: Optional[dict[str, Any]] = None
        if self.module_name.split(".")[0] == "tdist":
            self._load_tdist_spec()
        else:
            self._torch = TORCH_BACKENDS.get(backend.lower())
            if self._torch is not None:
                self.source = f"tdist.testing's table of torch.distributed backend {backend!r}"

    def _load_tdist_spec(self) -> None:
        try:
            import tdist
        except Exception as exc:  # the module under test does not import: tests will say so
            self.source = f"default (import tdist failed: {exc})"
            return
        getter = getattr(tdist, "get_backend_spec", None)
        spec = None
        try:
            if getter is not None:
                spec = getter(self.backend)
            else:  # older core: go through the plugin registry
                from tdist._plugins import plugins

                spec = plugins().backends.get(self.backend)
        except Exception as exc:
            self.source = f"default (no spec for {self.backend!r}: {exc})"
            return
        if spec is not None and hasattr(spec, "supports"):
            self.spec = spec
            self.source = f"BackendSpec of {self.backend!r}"

    def reason(self, key: str, device: str = "cpu") -> Optional[str]:
        """None when supported, else why not."""
        if self._torch is not None:
            if key in _ALL_OPS:
                ok = key in self._torch["operations"].get(device, frozenset())
                return None if ok else f"torch {self.backend} has no {key} on {device}"
            return self._torch["unsupported"].get(key)
        if self.spec is None:
            return None
        if key == "collective_mismatch" and flag(CHECK_ENV):
            return None  # the core checks every collective of every backend
        if key in _ALL_OPS:
            if self.spec.supports(key, device):
                return None
            return f"backend {self.backend!r} declares no {key} on {device} (BackendSpec.operations)"
        extra = getattr(self.spec, "extra", None) or {}
        unsupported = extra.get("unsupported", ())
        if key in unsupported:
            detail = unsupported[key] if isinstance(unsupported, dict) else ""
            return f"backend {self.backend!r} declares {key} unsupported" + (f": {detail}" if detail else "")
        return None

    def supports(self, key: str, device: str = "cpu") -> bool:
        return self.reason(key, device) is None

    def __repr__(self) -> str:
        return f"<Capabilities {self.backend!r} of {self.module_name} from {self.source}>"


@functools.lru_cache(maxsize=None)
def capabilities(backend: str, module_name: Optional[str] = None) -> Capabilities:
    """The (cached) :class:`Capabilities` of ``backend`` in the module under test."""
    return Capabilities(backend, module_name or dist_module_name())


def supports(key: str, device: str = "cpu", backend: Optional[str] = None) -> bool:
    """Inside a worker: does this world's backend support ``key``? (see module docs)."""
    from ._common import backend_name

    return capabilities(backend or backend_name()).supports(key, device)
