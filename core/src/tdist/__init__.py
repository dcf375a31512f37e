"""tdist: torch.distributed's communication API as a plugin architecture.

``import tdist as dist`` runs programs written for ``torch.distributed``.
Backends are separate distributions found through entry points (group
``tdist``) the first time ``init_process_group`` or ``is_backend_available``
needs them; importing tdist loads no backend and none of their dependencies.
"""

from __future__ import annotations

import sys as _sys

from ._backend import ANY_SOURCE_OP, OPERATIONS, Backend, BackendSpec
from ._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    gather_into_tensor,
    gather_single,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
)
from ._coalesced import all_gather_coalesced, all_reduce_coalesced
from ._environment import get_node_local_rank, is_torchelastic_launched, replaced_rank
from ._errors import (
    DistBackendError,
    DistBackendTimeoutError,
    DistError,
    DistNetworkError,
    DistStateError,
    DistStoreError,
    DistStoreTimeoutError,
)
from ._failure import DistRankFailureError, DistRankFailureTimeoutError
from ._groups import (
    GroupMember,
    ProcessGroup,
    get_backend,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    is_initialized,
)
from ._init import (
    available_backends,
    default_pg_timeout,
    destroy_process_group,
    get_backend_impl,
    get_backend_spec,
    get_default_backend_for_device,
    get_pg_count,
    init_process_group,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    new_group,
    set_timeout,
)
from ._multigpu import all_gather_multigpu, all_reduce_multigpu, broadcast_multigpu, reduce_multigpu
from ._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from ._plugins import WorkInfo
from ._reduce_op import ReduceOp, Reduction, make_premul_sum, reduce_op, supports_complex
from ._rendezvous.iterator import rendezvous
from ._store import (
    FileStore,
    HashStore,
    PrefixStore,
    QueueEmptyError,
    Store,
    TCPStore,
    TorchStore,
    as_torch_store,
    from_torch_store,
)
from ._store.tls import TlsConfig, TlsError
from ._subgroups import new_subgroups, new_subgroups_by_enumeration, split_group
from ._shrink import SHRINK_ABORT, SHRINK_DEFAULT, failed_ranks, shrink_group
from ._grow import grow_group, join_process_group
from ._work import Work
from ._torch_names import _coalescing_manager as _coalescing_manager, breakpoint, from_torch as _from_torch
from .hookspecs import HOOKSPEC_VERSION, hookimpl
from ._torch import install as _install_torch_bridge
from ._errorfile import install as _install_error_file

from ._version import __version__ as __version__

# tdist's groups are reported to the bridge, and torch.distributed.init_process_group("tdist-tcp") works
_install_torch_bridge(_sys.modules[__name__])
_install_error_file()  # under tdistrun: an uncaught exception leaves the launcher a record (TDIST_ERROR_FILE)

#: torch.distributed's private spelling of :func:`make_premul_sum`.
_make_nccl_premul_sum = make_premul_sum


def __getattr__(name: str) -> object:
    """tdist's own subpackages not imported yet (``tdist.nn``, ``tdist.testing``, ...), then
    torch.distributed's own objects under their names (``tdist.rpc``, ``tdist.DeviceMesh``,
    ``tdist.AllreduceOptions``, ...: :data:`tdist._torch_names.FROM_TORCH`), looked up on first use."""
    import importlib
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    value = _from_torch(name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    from ._torch_names import torch_names_here

    return sorted({*globals(), *torch_names_here()})


__all__ = [
    # setup
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "is_available",
    "is_backend_available",
    "available_backends",
    "get_backend_spec",
    "default_pg_timeout",
    "new_group",
    "is_gloo_available",
    "is_mpi_available",
    "is_nccl_available",
    "get_default_backend_for_device",
    # groups and ranks
    "ProcessGroup",
    "GroupMember",
    "group",
    "get_rank",
    "get_world_size",
    "get_backend",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "new_subgroups",
    "new_subgroups_by_enumeration",
    "split_group",
    "shrink_group",
    "failed_ranks",
    "grow_group",
    "join_process_group",
    "SHRINK_DEFAULT",
    "SHRINK_ABORT",
    "get_pg_count",
    "set_timeout",
    "get_backend_impl",
    "get_node_local_rank",
    "is_torchelastic_launched",
    "replaced_rank",
    # point-to-point
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    # collectives
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "gather",
    "gather_single",
    "gather_into_tensor",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "breakpoint",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    # multi-GPU collectives
    "broadcast_multigpu",
    "all_reduce_multigpu",
    "reduce_multigpu",
    "all_gather_multigpu",
    # object collectives
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    # reductions and work
    "ReduceOp",
    "reduce_op",
    "Reduction",
    "make_premul_sum",
    "supports_complex",
    "Work",
    # stores
    "Store",
    "TCPStore",
    "FileStore",
    "HashStore",
    "PrefixStore",
    "TorchStore",
    "as_torch_store",
    "from_torch_store",
    "TlsConfig",
    "TlsError",
    "QueueEmptyError",
    "rendezvous",
    # errors
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendTimeoutError",
    "DistStoreTimeoutError",
    "DistStateError",
    "DistRankFailureError",
    "DistRankFailureTimeoutError",
    # plugin contract
    "Backend",
    "BackendSpec",
    "OPERATIONS",
    "ANY_SOURCE_OP",
    "hookimpl",
    "HOOKSPEC_VERSION",
    "WorkInfo",
]
