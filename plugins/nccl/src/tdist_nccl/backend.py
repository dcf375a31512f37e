"""``NcclBackend``: tdist's backend contract on NCCL communicators (through CuPy).

One NCCL communicator per process group, on one CUDA device. It is created at the
group's first CUDA operation, on the device of that operation's tensors (as torch
does without ``device_id``), or at once when ``pg_options={"device_id": N}`` names
the device. Rank 0 makes the NCCL unique id and shares it through the group's store.

Operations are queued on torch's current stream of the tensors' device and return
an :class:`~.work.NcclWork` completing on a CUDA event. How each one maps to NCCL:

- broadcast, all_gather(_into_tensor), all_to_all(_single), gather, scatter,
  send/recv move bytes (``NCCL_UINT8``), so every dtype works;
- all_reduce, reduce, reduce_scatter(_tensor) use :func:`.dtypes.plan_reduction`:
  AVG is ``ncclAvg`` on NCCL >= 2.10, else SUM then a division; PREMUL_SUM multiplies
  each contribution by the factor, then SUM; BAND/BOR/BXOR are refused;
- all_to_all(_single), gather and scatter are send/recv pairs between groupStart and
  groupEnd; the local piece is a device copy;
- barrier is an all_reduce of a one-element tensor whose Work blocks the host;
- send/recv (and isend/irecv) are *queued* and issued together, in one NCCL group,
  when one of their Works is waited on or polled, or before the next collective, so
  batch_isend_irecv and crossing isend/irecv pairs cannot deadlock. NCCL has no
  tags: messages between two ranks match in order. Receiving from any source is
  impossible with NCCL and refused before anything is sent.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from tdist import Backend, DistBackendError, DistError, Reduction, Work
from tdist.plugin import backend_error, prescale_, prescaled

from . import BACKEND_NAME
from .buffers import Staging, nbytes, ptr, readable
from .comm import load_nccl, nccl_version, new_communicator, share_unique_id
from .cuda import TorchCuda
from .dtypes import BYTE_TYPE_NAME, ReducePlan, average_, plan_reduction, reduce_view
from .multigpu import MultiGpu
from .work import NcclWork

if TYPE_CHECKING:
    import torch

__all__ = ["NcclBackend", "create_backend", "parse_device"]

UNIQUE_ID_KEY = "nccl/unique_id"


@dataclass(eq=False)  # compared by identity, never field by field (they hold tensors)
class _P2P:
    """A queued send or receive."""

    kind: str
    tensor: torch.Tensor
    peer: int
    device: int
    stream: Any
    work: NcclWork


class NcclBackend(Backend):
    """The NCCL engine of one process group (group ranks, one CUDA device)."""

    name = BACKEND_NAME

    def __init__(
        self,
        *,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        nccl: Any,
        cuda: Any = None,
        device: Optional[int] = None,
        global_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(rank, size, timeout)
        self.store = store
        self.nccl = nccl
        self.cuda = cuda if cuda is not None else TorchCuda()
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        self.version = nccl_version(nccl)
        self.byte_type = int(getattr(nccl, BYTE_TYPE_NAME))
        self.lock = threading.RLock()
        self.comm: Any = None
        self.device: Optional[int] = None
        self._pending: list[_P2P] = []
        self._closed = False
        self.multigpu = MultiGpu(self)
        if device is not None:
            self.communicator(device, "init_process_group")

    # ------------------------------------------------------------------ plumbing
    def communicator(self, device: int, operation: str) -> Any:
        """The group's communicator, created on ``device`` at first use (blocks until every rank joins)."""
        if self.comm is None:
            with self.calling(operation):
                uid = share_unique_id(self.nccl, self.store, UNIQUE_ID_KEY, self.rank, self.timeout)
                self.comm = new_communicator(self.nccl, self.size, uid, self.rank, lambda: self.cuda.guard(device))
            self.device = device
        elif device != self.device:
            self.check_device(device, operation)
        return self.comm

    def check_device(self, device: int, operation: str) -> None:
        """A ValueError if the group's communicator lives on another device than ``device``."""
        if self.device is not None and device != self.device:
            raise ValueError(
                f"nccl {operation}: this group's NCCL communicator is on cuda:{self.device}, the tensor on "
                f"cuda:{device}; use one device per process and group (call torch.cuda.set_device before the "
                "first operation, or pass pg_options={'device_id': N})"
            )

    @contextlib.contextmanager
    def calling(self, operation: str) -> Iterator[None]:
        """Turn NCCL/CUDA failures into DistBackendError (tdist's own errors pass through)."""
        try:
            yield
        except (DistError, ValueError, TypeError):
            raise
        except Exception as exc:
            raise backend_error(BACKEND_NAME, operation, exc, f"{type(exc).__name__}: {exc}") from exc

    def check_open(self, operation: str) -> None:
        if self._closed:
            raise DistBackendError(f"nccl {operation}: the process group was destroyed")

    def device_of(self, tensors: Sequence[torch.Tensor], operation: str) -> int:
        """The one CUDA device of ``tensors`` (a ValueError if they are on several)."""
        devices = {self.cuda.device_index(t, operation) for t in tensors}
        if len(devices) != 1:
            raise ValueError(f"nccl {operation}: tensors must all be on one CUDA device, got {sorted(devices)}")
        device = devices.pop()
        self.check_device(device, operation)
        return device

    def plan(self, dtype: Any, reduction: Reduction, operation: str) -> ReducePlan:
        return plan_reduction(self.nccl, self.version, dtype, reduction, operation)

    def run(
        self,
        operation: str,
        tensors: Sequence[torch.Tensor],
        issue: Callable[[Any, int], None],
        result: Sequence[torch.Tensor] = (),
        blocking: bool = False,
    ) -> NcclWork:
        """Issue one operation on the current stream of ``tensors``' device: flush queued
        point-to-point first, call ``issue(comm, stream_handle)``, record an event."""
        device = self.device_of(tensors, operation)
        with self.lock:
            self.check_open(operation)
            self.flush()
            comm = self.communicator(device, operation)
            with self.calling(operation), self.cuda.guard(device):
                stream = self.cuda.stream(device)
                issue(comm, self.cuda.handle(stream))
                event = self.cuda.record(stream, device)
        return NcclWork(operation, result, blocking=blocking, events=[event])

    def grouped(self, calls: Callable[[], None]) -> None:
        """Run ``calls`` (NCCL calls) between groupStart and groupEnd."""
        self.nccl.groupStart()
        try:
            calls()
        finally:
            self.nccl.groupEnd()

    # ------------------------------------------------------------- point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self._enqueue("send", readable(tensor), dst)

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Work:
        if src is None:
            raise ValueError("nccl recv: NCCL cannot receive from any source (src=None): name the sending rank")
        if not tensor.is_contiguous():
            raise ValueError("nccl recv: the receive buffer must be contiguous")
        return self._enqueue("recv", tensor, src)

    def _enqueue(self, kind: str, tensor: torch.Tensor, peer: int) -> NcclWork:
        device = self.device_of([tensor], kind)
        stream = self.cuda.stream(device)
        work = NcclWork(
            kind, [tensor] if kind == "recv" else [], source_rank=peer if kind == "recv" else -1, flush=self.flush
        )
        with self.lock:
            self.check_open(kind)
            if self._pending and self._pending[0].device != device:
                raise ValueError(
                    f"nccl {kind}: queued sends/receives of this group are on cuda:{self._pending[0].device}, "
                    f"this tensor is on cuda:{device}; use one device per process and group"
                )
            if self._pending and self.cuda.handle(self._pending[0].stream) != self.cuda.handle(stream):
                self.flush()  # one NCCL group call uses one stream
            self._pending.append(_P2P(kind, tensor, peer, device, stream, work))
        return work

    def flush(self) -> None:
        """Issue every queued send and receive, together, in one NCCL group call."""
        with self.lock:
            if not self._pending:
                return
            ops, self._pending = self._pending, []
            device = ops[0].device
            try:
                comm = self.communicator(device, "send/recv")
                stream = ops[0].stream
                handle = self.cuda.handle(stream)
                with self.calling("send/recv"), self.cuda.guard(device):
                    self.grouped(lambda: self._p2p_calls(comm, ops, handle))
                    event = self.cuda.record(stream, device)
            except BaseException as exc:
                for op in ops:
                    op.work.fail(exc)
                raise
            for op in ops:
                op.work.attach([event])

    def _p2p_calls(self, comm: Any, ops: Sequence[_P2P], handle: int) -> None:
        for op in ops:
            size = nbytes(op.tensor)
            if size == 0:
                continue
            call = comm.send if op.kind == "send" else comm.recv
            call(ptr(op.tensor), size, self.byte_type, op.peer, handle)

    # -------------------------------------------------------------- collectives
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        staging = Staging()
        buf = staging.writable(tensor)

        def issue(comm: Any, stream: int) -> None:
            if nbytes(buf):
                comm.broadcast(ptr(buf), ptr(buf), nbytes(buf), self.byte_type, src, stream)
            staging.copy_back()

        return self.run("broadcast", [tensor], issue, [tensor])

    def all_reduce(self, tensor: torch.Tensor, op: Reduction) -> Work:
        plan = self.plan(tensor.dtype, op, "all_reduce")
        staging = Staging()
        buf = staging.writable(tensor)

        def issue(comm: Any, stream: int) -> None:
            if plan.prescale:
                prescale_(buf, op)
            view = reduce_view(buf, plan)
            if view.numel():
                comm.allReduce(ptr(view), ptr(view), view.numel(), plan.nccl_type, plan.nccl_op, stream)
            if plan.divide:
                average_(buf, self.size)
            staging.copy_back()

        return self.run("all_reduce", [tensor], issue, [tensor])

    def reduce(self, tensor: torch.Tensor, dst: int, op: Reduction) -> Work:
        plan = self.plan(tensor.dtype, op, "reduce")
        staging = Staging()
        buf = staging.writable(tensor)

        def issue(comm: Any, stream: int) -> None:
            if plan.prescale:
                prescale_(buf, op)
            view = reduce_view(buf, plan)
            if view.numel():
                comm.reduce(ptr(view), ptr(view), view.numel(), plan.nccl_type, plan.nccl_op, dst, stream)
            if plan.divide and self.rank == dst:
                average_(buf, self.size)
            staging.copy_back()

        return self.run("reduce", [tensor], issue, [tensor])

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        import torch

        src = readable(tensor)

        def issue(comm: Any, stream: int) -> None:
            flat = torch.empty((self.size, *src.shape), dtype=src.dtype, device=src.device)
            if nbytes(src):
                comm.allGather(ptr(src), ptr(flat), nbytes(src), self.byte_type, stream)
            for i, out in enumerate(outputs):
                out.copy_(flat[i].reshape(out.shape))

        return self.run("all_gather", [tensor, *outputs], issue, list(outputs))

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        src = readable(tensor)
        staging = Staging()
        out = staging.writable(output)

        def issue(comm: Any, stream: int) -> None:
            if nbytes(src):
                comm.allGather(ptr(src), ptr(out), nbytes(src), self.byte_type, stream)
            staging.copy_back()

        return self.run("all_gather_into_tensor", [output, tensor], issue, [output])

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: Reduction) -> Work:
        import torch

        plan = self.plan(output.dtype, op, "reduce_scatter")

        def issue(comm: Any, stream: int) -> None:
            flat = torch.cat([readable(t).reshape(-1) for t in inputs])  # a copy: prescaling it is safe
            self._reduce_scatter_flat(comm, stream, output, flat, op, plan)

        return self.run("reduce_scatter", [output, *inputs], issue, [output])

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, op: Reduction) -> Work:
        plan = self.plan(output.dtype, op, "reduce_scatter_tensor")

        def issue(comm: Any, stream: int) -> None:
            src = prescaled(readable(tensor), op) if plan.prescale else readable(tensor)
            self._reduce_scatter_flat(comm, stream, output, src.reshape(-1), op, plan, prescaled_already=True)

        return self.run("reduce_scatter_tensor", [output, tensor], issue, [output])

    def _reduce_scatter_flat(
        self,
        comm: Any,
        stream: int,
        output: torch.Tensor,
        flat: torch.Tensor,
        op: Reduction,
        plan: ReducePlan,
        prescaled_already: bool = False,
    ) -> None:
        staging = Staging()
        out = staging.writable(output)
        if plan.prescale and not prescaled_already:
            prescale_(flat, op)
        send, recv = reduce_view(flat, plan), reduce_view(out, plan)
        if recv.numel():
            comm.reduceScatter(ptr(send), ptr(recv), recv.numel(), plan.nccl_type, plan.nccl_op, stream)
        if plan.divide:
            average_(out, self.size)
        staging.copy_back()

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        return self._all_to_all("all_to_all", list(outputs), list(inputs))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        staging = Staging()
        out = staging.writable(output)
        inputs = list(readable(tensor).split(list(input_split_sizes)))
        outputs = list(out.split(list(output_split_sizes)))
        return self._all_to_all("all_to_all_single", outputs, inputs, staging, [output])

    def _all_to_all(
        self,
        operation: str,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        staging: Optional[Staging] = None,
        result: Optional[list[torch.Tensor]] = None,
    ) -> Work:
        staging = staging or Staging()
        outs = [staging.writable(t) for t in outputs]
        ins = [readable(t) for t in inputs]

        def calls(comm: Any, stream: int) -> None:
            for peer in range(self.size):
                if peer == self.rank:
                    continue
                if nbytes(ins[peer]):
                    comm.send(ptr(ins[peer]), nbytes(ins[peer]), self.byte_type, peer, stream)
                if nbytes(outs[peer]):
                    comm.recv(ptr(outs[peer]), nbytes(outs[peer]), self.byte_type, peer, stream)

        def issue(comm: Any, stream: int) -> None:
            if self.size > 1:
                self.grouped(lambda: calls(comm, stream))
            outs[self.rank].copy_(ins[self.rank].reshape(outs[self.rank].shape))
            staging.copy_back()

        return self.run(operation, [*outputs, *inputs], issue, result if result is not None else outputs)

    def gather(self, tensor: torch.Tensor, outputs: Optional[Sequence[torch.Tensor]], dst: int) -> Work:
        src = readable(tensor)
        staging = Staging()
        outs = [staging.writable(t) for t in outputs] if self.rank == dst and outputs is not None else []

        def calls(comm: Any, stream: int) -> None:
            if self.rank != dst:
                if nbytes(src):
                    comm.send(ptr(src), nbytes(src), self.byte_type, dst, stream)
                return
            for peer, out in enumerate(outs):
                if peer != dst and nbytes(out):
                    comm.recv(ptr(out), nbytes(out), self.byte_type, peer, stream)

        def issue(comm: Any, stream: int) -> None:
            if self.size > 1:
                self.grouped(lambda: calls(comm, stream))
            if outs:
                outs[dst].copy_(src.reshape(outs[dst].shape))
            staging.copy_back()

        return self.run("gather", [tensor, *(outputs or [])], issue, list(outputs or []))

    def scatter(self, tensor: torch.Tensor, inputs: Optional[Sequence[torch.Tensor]], src: int) -> Work:
        staging = Staging()
        out = staging.writable(tensor)
        ins = [readable(t) for t in inputs] if self.rank == src and inputs is not None else []

        def calls(comm: Any, stream: int) -> None:
            if self.rank != src:
                if nbytes(out):
                    comm.recv(ptr(out), nbytes(out), self.byte_type, src, stream)
                return
            for peer, piece in enumerate(ins):
                if peer != src and nbytes(piece):
                    comm.send(ptr(piece), nbytes(piece), self.byte_type, peer, stream)

        def issue(comm: Any, stream: int) -> None:
            if self.size > 1:
                self.grouped(lambda: calls(comm, stream))
            if ins:
                out.copy_(ins[src].reshape(out.shape))
            staging.copy_back()

        return self.run("scatter", [tensor, *(inputs or [])], issue, [tensor])

    def barrier(self) -> Work:
        """A one-element float32 SUM all_reduce on the group's device; its Work blocks the host."""
        device = self.device if self.device is not None else self.cuda.current_device()
        token = self.cuda.zeros(1, device)
        f32, total = int(self.nccl.NCCL_FLOAT32), int(self.nccl.NCCL_SUM)

        def issue(comm: Any, stream: int) -> None:
            comm.allReduce(ptr(token), ptr(token), 1, f32, total, stream)

        return self.run("barrier", [token], issue, blocking=True)

    # -------------------------------------------------------- multi-GPU collectives
    def all_reduce_multigpu(self, tensors: Sequence[torch.Tensor], reduction: Reduction) -> Work:
        """All-reduce over every tensor of every rank (one tensor per local GPU)."""
        return self.multigpu.all_reduce(list(tensors), reduction)

    def reduce_multigpu(
        self, tensors: Sequence[torch.Tensor], root_group_rank: int, reduction: Reduction, dst_tensor: int
    ) -> Work:
        """Reduce every tensor of every rank into ``tensors[dst_tensor]`` of ``root_group_rank``."""
        return self.multigpu.reduce(list(tensors), root_group_rank, reduction, dst_tensor)

    def broadcast_multigpu(self, tensors: Sequence[torch.Tensor], root_group_rank: int, src_tensor: int) -> Work:
        """Broadcast ``tensors[src_tensor]`` of ``root_group_rank`` into every tensor of every rank."""
        return self.multigpu.broadcast(list(tensors), root_group_rank, src_tensor)

    def all_gather_multigpu(
        self, output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor]
    ) -> Work:
        """``output_lists[i][k * len(inputs) + j]`` receives input j of rank k."""
        return self.multigpu.all_gather([list(o) for o in output_lists], list(inputs))

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Issue what is still queued, then destroy the communicators."""
        with self.lock:
            if self._closed:
                return
            try:
                self.flush()
            except Exception:
                pass  # the Works of those operations carry the error
            finally:
                self._closed = True
                comms = ([self.comm] if self.comm is not None else []) + self.multigpu.communicators()
                self.comm = None
                self.multigpu.forget()
                for comm in comms:
                    with contextlib.suppress(Exception):
                        comm.destroy()


def parse_device(device_id: Any) -> Optional[int]:
    """``pg_options["device_id"]``: None, an int, ``"cuda:N"`` or a ``torch.device``, as an index."""
    if device_id is None:
        return None
    if isinstance(device_id, bool):
        raise TypeError(f"nccl: device_id must be a CUDA device, got {device_id!r}")
    if isinstance(device_id, int):
        return device_id
    kind = getattr(device_id, "type", None)
    if kind is not None:
        if kind != "cuda":
            raise ValueError(f"nccl: device_id must be a CUDA device, got {device_id}")
        return getattr(device_id, "index", None) or 0
    text = str(device_id)
    if text.startswith("cuda:") and text[5:].isdigit():
        return int(text[5:])
    raise ValueError(f"nccl: device_id must be an int, 'cuda:N' or a torch.device, got {device_id!r}")


def create_backend(
    *,
    store: Any,
    rank: int,
    world_size: int,
    timeout: timedelta,
    options: Optional[dict[str, Any]] = None,
    global_ranks: Optional[Sequence[int]] = None,
    **_ignored: Any,  # later versions of the factory contract may pass more (e.g. secret=)
) -> NcclBackend:
    """The factory the ``nccl`` BackendSpec registers."""
    import torch

    nccl = load_nccl()
    if not torch.cuda.is_available():
        raise DistBackendError("nccl backend: no CUDA device visible (torch.cuda.is_available() is False)")
    device = parse_device((options or {}).get("device_id"))
    return NcclBackend(
        store=store,
        rank=rank,
        size=world_size,
        timeout=timeout,
        nccl=nccl,
        cuda=TorchCuda(),
        device=device,
        global_ranks=global_ranks,
    )
