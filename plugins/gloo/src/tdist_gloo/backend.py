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
* PREMUL_SUM multiplies by the factor and sums; gloo's native AVG is used where it has one;
* all_to_all with tensors of different sizes goes through alltoall_base;
* CUDA reduce_scatter goes through allreduce.

Combinations torch.distributed rejects (bitwise reductions of floating-point or
complex tensors, PRODUCT/MIN/MAX of complex ones, AVG of integers, PREMUL_SUM of
integers by a non-integer factor) raise ``TypeError`` (as tdist.reduction.check_reduction
does) naming the operation and the backend before anything is communicated.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as _td

from tdist.plugin import (
    Backend,
    DistBackendError,
    DistBackendTimeoutError,
    DistError,
    ReduceOp,
    Work,
    flag,
    local_address_for,
    premul_factor,
)

from . import BACKEND_NAME
from .store_bridge import StoreBridge

__all__ = ["GlooBackend", "GlooWork", "create_backend", "map_error", "local_address_for", "make_devices"]

_c10d = torch._C._distributed_c10d
_PG: Any = _c10d.ProcessGroupGloo  # torch's stubs list few of its methods and options
_R = _td.ReduceOp

# ------------------------------------------------------------------- errors
_TIMEOUT_MARKERS = ("timed out", "timeout", "deadline exceeded")


def _is_timeout(exc: BaseException, message: str) -> bool:
    if isinstance(exc, TimeoutError):
        return True
    low = message.lower()
    return any(marker in low for marker in _TIMEOUT_MARKERS)


def map_error(exc: BaseException, operation: str) -> BaseException:
    """A tdist error for what gloo/torch raised during ``operation``, keeping its message.

    tdist errors pass unchanged; gloo timeouts become :class:`DistBackendTimeoutError`,
    everything else :class:`DistBackendError`; the original is the ``__cause__``.
    """
    if isinstance(exc, DistError) or not isinstance(exc, Exception):
        return exc
    message = str(exc).strip() or type(exc).__name__
    cls = DistBackendTimeoutError if _is_timeout(exc, message) else DistBackendError
    error = cls(f"{operation}: backend 'gloo' failed: {message}")
    error.__cause__ = exc
    return error


# --------------------------------------------------------------------- work
_WATCH_LOCK = threading.Lock()  # guards starting the helper thread of a GlooWork


class GlooWork(Work):
    """A tdist :class:`~tdist.Work` over a torch gloo ``Work``.

    The torch work is waited on exactly once (by ``wait()`` or a helper thread);
    then the optional ``post`` step (copy-back or final arithmetic of an emulated
    operation) runs and the error, if any, is mapped to a tdist error.
    ``wait(timeout)`` does not hand the timeout to gloo (gloo would abort the
    operation and close its connections): it waits for the helper thread instead,
    and the operation goes on after a timed-out wait.
    """

    __slots__ = ("_work", "_post", "_anysource", "_pollable", "_wait_lock", "_watcher", "_owner")

    def __init__(
        self,
        work: Any,
        op: str,
        result: Sequence[Any] = (),
        post: Optional[Callable[[], None]] = None,
        source: int = -1,
        anysource: bool = False,
        pollable: bool = True,
        owner: Any = None,
    ) -> None:
        super().__init__(op)
        self._owner = owner
        self._work = work
        self._result = result
        self._post = post
        self._source_rank = source
        self._anysource = anysource
        self._pollable = pollable
        self._wait_lock = threading.Lock()
        self._watcher: Optional[threading.Thread] = None

    @classmethod
    def done(cls, op: str, result: Sequence[Any] = ()) -> "GlooWork":
        """A work that completed without communicating (e.g. nothing to send)."""
        work = cls(None, op)
        work.set_result(result)
        return work

    # ------------------------------------------------------------ completion
    def _complete(self) -> None:
        """Block until gloo finished; post-process once; complete the Work."""
        with self._wait_lock:
            if self._done:
                return
            error: Optional[BaseException] = None
            try:
                self._work.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                error = map_error(exc, self.op)
                self._work = None  # it holds the group's connections open
                if self._owner is not None:
                    self._owner._broken(exc)
            else:
                try:
                    if self._anysource:
                        self._source_rank = int(self._work._source_rank())
                    if self._post is not None:
                        self._post()
                except BaseException as exc:  # noqa: BLE001 - re-raised by wait()
                    error = map_error(exc, self.op)
            if error is None:
                self.set_result(self._result, self._source_rank)
            else:
                self.set_exception(error)

    # ------------------------------------------------------- the Work template
    def _poll(self) -> bool:
        work = self._work  # None once a failure released it (then _done follows at once)
        if self._pollable and work is not None and work.is_completed():
            self._complete()
            return True
        # Some gloo works (send/recv, reduce_scatter) only learn of completion inside wait(),
        # and any work may need post-processing: a helper thread waits (started once).
        self._watch()
        return self._done

    def _block(self, timeout: Optional[float]) -> bool:
        if timeout is None:
            self._complete()
            return True
        self._watch()
        return Work._block(self, max(float(timeout), 0.0))

    def _watch(self) -> None:
        """Make sure a helper thread is waiting for completion."""
        with _WATCH_LOCK:
            if self._watcher is None and not self._done:
                self._watcher = threading.Thread(target=self._complete, name=f"tdist-gloo-{self.op}", daemon=True)
                self._watcher.start()


# ------------------------------------------------------------ network device
def make_devices(store: Any, options: Mapping[str, Any]) -> list:
    """gloo devices: ``options["gloo_interface"]`` or ``$GLOO_SOCKET_IFNAME`` (comma-separated
    interface names, one device each), else ``options["gloo_hostname"]`` or
    ``$TDIST_GLOO_HOSTNAME``, else the address that reaches the store's host."""
    lazy = options.get("gloo_lazy_init")
    extra = {} if lazy is None else {"lazy_init": bool(lazy)}
    interfaces = options.get("gloo_interface") or os.environ.get("GLOO_SOCKET_IFNAME", "")
    if isinstance(interfaces, (list, tuple)):
        interfaces = ",".join(interfaces)
    names = [name.strip() for name in str(interfaces).split(",") if name.strip()]
    if names:
        return [_PG.create_device(interface=name, **extra) for name in names]
    hostname = options.get("gloo_hostname") or os.environ.get("TDIST_GLOO_HOSTNAME", "")
    if not hostname:
        hostname = local_address_for(store) or ""
    if hostname:
        return [_PG.create_device(hostname=str(hostname), **extra)]
    return [_PG.create_default_device(**extra)] if extra else [_PG.create_default_device()]


# ------------------------------------------------------------- reductions
_TORCH_OP = {
    ReduceOp.SUM: _R.SUM,
    ReduceOp.PRODUCT: _R.PRODUCT,
    ReduceOp.MIN: _R.MIN,
    ReduceOp.MAX: _R.MAX,
    ReduceOp.BAND: _R.BAND,
    ReduceOp.BOR: _R.BOR,
    ReduceOp.BXOR: _R.BXOR,
    ReduceOp.AVG: _R.AVG,
    ReduceOp.PREMUL_SUM: _R.SUM,  # after multiplying by the factor
}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

#: dtypes gloo reduces and moves itself.
_GLOO_FLOATS = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})
_GLOO_INTS = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64})
_GLOO_DTYPES = _GLOO_FLOATS | _GLOO_INTS | {torch.bool}
#: torch's gloo broadcast also takes complex64/128 (as their real view).
_BROADCAST_DTYPES = _GLOO_DTYPES | {torch.complex64, torch.complex128}
#: integers gloo lacks, reduced as int64 and cast back (wrap-around is preserved).
_WIDENED_INTS = frozenset(d for d in (torch.int16, getattr(torch, "uint16", None), getattr(torch, "uint32", None)) if d)
_UINT64 = getattr(torch, "uint64", None)
_SIGN_BIT = -(2**63)

# plan kinds
_NATIVE, _REAL, _WIDEN, _U64 = range(4)


class _Plan:
    """How one (reduction, dtype) runs on gloo."""

    __slots__ = ("kind", "torch_op", "compute", "prescale", "flip", "ar_opts", "rs_opts")

    def __init__(self, kind: int, torch_op: Any, compute: Any = None, prescale: bool = False, flip: bool = False):
        self.kind = kind
        self.torch_op = torch_op
        self.compute = compute
        self.prescale = prescale
        self.flip = flip
        self.ar_opts = _c10d.AllreduceOptions()
        self.ar_opts.reduceOp = torch_op
        self.rs_opts = _c10d.ReduceScatterOptions()
        self.rs_opts.reduceOp = torch_op


def _unsupported(operation: str, op: ReduceOp, dtype: Any, why: str) -> TypeError:
    return TypeError(f"{operation}: backend 'gloo' cannot reduce {dtype} tensors with ReduceOp.{op.name}: {why}")


def _plan(op: ReduceOp, dtype: Any, operation: str, factor: Any) -> _Plan:
    """Choose how to run reduction ``op`` on ``dtype``, or raise TypeError (nothing sent yet)."""
    torch_op = _TORCH_OP[op]
    premul = op is ReduceOp.PREMUL_SUM
    if dtype.is_complex:
        if op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM):
            return _Plan(_REAL, torch_op, prescale=premul)
        raise _unsupported(
            operation, op, dtype, "complex tensors reduce only with SUM, AVG and PREMUL_SUM (as in torch.distributed)"
        )
    if dtype.is_floating_point:
        if op in _BITWISE:
            raise _unsupported(operation, op, dtype, "bitwise reductions need integer or bool tensors")
        if dtype in _GLOO_FLOATS:
            return _Plan(_NATIVE, torch_op, prescale=premul)
        if dtype.itemsize <= 4:  # float8 and other narrow formats: reduce in float32, round once
            return _Plan(_WIDEN, torch_op, compute=torch.float32, prescale=premul)
        raise _unsupported(operation, op, dtype, "gloo has no arithmetic for this dtype")
    # integers and bool
    if op is ReduceOp.AVG:
        raise _unsupported(operation, op, dtype, "AVG needs floating-point or complex tensors")
    if premul:
        if dtype is torch.bool or _is_float_factor(factor):
            raise _unsupported(operation, op, dtype, "PREMUL_SUM of integer tensors needs an integer factor")
    if dtype in _GLOO_INTS or dtype is torch.bool:
        if premul and dtype is torch.bool:
            raise _unsupported(operation, op, dtype, "PREMUL_SUM is not defined for bool")
        return _Plan(_NATIVE, torch_op, prescale=premul)
    if dtype in _WIDENED_INTS:
        return _Plan(_WIDEN, torch_op, compute=torch.int64, prescale=premul)
    if _UINT64 is not None and dtype == _UINT64:
        return _Plan(_U64, torch_op, compute=torch.int64, prescale=premul, flip=op in (ReduceOp.MIN, ReduceOp.MAX))
    raise _unsupported(operation, op, dtype, "gloo has no arithmetic for this dtype")


def _is_float_factor(factor: Any) -> bool:
    if isinstance(factor, torch.Tensor):
        return factor.dtype.is_floating_point or factor.dtype.is_complex
    return isinstance(factor, (float, complex))


def _io_buffer(plan: _Plan, tensor: Any, factor: Any) -> tuple:
    """(buffer gloo reduces in place, finish step or None) for a tensor that is both
    this rank's contribution and the place of the result (all_reduce, reduce)."""
    kind = plan.kind
    if kind == _NATIVE or kind == _REAL:
        if plan.prescale:
            tensor.mul_(premul_factor(factor, tensor))
        return (torch.view_as_real(tensor) if kind == _REAL else tensor), None
    if kind == _WIDEN:
        buffer = tensor.to(plan.compute)
        if plan.prescale:
            buffer.mul_(premul_factor(factor, buffer))
        return buffer, lambda: tensor.copy_(buffer)
    # _U64: the int64 view of the same bits
    buffer = tensor.view(torch.int64)
    if plan.prescale:
        buffer.mul_(premul_factor(factor, buffer))
    if plan.flip:
        buffer.bitwise_xor_(_SIGN_BIT)
        return buffer, lambda: buffer.bitwise_xor_(_SIGN_BIT)
    return buffer, None


def _in_buffer(plan: _Plan, tensor: Any, factor: Any) -> Any:
    """A buffer with this rank's contribution ``tensor`` (left unchanged)."""
    kind = plan.kind
    if kind == _NATIVE or kind == _REAL:
        if plan.prescale:
            tensor = tensor * premul_factor(factor, tensor)
        return torch.view_as_real(tensor) if kind == _REAL else tensor
    if kind == _WIDEN:
        buffer = tensor.to(plan.compute)
        if plan.prescale:
            buffer.mul_(premul_factor(factor, buffer))
        return buffer
    buffer = tensor.view(torch.int64)
    if plan.prescale:
        buffer = buffer * premul_factor(factor, buffer)
    if plan.flip:
        buffer = buffer ^ _SIGN_BIT
    return buffer


def _out_buffer(plan: _Plan, tensor: Any) -> tuple:
    """(buffer gloo writes the result to, finish step or None) for an output tensor."""
    kind = plan.kind
    if kind == _NATIVE:
        return tensor, None
    if kind == _REAL:
        return torch.view_as_real(tensor), None
    if kind == _WIDEN:
        buffer = torch.empty(tensor.shape, dtype=plan.compute, device=tensor.device)
        return buffer, lambda: tensor.copy_(buffer)
    buffer = tensor.view(torch.int64)
    if plan.flip:
        return buffer, lambda: buffer.bitwise_xor_(_SIGN_BIT)
    return buffer, None


# ------------------------------------------------------------ data movement
def _flat(tensor: Any) -> Any:
    """A 1-D view gloo can carry: the tensor itself for gloo's dtypes, else its bytes."""
    flat = tensor.view(-1)
    return flat if tensor.dtype in _GLOO_DTYPES else flat.view(torch.uint8)


def _rows(tensor: Any) -> Any:
    """A 2-D (dim 0 × rest) view gloo can carry, for alltoall_base's row splits."""
    if tensor.dtype in _GLOO_DTYPES:
        return tensor
    rest = 1
    for extent in tensor.shape[1:]:
        rest *= extent
    return tensor.view(tensor.shape[0], rest).view(torch.uint8)


def _chain(*steps: Optional[Callable[[], Any]]) -> Optional[Callable[[], None]]:
    todo = [step for step in steps if step is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def run() -> None:
        for step in todo:
            step()

    return run


# -------------------------------------------------------- collective checks
_CHECK_ENV = "TDIST_GLOO_CHECK_COLLECTIVES"
_OPCODES = {
    name: code
    for code, name in enumerate(
        (
            "broadcast",
            "all_reduce",
            "reduce",
            "all_gather",
            "all_gather_into_tensor",
            "gather",
            "scatter",
            "reduce_scatter",
            "reduce_scatter_tensor",
            "all_to_all",
            "all_to_all_single",
            "barrier",
        ),
        start=1,
    )
}
_DTYPE_CODES = {
    dtype: code
    for code, dtype in enumerate(
        sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str), start=1
    )
}
_REDUCE_CODES = {op: code for code, op in enumerate(ReduceOp, start=1)}
_CHECK_FIELDS = ("operation", "dtype", "elements", "root", "reduce op")
_MISSING = -1


def _describe(row: list) -> str:
    names = {code: name for name, code in _OPCODES.items()}
    dtypes = {code: str(d).replace("torch.", "") for d, code in _DTYPE_CODES.items()}
    reduces = {code: op.name for op, code in _REDUCE_CODES.items()}
    parts = [names.get(row[0], f"op#{row[0]}")]
    if row[1] != _MISSING:
        parts.append(dtypes.get(row[1], f"dtype#{row[1]}"))
    if row[2] != _MISSING:
        parts.append(f"{row[2]} elements")
    if row[3] != _MISSING:
        parts.append(f"root {row[3]}")
    if row[4] != _MISSING:
        parts.append(f"ReduceOp.{reduces.get(row[4], row[4])}")
    return ", ".join(parts)


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
        gloo_options = _PG._Options()
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
            self._pg = _PG(self._bridge, rank, size, gloo_options)
        except Exception as exc:
            message = str(exc).strip() or type(exc).__name__
            if _is_timeout(exc, message):
                cls: type = DistBackendTimeoutError
            elif isinstance(exc, DistError):
                raise
            else:
                cls = DistBackendError
            raise cls(
                f"gloo: rank {rank} of {size} could not connect its group (global ranks {self.global_ranks}) "
                f"within {timeout.total_seconds():g} s: {message}"
            ) from exc
        self.gloo_devices = list(gloo_options._devices)
        self._plans: dict = {}
        self._bcast_opts: dict = {}
        self._reduce_opts: dict = {}
        self._gather_opts: dict = {}
        self._scatter_opts: dict = {}
        self._a2a_opts = _c10d.AllToAllOptions()
        self._ag_opts = _c10d.AllgatherOptions()
        self._barrier_opts = _c10d.BarrierOptions()
        self._closed = False
        self._aborted = False
        check = options.get("gloo_check_collectives")
        self._check = flag(_CHECK_ENV, value=check)

    @property
    def process_group(self) -> Any:
        """The underlying ``torch.distributed.ProcessGroupGloo``."""
        return self._pg

    def __repr__(self) -> str:
        return f"<GlooBackend rank={self.rank} size={self.size} ranks={self.global_ranks}>"

    # ---------------------------------------------------------------- helpers
    def _plan_for(self, reduction: Any, dtype: Any, operation: str) -> _Plan:
        key = (reduction.op, dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = _plan(reduction.op, dtype, operation, reduction.factor)
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

    @staticmethod
    def _call(operation: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise map_error(exc, operation) from exc

    def _verify(
        self, operation: str, tensor: Any = None, root: int = _MISSING, op: Any = None, elements: bool = True
    ) -> None:
        """With collective checks on: all-gather every rank's description of the collective
        it is issuing and raise DistBackendError on every rank if they differ (else gloo
        would hang or return corrupted data). One extra round trip per collective."""
        row = [
            _OPCODES[operation],
            _DTYPE_CODES.get(tensor.dtype, 0) if tensor is not None else _MISSING,
            tensor.numel() if tensor is not None and elements else _MISSING,
            root,
            _REDUCE_CODES[op.op] if op is not None else _MISSING,
        ]
        mine = torch.tensor(row, dtype=torch.int64)
        table = torch.empty(self.size * len(row), dtype=torch.int64)
        work = self._call(operation, self._pg._allgather_base, table, mine, self._ag_opts)
        try:
            work.wait()
        except Exception as exc:
            self._broken(exc)
            raise map_error(exc, operation) from exc
        rows = table.view(self.size, len(row)).tolist()
        if all(r == rows[0] for r in rows):
            return
        groups: dict = {}
        for rank, r in enumerate(rows):
            groups.setdefault(tuple(r), []).append(self.global_ranks[rank])
        issued = "; ".join(f"rank(s) {ranks}: {_describe(list(key))}" for key, ranks in groups.items())
        raise DistBackendError(
            f"{operation}: ranks of group {self.global_ranks} issued different collectives (backend 'gloo', "
            f"{_CHECK_ENV}): {issued}"
        )

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
        if self._check:
            self._verify("broadcast", tensor, src)
        opts = self._bcast_opts.get(src)
        if opts is None:
            opts = self._bcast_opts[src] = _c10d.BroadcastOptions()
            opts.rootRank = src
        buffer = tensor if tensor.dtype in _BROADCAST_DTYPES else _flat(tensor)
        try:
            work = self._pg.broadcast([buffer], opts)
        except Exception as exc:
            raise map_error(exc, "broadcast") from exc
        return GlooWork(work, "broadcast", (tensor,), owner=self)

    def all_reduce(self, tensor: Any, op: Any) -> Work:
        plan = self._plans.get((op.op, tensor.dtype)) or self._plan_for(op, tensor.dtype, "all_reduce")
        if self._check:
            self._verify("all_reduce", tensor, op=op)
        if plan.kind == _NATIVE and not plan.prescale:  # the common case: straight to gloo
            try:
                work = self._pg.allreduce([tensor], plan.ar_opts)
            except Exception as exc:
                raise map_error(exc, "all_reduce") from exc
            return GlooWork(work, "all_reduce", (tensor,), owner=self)
        buffer, finish = _io_buffer(plan, tensor, op.factor)
        work = self._call("all_reduce", self._pg.allreduce, [buffer], plan.ar_opts)
        return GlooWork(work, "all_reduce", (tensor,), post=finish, owner=self)

    def reduce(self, tensor: Any, dst: int, op: Any) -> Work:
        plan = self._plan_for(op, tensor.dtype, "reduce")
        if self._check:
            self._verify("reduce", tensor, dst, op)
        buffer, finish = _io_buffer(plan, tensor, op.factor)
        opts = self._options(self._reduce_opts, _c10d.ReduceOptions, dst, plan.torch_op)
        work = self._call("reduce", self._pg.reduce, [buffer], opts)
        return GlooWork(work, "reduce", (tensor,), post=finish, owner=self)

    def all_gather(self, outputs: Sequence[Any], tensor: Any) -> Work:
        if self._check:
            self._verify("all_gather", tensor)
        flat_outputs = [[_flat(out) for out in outputs]]
        work = self._call("all_gather", self._pg.allgather, flat_outputs, [_flat(tensor)], self._ag_opts)
        return GlooWork(work, "all_gather", tuple(outputs), owner=self)

    def all_gather_into_tensor(self, output: Any, tensor: Any) -> Work:
        if self._check:
            self._verify("all_gather_into_tensor", tensor)
        work = self._call(
            "all_gather_into_tensor", self._pg._allgather_base, _flat(output), _flat(tensor), self._ag_opts
        )
        return GlooWork(work, "all_gather_into_tensor", (output,), owner=self)

    def gather(self, tensor: Any, outputs: Optional[Sequence[Any]], dst: int) -> Work:
        if self._check:
            self._verify("gather", tensor, dst)
        opts = self._options(self._gather_opts, _c10d.GatherOptions, dst)
        flat_outputs = [[_flat(out) for out in outputs]] if self.rank == dst and outputs is not None else []
        work = self._call("gather", self._pg.gather, flat_outputs, [_flat(tensor)], opts)
        return GlooWork(work, "gather", tuple(outputs) if outputs is not None else (), owner=self)

    def scatter(self, tensor: Any, inputs: Optional[Sequence[Any]], src: int) -> Work:
        if self._check:
            self._verify("scatter", tensor, src)
        opts = self._options(self._scatter_opts, _c10d.ScatterOptions, src)
        flat_inputs = [[_flat(inp) for inp in inputs]] if self.rank == src and inputs is not None else []
        work = self._call("scatter", self._pg.scatter, [_flat(tensor)], flat_inputs, opts)
        return GlooWork(work, "scatter", (tensor,), owner=self)

    def reduce_scatter(self, output: Any, inputs: Sequence[Any], op: Any) -> Work:
        plan = self._plan_for(op, output.dtype, "reduce_scatter")
        if self._check:
            self._verify("reduce_scatter", output, op=op)
        if output.device.type != "cpu":  # gloo's reduce_scatter is host-only: allreduce the whole
            whole = torch.cat([t.reshape(-1) for t in inputs])
            return self._reduce_scatter_whole("reduce_scatter", output, whole, op, plan)
        out_buffer, finish = _out_buffer(plan, output)
        in_buffers = [_in_buffer(plan, t, op.factor).reshape(-1) for t in inputs]
        work = self._call("reduce_scatter", self._pg.reduce_scatter, [out_buffer.view(-1)], [in_buffers], plan.rs_opts)
        # gloo's reduce_scatter works learn of completion only inside wait() (pollable=False)
        return GlooWork(work, "reduce_scatter", (output,), post=finish, pollable=False, owner=self)

    def reduce_scatter_tensor(self, output: Any, tensor: Any, op: Any) -> Work:
        plan = self._plan_for(op, output.dtype, "reduce_scatter_tensor")
        if self._check:
            self._verify("reduce_scatter_tensor", output, op=op)
        out_buffer, finish = _out_buffer(plan, output)
        in_buffer = _in_buffer(plan, tensor, op.factor)
        work = self._call(
            "reduce_scatter_tensor",
            self._pg._reduce_scatter_base,
            out_buffer.reshape(-1),
            in_buffer.reshape(-1),
            plan.rs_opts,
        )
        return GlooWork(work, "reduce_scatter_tensor", (output,), post=finish, pollable=False, owner=self)

    def _reduce_scatter_whole(self, operation: str, output: Any, whole: Any, op: Any, plan: _Plan) -> Work:
        """reduce_scatter as an allreduce of ``whole`` (a fresh 1-D concatenation of the
        inputs) followed by taking this rank's chunk (the CUDA path)."""
        n = output.numel()
        lo, hi = self.rank * n, (self.rank + 1) * n
        buffer, finish = _io_buffer(plan, whole, op.factor)
        work = self._call(operation, self._pg.allreduce, [buffer], plan.ar_opts)
        post = _chain(finish, lambda: output.view(-1).copy_(whole[lo:hi]))
        return GlooWork(work, operation, (output,), post=post, owner=self)

    def all_to_all(self, outputs: Sequence[Any], inputs: Sequence[Any]) -> Work:
        if self._check:  # sizes may differ per peer: only the operation and dtype must agree
            self._verify("all_to_all", inputs[0], elements=False)
        flat_in = [_flat(t) for t in inputs]
        flat_out = [_flat(t) for t in outputs]
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
        if self._check:
            self._verify("all_to_all_single", tensor, elements=False)
        work = self._call(
            "all_to_all_single",
            self._pg.alltoall_base,
            _rows(output),
            _rows(tensor),
            list(output_split_sizes),
            list(input_split_sizes),
            self._a2a_opts,
        )
        return GlooWork(work, "all_to_all_single", (output,), owner=self)

    def barrier(self) -> Work:
        if self._check:
            self._verify("barrier")
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
