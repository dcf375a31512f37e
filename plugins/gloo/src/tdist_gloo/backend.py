"""The ``gloo`` backend: one ``torch.distributed.ProcessGroupGloo`` per tdist process group.

The process group is built directly (never through torch's ``init_process_group``),
rendezvousing through tdist's store seen as a ``torch.distributed.Store``
(:class:`~tdist_gloo.store_bridge.StoreBridge`); a program may therefore use tdist
and torch.distributed side by side in one process.

What gloo lacks is built on what it has (see README.md for the table):

* dtypes gloo cannot carry (int16, uint16/32/64, float8, complex for most
  operations, ...) travel as their bytes for the operations that only move data;
* reductions gloo cannot do on a dtype run on a wider one (int16/uint16/uint32 on
  int64, float8 on float32) and are cast back; uint64 is reduced as int64 (MIN/MAX with
  the sign bit flipped so the order is unsigned); complex SUM/AVG/PREMUL_SUM run on the
  real view;
* PREMUL_SUM multiplies by the factor and sums; gloo's native AVG is used for floating-point
  tensors; integer AVG (NCCL's: truncated toward zero) is gloo's SUM, then a division;
* all_to_all with tensors of different sizes goes through alltoall_base;
* CUDA reduce_scatter goes through allreduce.

Combinations torch.distributed rejects (bitwise reductions of floating-point or
complex tensors, PRODUCT/MIN/MAX of complex ones, AVG of bool, PREMUL_SUM of
integers by a non-integer factor) raise ``TypeError`` (as tdist.reduction.check_reduction
does) naming the operation and the backend before anything is communicated.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from tdist.plugin import Backend, DistBackendError, DistError, ReduceOp, Reduction, Work, backend_error, finalize_, flag

from . import BACKEND_NAME, CHECK_ENV
from .devices import make_devices
from .plans import (
    BROADCAST_DTYPES,
    NATIVE,
    Plan,
    chain,
    flat_view,
    input_buffer,
    io_buffer,
    make_plan,
    output_buffer,
    rows_view,
)
from .store_bridge import StoreBridge
from .torch_gloo import PG, c10d
from .work import GlooWork, map_error

__all__ = ["GlooBackend", "GlooWork", "create_backend", "map_error", "make_devices"]

_AVG = Reduction(ReduceOp.AVG)


# ------------------------------------------------------------------ backend
class GlooBackend(Backend):
    """tdist's ``gloo`` backend: a ``ProcessGroupGloo`` for one tdist process group."""

    name = BACKEND_NAME

    def __init__(
        self,
        store: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        options: Optional[Mapping[str, Any]] = None,
        global_ranks: Optional[Sequence[int]] = None,
    ) -> None:
        super().__init__(rank, size, timeout)
        options = dict(options or {})
        self.global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        self.store = store
        self._bridge = StoreBridge(store)
        gloo_options = PG._Options()
        gloo_options._timeout = timeout
        threads = options.get("gloo_threads")
        if threads:
            gloo_options._threads = int(threads)
        try:
            gloo_options.global_ranks_in_group = self.global_ranks
        except Exception:  # older torch: informative only
            pass
        try:
            gloo_options._devices = make_devices(store, options)
            self._pg = PG(self._bridge, rank, size, gloo_options)
        except DistError:
            raise
        except Exception as exc:
            what = f"rank {rank} of {size} connecting its group (global ranks {self.global_ranks})"
            error = backend_error(BACKEND_NAME, what, exc, f"{str(exc).strip()} (within {timeout.total_seconds():g} s)")
            raise error from exc
        self.gloo_devices = list(gloo_options._devices)
        self._plans: dict = {}
        self._bcast_opts: dict = {}
        self._reduce_opts: dict = {}
        self._gather_opts: dict = {}
        self._scatter_opts: dict = {}
        self._a2a_opts = c10d.AllToAllOptions()
        self._ag_opts = c10d.AllgatherOptions()
        self._barrier_opts = c10d.BarrierOptions()
        self._closed = False
        self._aborted = False
        check = options.get("gloo_check_collectives")
        self.check_collectives = flag(CHECK_ENV, value=check)

    @property
    def process_group(self) -> Any:
        """The underlying ``torch.distributed.ProcessGroupGloo``."""
        return self._pg

    def __repr__(self) -> str:
        return f"<GlooBackend rank={self.rank} size={self.size} ranks={self.global_ranks}>"

    # ---------------------------------------------------------------- helpers
    def _plan_for(self, reduction: Any, dtype: Any, operation: str) -> Plan:
        key = (reduction.op, dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = make_plan(reduction.op, dtype, operation, reduction.factor)
            if reduction.op is not ReduceOp.PREMUL_SUM:  # PREMUL's plan depends on its factor
                self._plans[key] = plan
        return plan

    def _options(self, cache: dict, factory: Callable[[], Any], root: int, torch_op: Any = None) -> Any:
        key = (root, torch_op)
        opts = cache.get(key)
        if opts is None:
            opts = factory()
            opts.rootRank = root
            if torch_op is not None:
                opts.reduceOp = torch_op
            cache[key] = opts
        return opts

    def _averaged(self, plan: Plan, finish: Optional[Callable[[], Any]], result: Any) -> Optional[Callable[[], Any]]:
        """``finish``, then, for an integer AVG (gloo summed it), ``result`` divided by the
        group size, truncated toward zero."""
        if not plan.divide:
            return finish
        size = self.size
        return chain(finish, lambda: finalize_(result, _AVG, size))

    @staticmethod
    def _call(operation: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise map_error(exc, operation) from exc

    # ---------------------------------------------------------- point-to-point
    @staticmethod
    def _tag(operation: str, tag: int) -> int:
        if not 0 <= tag < 2**31:
            raise ValueError(f"{operation}: backend 'gloo' needs a tag in 0 .. 2**31-1, got {tag}")
        return tag

    def send(self, tensor: Any, dst: int, tag: int) -> Work:
        tag = self._tag("send", tag)
        work = self._call("send", self._pg.send, [tensor], dst, tag)
        return GlooWork(work, "send", (tensor,), pollable=False, owner=self)

    def recv(self, tensor: Any, src: Optional[int], tag: int) -> Work:
        tag = self._tag("recv", tag)
        if src is None:
            work = self._call("recv", self._pg.recv_anysource, [tensor], tag)
            return GlooWork(work, "recv", (tensor,), anysource=True, pollable=False, owner=self)
        work = self._call("recv", self._pg.recv, [tensor], src, tag)
        return GlooWork(work, "recv", (tensor,), source=src, pollable=False, owner=self)

    # ------------------------------------------------------------- collectives
    def broadcast(self, tensor: Any, src: int) -> Work:
        opts = self._bcast_opts.get(src)
        if opts is None:
            opts = self._bcast_opts[src] = c10d.BroadcastOptions()
            opts.rootRank = src
        buffer = tensor if tensor.dtype in BROADCAST_DTYPES else flat_view(tensor)
        try:
            work = self._pg.broadcast([buffer], opts)
        except Exception as exc:
            raise map_error(exc, "broadcast") from exc
        return GlooWork(work, "broadcast", (tensor,), owner=self)

    def all_reduce(self, tensor: Any, op: Any) -> Work:
        plan = self._plans.get((op.op, tensor.dtype)) or self._plan_for(op, tensor.dtype, "all_reduce")
        if plan.kind == NATIVE and not plan.prescale and not plan.divide:  # the common case: straight to gloo
            try:
                work = self._pg.allreduce([tensor], plan.ar_opts)
            except Exception as exc:
                raise map_error(exc, "all_reduce") from exc
            return GlooWork(work, "all_reduce", (tensor,), owner=self)
        buffer, finish = io_buffer(plan, tensor, op.factor)
        work = self._call("all_reduce", self._pg.allreduce, [buffer], plan.ar_opts)
        return GlooWork(work, "all_reduce", (tensor,), post=self._averaged(plan, finish, tensor), owner=self)

    def reduce(self, tensor: Any, dst: int, op: Any) -> Work:
        plan = self._plan_for(op, tensor.dtype, "reduce")
        buffer, finish = io_buffer(plan, tensor, op.factor)
        opts = self._options(self._reduce_opts, c10d.ReduceOptions, dst, plan.torch_op)
        work = self._call("reduce", self._pg.reduce, [buffer], opts)
        if self.rank == dst:
            finish = self._averaged(plan, finish, tensor)
        return GlooWork(work, "reduce", (tensor,), post=finish, owner=self)

    def all_gather(self, outputs: Sequence[Any], tensor: Any) -> Work:
        flat_outputs = [[flat_view(out) for out in outputs]]
        work = self._call("all_gather", self._pg.allgather, flat_outputs, [flat_view(tensor)], self._ag_opts)
        return GlooWork(work, "all_gather", tuple(outputs), owner=self)

    def all_gather_into_tensor(self, output: Any, tensor: Any) -> Work:
        work = self._call(
            "all_gather_into_tensor", self._pg._allgather_base, flat_view(output), flat_view(tensor), self._ag_opts
        )
        return GlooWork(work, "all_gather_into_tensor", (output,), owner=self)

    def gather(self, tensor: Any, outputs: Optional[Sequence[Any]], dst: int) -> Work:
        opts = self._options(self._gather_opts, c10d.GatherOptions, dst)
        flat_outputs = [[flat_view(out) for out in outputs]] if self.rank == dst and outputs is not None else []
        work = self._call("gather", self._pg.gather, flat_outputs, [flat_view(tensor)], opts)
        return GlooWork(work, "gather", tuple(outputs) if outputs is not None else (), owner=self)

    def scatter(self, tensor: Any, inputs: Optional[Sequence[Any]], src: int) -> Work:
        opts = self._options(self._scatter_opts, c10d.ScatterOptions, src)
        flat_inputs = [[flat_view(inp) for inp in inputs]] if self.rank == src and inputs is not None else []
        work = self._call("scatter", self._pg.scatter, [flat_view(tensor)], flat_inputs, opts)
        return GlooWork(work, "scatter", (tensor,), owner=self)

    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: Any) -> Work:
        plan = self._plan_for(op, output.dtype, "reduce_scatter")
        if output.device.type != "cpu":  # gloo's reduce_scatter is host-only: allreduce the whole
            whole = torch.cat([t.reshape(-1) for t in inputs])
            return self._reduce_scatter_whole("reduce_scatter", output, whole, op, plan)
        out_buffer, finish = output_buffer(plan, output)
        in_buffers = [input_buffer(plan, t, op.factor).reshape(-1) for t in inputs]
        work = self._call("reduce_scatter", self._pg.reduce_scatter, [out_buffer.view(-1)], [in_buffers], plan.rs_opts)
        # gloo's reduce_scatter works learn of completion only inside wait() (pollable=False)
        post = self._averaged(plan, finish, output)
        return GlooWork(work, "reduce_scatter", (output,), post=post, pollable=False, owner=self)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: Any) -> Work:
        plan = self._plan_for(op, output.dtype, "reduce_scatter_tensor")
        out_buffer, finish = output_buffer(plan, output)
        in_buffer = input_buffer(plan, tensor, op.factor)
        work = self._call(
            "reduce_scatter_tensor",
            self._pg._reduce_scatter_base,
            out_buffer.reshape(-1),
            in_buffer.reshape(-1),
            plan.rs_opts,
        )
        post = self._averaged(plan, finish, output)
        return GlooWork(work, "reduce_scatter_tensor", (output,), post=post, pollable=False, owner=self)

    def _reduce_scatter_whole(self, operation: str, output: Any, whole: Any, op: Any, plan: Plan) -> Work:
        """reduce_scatter as an allreduce of ``whole`` (a fresh 1-D concatenation of the
        inputs) followed by taking this rank's chunk (the CUDA path)."""
        n = output.numel()
        lo, hi = self.rank * n, (self.rank + 1) * n
        buffer, finish = io_buffer(plan, whole, op.factor)
        work = self._call(operation, self._pg.allreduce, [buffer], plan.ar_opts)
        post = self._averaged(plan, chain(finish, lambda: output.view(-1).copy_(whole[lo:hi])), output)
        return GlooWork(work, operation, (output,), post=post, owner=self)

    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> Work:
        flat_in = [flat_view(t) for t in inputs]
        flat_out = [flat_view(t) for t in outputs]
        in_sizes = [t.numel() for t in flat_in]
        out_sizes = [t.numel() for t in flat_out]
        send = torch.cat(flat_in)
        recv = torch.empty(sum(out_sizes), dtype=send.dtype, device=send.device)
        work = self._call("all_to_all", self._pg.alltoall_base, recv, send, out_sizes, in_sizes, self._a2a_opts)

        def post() -> None:
            for target, piece in zip(flat_out, recv.split(out_sizes)):
                target.copy_(piece)

        return GlooWork(work, "all_to_all", tuple(outputs), post=post, owner=self)

    def all_to_all_single(
        self, output: Any, tensor: Any, output_split_sizes: Sequence[int], input_split_sizes: Sequence[int]
    ) -> Work:
        work = self._call(
            "all_to_all_single",
            self._pg.alltoall_base,
            rows_view(output),
            rows_view(tensor),
            list(output_split_sizes),
            list(input_split_sizes),
            self._a2a_opts,
        )
        return GlooWork(work, "all_to_all_single", (output,), owner=self)

    def barrier(self) -> Work:
        work = self._call("barrier", self._pg.barrier, self._barrier_opts)
        return GlooWork(work, "barrier", owner=self)

    def _broken(self, exc: BaseException) -> None:
        """An operation failed inside gloo: the group's connections are unusable now, and a peer
        waiting on this rank would only notice at its timeout (``ProcessGroupGloo.abort`` does not
        close them). Release the torch group -- its connections close when the last reference
        goes -- so that every peer's pending operation fails at once. Later calls on this group
        raise DistBackendError naming the first failure."""
        if self._aborted:
            return
        self._aborted = True
        pg, self._pg = self._pg, _BrokenGroup(self.global_ranks, map_error(exc, "an earlier operation"))
        if pg is None:
            return
        try:
            pg.abort()
        except Exception:  # best effort: the group is failing anyway
            pass
        # The torch group's destructor waits for its queued operations: drop it off this thread.
        threading.Thread(target=_release, args=([pg],), name="tdist-gloo-release", daemon=True).start()
        del pg

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._pg._set_default_timeout(timeout)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        pg, self._pg = self._pg, None
        try:
            pg.shutdown()
        except Exception:  # an already broken group has nothing left to release
            pass


def _release(holder: list) -> None:
    holder.clear()  # the last reference: ProcessGroupGloo's destructor closes its connections


class _BrokenGroup:
    """Stands for a torch gloo group released after a failure: every use raises."""

    def __init__(self, ranks: Sequence[int], cause: BaseException) -> None:
        self._ranks = list(ranks)
        self._cause = cause

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise DistBackendError(
            f"gloo: group {self._ranks} is unusable after an earlier failure ({self._cause}); "
            "destroy it and create a new one"
        ) from self._cause


def create_backend(
    *,
    store: Any,
    rank: int,
    world_size: int,
    timeout: timedelta,
    options: Optional[Mapping[str, Any]] = None,
    global_ranks: Optional[Sequence[int]] = None,
    **_ignored: Any,
) -> GlooBackend:
    """The tdist factory: a :class:`GlooBackend` for one process group."""
    return GlooBackend(store, rank, world_size, timeout, options, global_ranks)
