"""The multi-GPU collectives (``*_multigpu``): one tensor per local GPU, NCCL group calls.

The first time a group runs a multi-GPU collective with ``n`` local tensors, every
rank creates a *clique* of ``world_size * n`` NCCL ranks: device ``d`` (the d-th
tensor) of group rank ``r`` is NCCL rank ``r * n + d``. The clique's unique id comes
from group rank 0 through the store (key ``nccl/multigpu/<n>/unique_id``) and its
``n`` communicators are initialised together between groupStart and groupEnd (with
``NcclCommunicator.initAll`` when the group has one rank). Later calls with ``n``
tensors reuse it and must list the same devices in the same order.

Because NCCL rank ``k * n + j`` is input ``j`` of rank ``k``, NCCL's all_gather
order is exactly ``output_tensor_lists[i][k * n + j]``; AVG divides by ``world_size * n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from tdist import Reduction
from tdist.plugin import prescale_

from .buffers import Staging, nbytes, ptr, readable
from .comm import new_clique, share_unique_id
from .dtypes import average_, reduce_view
from .work import NcclWork

if TYPE_CHECKING:
    import torch

    from .backend import NcclBackend

__all__ = ["MultiGpu", "clique_ranks"]


def clique_ranks(group_rank: int, n_local: int) -> list[int]:
    """The NCCL ranks of ``group_rank``'s ``n_local`` devices in a multi-GPU clique."""
    return [group_rank * n_local + d for d in range(n_local)]


@dataclass
class _Clique:
    devices: tuple[int, ...]
    comms: list[Any]


class MultiGpu:
    """The multi-GPU cliques of one :class:`~.backend.NcclBackend` and the collectives on them."""

    def __init__(self, backend: NcclBackend) -> None:
        self.backend = backend
        self._cliques: dict[int, _Clique] = {}

    # ------------------------------------------------------------------ cliques
    def communicators(self) -> list[Any]:
        return [comm for clique in self._cliques.values() for comm in clique.comms]

    def forget(self) -> None:
        self._cliques.clear()

    def devices(self, tensors: Sequence[torch.Tensor], operation: str) -> tuple[int, ...]:
        """The device of each tensor; a ValueError unless they are on distinct CUDA devices."""
        devices = tuple(self.backend.cuda.device_index(t, operation) for t in tensors)
        if len(set(devices)) != len(devices):
            raise ValueError(
                f"nccl {operation}: each tensor of tensor_list must be on a different GPU, got devices {list(devices)}"
            )
        return devices

    def clique(self, devices: tuple[int, ...], operation: str) -> list[Any]:
        """The communicators of the clique for ``len(devices)`` local GPUs (created at first use)."""
        n = len(devices)
        found = self._cliques.get(n)
        if found is not None:
            if found.devices != devices:
                raise ValueError(
                    f"nccl {operation}: this group's {n}-GPU collectives run on devices {list(found.devices)}; "
                    f"got {list(devices)} (keep the same devices, in the same order)"
                )
            return found.comms
        b = self.backend
        with b.calling(operation):
            if b.size == 1:
                comms = list(b.nccl.NcclCommunicator.initAll(list(devices)))
            else:
                uid = share_unique_id(b.nccl, b.store, f"nccl/multigpu/{n}/unique_id", b.rank, b.timeout)
                guards = [_guard(b, dev) for dev in devices]
                comms = new_clique(b.nccl, b.size * n, uid, b.rank * n, guards)
        self._cliques[n] = _Clique(devices, comms)
        return comms

    # ------------------------------------------------------------------ running
    def run(
        self,
        operation: str,
        tensors: Sequence[torch.Tensor],
        issue: Callable[[int, Any, int], None],
        finish: Callable[[int], None],
        result: Sequence[torch.Tensor],
        prepare: Optional[Callable[[int], None]] = None,
    ) -> NcclWork:
        """``prepare(d)`` on each device, ``issue(d, comm, stream)`` for every local device d
        inside one NCCL group, then ``finish(d)`` on each device's stream, then one event per device."""
        b = self.backend
        devices = self.devices(tensors, operation)
        with b.lock:
            b.check_open(operation)
            b.flush()
            comms = self.clique(devices, operation)
            streams = [b.cuda.stream(dev) for dev in devices]
            with b.calling(operation):
                if prepare is not None:
                    for d, dev in enumerate(devices):
                        with b.cuda.guard(dev):
                            prepare(d)

                def calls() -> None:
                    for d, dev in enumerate(devices):
                        with b.cuda.guard(dev):
                            issue(d, comms[d], b.cuda.handle(streams[d]))

                b.grouped(calls)
                events = []
                for d, dev in enumerate(devices):
                    with b.cuda.guard(dev):
                        finish(d)
                        events.append(b.cuda.record(streams[d], dev))
        return NcclWork(operation + "_multigpu", result, events=events)

    # --------------------------------------------------------------- collectives
    def all_reduce(self, tensors: list[torch.Tensor], reduction: Reduction) -> NcclWork:
        b = self.backend
        plan = b.plan(tensors[0].dtype, reduction, "all_reduce_multigpu")
        staging = Staging()
        bufs = [staging.writable(t) for t in tensors]
        total = b.size * len(tensors)

        def prepare(d: int) -> None:
            if plan.prescale:
                prescale_(bufs[d], reduction)

        def issue(d: int, comm: Any, stream: int) -> None:
            view = reduce_view(bufs[d], plan)
            if view.numel():
                comm.allReduce(ptr(view), ptr(view), view.numel(), plan.nccl_type, plan.nccl_op, stream)

        def finish(d: int) -> None:
            if plan.divide:
                average_(bufs[d], total)
            _copy_back(tensors[d], bufs[d])

        return self.run("all_reduce", tensors, issue, finish, tensors, prepare)

    def reduce(self, tensors: list[torch.Tensor], root: int, reduction: Reduction, dst_tensor: int) -> NcclWork:
        b = self.backend
        plan = b.plan(tensors[0].dtype, reduction, "reduce_multigpu")
        staging = Staging()
        bufs = [staging.writable(t) for t in tensors]
        n = len(tensors)
        nccl_root = root * n + dst_tensor

        def prepare(d: int) -> None:
            if plan.prescale:
                prescale_(bufs[d], reduction)

        def issue(d: int, comm: Any, stream: int) -> None:
            view = reduce_view(bufs[d], plan)
            if view.numel():
                comm.reduce(ptr(view), ptr(view), view.numel(), plan.nccl_type, plan.nccl_op, nccl_root, stream)

        def finish(d: int) -> None:
            if plan.divide and b.rank == root and d == dst_tensor:
                average_(bufs[d], b.size * n)
            _copy_back(tensors[d], bufs[d])

        return self.run("reduce", tensors, issue, finish, tensors, prepare)

    def broadcast(self, tensors: list[torch.Tensor], root: int, src_tensor: int) -> NcclWork:
        b = self.backend
        staging = Staging()
        bufs = [staging.writable(t) for t in tensors]
        nccl_root = root * len(tensors) + src_tensor

        def issue(d: int, comm: Any, stream: int) -> None:
            if nbytes(bufs[d]):
                comm.broadcast(ptr(bufs[d]), ptr(bufs[d]), nbytes(bufs[d]), b.byte_type, nccl_root, stream)

        def finish(d: int) -> None:
            _copy_back(tensors[d], bufs[d])

        return self.run("broadcast", tensors, issue, finish, tensors)

    def all_gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> NcclWork:
        import torch

        b = self.backend
        total = b.size * len(inputs)
        srcs = [readable(t) for t in inputs]
        flats: list[Any] = [None] * len(inputs)

        def issue(d: int, comm: Any, stream: int) -> None:
            src = srcs[d]
            flats[d] = torch.empty((total, *src.shape), dtype=src.dtype, device=src.device)
            if nbytes(src):
                comm.allGather(ptr(src), ptr(flats[d]), nbytes(src), b.byte_type, stream)

        def finish(d: int) -> None:
            for r, out in enumerate(output_lists[d]):
                out.copy_(flats[d][r].reshape(out.shape))

        result = [t for outs in output_lists for t in outs]
        return self.run("all_gather", inputs, issue, finish, result)


def _guard(backend: NcclBackend, device: int) -> Callable[[], Any]:
    return lambda: backend.cuda.guard(device)


def _copy_back(target: torch.Tensor, buf: torch.Tensor) -> None:
    """Copy a staged buffer back into its (non-contiguous) original, on that device's stream."""
    if buf is not target:
        target.copy_(buf)
