"""Everything a plugin author touches, in one public module.

A backend or rendezvous plugin imports from ``tdist`` (the user API) and from
``tdist.plugin`` only, never from ``tdist._*`` (the first-party plugins are held
to this by a lint rule, ``ruff`` TID251, and by ``tests/test_plugin_contract.py``).

- registration: :data:`hookimpl`, :data:`HOOKSPEC_VERSION`, :class:`BackendRegistry`,
  :class:`RendezvousRegistry`, :class:`BackendSpec`, :class:`BackendFactory`,
  :data:`OPERATIONS`, :data:`OPERATION_CODES`, :data:`COLLECTIVES`, :data:`ANY_SOURCE_OP`,
  :data:`FEATURES`, :data:`LAUNCHERS`;
- the backend: :class:`Backend`, :class:`Work` (and :data:`Timeout`, :func:`seconds`);
- observing: :class:`WorkInfo`;
- reductions: :class:`ReduceOp`, :class:`Reduction`, :func:`check_reduction`,
  :func:`combine_`, :func:`prescale_`, :func:`prescaled`, :func:`finalize_`,
  :func:`premul_factor`, :func:`plan_reduction` (how a library with some native dtypes
  runs a reduction: :class:`ReductionPlan`);
- errors: :class:`DistError` and its subclasses, :func:`backend_error` (a library's
  exception as the tdist error, timeouts told apart), :func:`descriptor_shortage` (an
  ``EMFILE``/``ENFILE`` named, with the limit);
- settings: :func:`flag` (boolean environment variables and ``pg_options``);
- addresses: :func:`local_address_for`, :func:`store_endpoint`, :func:`route_address`
  (which local address reaches the job's store);
- stores: :class:`Store` (the base a store plugin subclasses) and the stores a
  rendezvous builds on.
"""

from __future__ import annotations

from typing import Any, Optional

from ._backend import (
    ANY_SOURCE_OP,
    COLLECTIVES,
    FEATURES,
    LAUNCHERS,
    OPERATION_CODES,
    OPERATIONS,
    Backend,
    BackendFactory,
    BackendSpec,
)
from ._endpoint import local_address_for, route_address, store_endpoint
from ._errors import (
    DistBackendError,
    DistBackendTimeoutError,
    DistError,
    DistNetworkError,
    DistStateError,
    DistStoreError,
    DistStoreTimeoutError,
    backend_error,
)
from ._flags import flag
from ._oserror import describe as _describe_os_error, out_of_descriptors as _out_of_descriptors
from ._plugins import BackendRegistry, RendezvousHandler, RendezvousRegistry, WorkInfo, plugins
from ._reduce_op import ReduceOp, Reduction, as_reduction
from ._store import FileStore, HashStore, PrefixStore, QueueEmptyError, Store, TCPStore
from ._store.tls import TLS_RECORD_TYPE, WOULD_BLOCK, TlsConfig, TlsError, describe_ssl_error
from ._work import Timeout, Work, seconds
from .hookspecs import HOOKSPEC_VERSION, hookimpl
from .reduction import (
    ReductionPlan,
    check_reduction,
    combine_,
    finalize_,
    plan_reduction,
    premul_factor,
    prescale_,
    prescaled,
)

__all__ = [
    # registration
    "hookimpl",
    "HOOKSPEC_VERSION",
    "BackendRegistry",
    "RendezvousRegistry",
    "RendezvousHandler",
    "BackendSpec",
    "BackendFactory",
    "OPERATIONS",
    "OPERATION_CODES",
    "COLLECTIVES",
    "ANY_SOURCE_OP",
    "FEATURES",
    "LAUNCHERS",
    # the backend and its Work
    "Backend",
    "Work",
    "WorkInfo",
    "Timeout",
    "seconds",
    # reductions
    "ReduceOp",
    "Reduction",
    "as_reduction",
    "check_reduction",
    "combine_",
    "prescale_",
    "prescaled",
    "finalize_",
    "premul_factor",
    "ReductionPlan",
    "plan_reduction",
    # errors
    "DistError",
    "DistBackendError",
    "DistBackendTimeoutError",
    "DistNetworkError",
    "DistStateError",
    "DistStoreError",
    "DistStoreTimeoutError",
    "backend_error",
    "descriptor_shortage",
    # in-process registration
    "register_plugin",
    "registered_plugins",
    # TLS (the store's and the tcp backend's): configuration and the helpers a TLS transport needs
    "TlsConfig",
    "TlsError",
    "describe_ssl_error",
    "TLS_RECORD_TYPE",
    "WOULD_BLOCK",
    # settings and addresses
    "flag",
    "local_address_for",
    "route_address",
    "store_endpoint",
    # stores
    "Store",
    "HashStore",
    "PrefixStore",
    "FileStore",
    "TCPStore",
    "QueueEmptyError",
]


def descriptor_shortage(exc: BaseException) -> Optional[str]:
    """When ``exc`` is EMFILE or ENFILE (no file descriptor left, in this process or the
    system): what ran out, the limit and what to do (``EMFILE (Too many open files): ...``);
    None for any other error."""
    if not _out_of_descriptors(exc):
        return None
    assert isinstance(exc, OSError)
    return _describe_os_error(exc)


def register_plugin(plugin: Any, name: str) -> None:
    """Register ``plugin`` (an object or module with ``@hookimpl`` functions: observers, backends,
    init methods) under ``name`` in this process, as an entry point would at start-up: for a
    plugin turned on at run time. Raises :class:`DistError` when it is refused (disabled by
    ``TDIST_DISABLED_PLUGINS``, a newer contract major version, unknown hook names)."""
    plugins().register(plugin, name)


def registered_plugins() -> list[str]:
    """The names of the plugins registered in this process (entry points and in-process)."""
    return [record.name for record in plugins().records]
