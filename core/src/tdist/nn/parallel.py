"""``DistributedDataParallel`` over tdist, with torch.nn.parallel's signature.

How it works (one process per replica, any tdist backend, public tdist API only):

- **construction**: rank 0's parameters and buffers are broadcast to every rank
  (coalesced per dtype); the parameters that require a gradient are split into
  *buckets* of at most ``bucket_cap_mb`` (the first one at most 1 MiB so that
  communication starts early), in reverse parameter order, per dtype and device,
  since backward produces gradients roughly in that order; each bucket owns one
  flat buffer.
- **forward**: buffers are broadcast from rank 0 (``broadcast_buffers``), the
  wrapped module runs, and the reducer is armed for the coming backward. With
  ``find_unused_parameters=True`` the autograd graph is traversed from the
  outputs; parameters it does not reach are *unused* this iteration.
- **backward**: a hook on every parameter
  (``Tensor.register_post_accumulate_grad_hook``) copies its gradient into its
  bucket slot; when every slot of a bucket is ready the bucket is divided by the
  world size and ``all_reduce(async_op=True)`` is issued, while autograd goes on
  computing the other gradients. Buckets are issued in bucket order on every
  rank (a bucket that is ready early waits for its predecessors), which keeps
  the collectives' order identical across ranks. Unused parameters' slots are
  marked ready, holding zeros, at the first hook.
- **end of backward** (a callback queued on the autograd engine): wait for every
  bucket, copy the averaged gradients back into ``param.grad`` (or make
  ``param.grad`` a view of the bucket with ``gradient_as_bucket_view=True``).
  With ``find_unused_parameters`` a second small all_reduce tells which
  parameters no rank used: their ``.grad`` is left untouched (None), as torch does.
  Without it, a backward that leaves parameters without gradient raises a
  ``RuntimeError`` naming them and explaining ``find_unused_parameters`` (after
  completing the all-reduces with zeros, so that the other ranks do not hang).
- ``no_sync()``: inside it, backward only accumulates into ``param.grad``; the
  first backward outside all-reduces the accumulated gradients.
- ``register_comm_hook(state, hook)``: each full bucket goes to ``hook(state,
  GradBucket)`` instead of the averaging all_reduce; the future it returns holds the
  reduced buffer (see :mod:`tdist.nn.comm_hooks`, which has torch's built-in hooks:
  ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``).

Unlike torch, buckets are not rebuilt after the first iteration from the
observed gradient order.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

import tdist as dist

from .buckets import Bucket, compute_buckets, tensors_in, to_device
from .comm_hooks import CommHook, GradBucket

__all__ = ["DistributedDataParallel", "DDPStats"]

_MiB = 1024 * 1024
#: The first bucket's cap, as torch's ``dist._DEFAULT_FIRST_BUCKET_BYTES``.
_FIRST_BUCKET_BYTES = 1 * _MiB
#: Chunk size of the coalesced broadcasts of parameters and buffers.
_BROADCAST_BUCKET_BYTES = 250 * _MiB


@dataclass
class DDPStats:
    """Communication counters of one :class:`DistributedDataParallel` (this rank)."""

    #: backward passes whose gradients were all-reduced
    sync_steps: int = 0
    #: gradient bucket all-reduces issued, and their bytes
    allreduce_calls: int = 0
    allreduce_bytes: int = 0
    #: buckets handed to the registered communication hook instead
    comm_hook_calls: int = 0
    #: broadcasts of parameters (construction) and buffers (each forward), and their bytes
    broadcast_calls: int = 0
    broadcast_bytes: int = 0
    #: seconds spent at the end of backward waiting for bucket all-reduces
    wait_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class DistributedDataParallel(nn.Module):
    """Data parallelism at the module level: each process holds a replica of
    ``module``, runs forward/backward on its share of the batch, and gradients are
    averaged across the processes of ``process_group`` during backward.

    Signature and behaviour follow ``torch.nn.parallel.DistributedDataParallel``
    (see the module docstring for how). ``device_ids``: at most one device (the
    replica's); inputs are moved to it. ``output_device`` and ``dim`` are accepted
    for compatibility (single-device replicas only). ``static_graph``,
    ``check_reduction`` are accepted and ignored. ``stats`` holds communication
    counters (:class:`DDPStats`).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Optional[Sequence[Any]] = None,
        output_device: Any = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: Optional[float] = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel: module must be a torch.nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError(
                "DistributedDataParallel: the default process group is not initialized; "
                "call tdist.init_process_group() first"
            )
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(
                f"DistributedDataParallel: device_ids must name at most one device (one replica per process), "
                f"got {list(device_ids)}"
            )
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if bucket_cap_mb <= 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.device_ids = list(device_ids) if device_ids else None
        self.device = torch.device(self.device_ids[0]) if self.device_ids else None
        if isinstance(self.device, torch.device) and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", int(self.device_ids[0]))
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group
        self.bucket_bytes_cap = int(bucket_cap_mb * _MiB)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.stats = DDPStats()

        self._world_size = dist.get_world_size(process_group)
        self._timeout_s = (process_group or dist.group.WORLD).timeout.total_seconds()
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._named_params = [
            (name, p) for name, p in module.named_parameters() if p.requires_grad and name not in ignored
        ]
        self._params = [p for _, p in self._named_params]
        self._param_index = {id(p): i for i, p in enumerate(self._params)}
        self._named_buffers = [(name, b) for name, b in module.named_buffers() if name not in ignored]
        for name, p in self._named_params:
            if p.is_sparse:
                raise ValueError(
                    f"DistributedDataParallel: parameter {name!r} is sparse; sparse parameters are not supported"
                )

        if init_sync and self._world_size > 1:
            self._broadcast_coalesced([p.detach() for name, p in module.named_parameters() if name not in ignored])
            self._broadcast_coalesced([b for _, b in self._named_buffers])

        first_cap = min(_FIRST_BUCKET_BYTES, self.bucket_bytes_cap)
        assignment = compute_buckets(self._params, self.bucket_bytes_cap, first_cap)
        self._buckets = [
            Bucket(
                k, idx, [self._params[i].numel() for i in idx], self._params[idx[0]].dtype, self._params[idx[0]].device
            )
            for k, idx in enumerate(assignment)
        ]
        self._locate: list[tuple[Bucket, int]] = [None] * len(self._params)  # type: ignore[list-item]
        for bucket in self._buckets:
            for slot, i in enumerate(bucket.params):
                self._locate[i] = (bucket, slot)

        # Per-iteration state of the reducer.
        self._lock = threading.RLock()
        self._armed = False  # a forward prepared the next backward
        self._in_backward = False  # a hook has fired; the end-of-backward callback is queued
        self._unused: list[int] = []  # parameters the last forward's graph does not reach
        self._used: set[int] = set()  # parameters whose hook fired in this backward
        self._accumulated: set[int] = set()  # parameters that got gradients under no_sync since the last sync
        self._next_bucket = 0  # the next bucket to issue (issued in order)
        self._comm_hook: Optional[tuple[Any, CommHook]] = None

        ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(_make_hook(ref, i)) for i, p in enumerate(self._params)
        ]

    # ------------------------------------------------------------------ public API
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward accumulates gradients locally, without communication.
        The first backward after leaving synchronizes the accumulated gradients."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each gradient bucket with ``hook(state, bucket)`` (a
        :class:`~tdist.nn.comm_hooks.GradBucket`) instead of the default averaging
        all_reduce; the hook returns a ``torch.futures.Future`` of the reduced flat buffer.
        Once per wrapper, before the first backward (as in torch)."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        if self._comm_hook is not None:
            raise RuntimeError("register_comm_hook: a communication hook is already registered (only one is allowed)")
        if self.stats.sync_steps or self._in_backward:
            raise RuntimeError("register_comm_hook: register the hook before the first backward")
        self._comm_hook = (state, hook)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.device is not None:
            inputs = to_device(inputs, self.device)
            kwargs = to_device(kwargs, self.device)
        if self.broadcast_buffers and self.require_forward_param_sync and self._world_size > 1 and self._named_buffers:
            with torch.no_grad():
                self._broadcast_coalesced([b for _, b in self._named_buffers])
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self._params:
            if self.require_backward_grad_sync:
                self._prepare_for_backward(output)
            else:
                self._armed = False  # its backward only accumulates locally (no_sync)
        return output

    def __getstate__(self) -> dict:
        raise TypeError("DistributedDataParallel cannot be pickled; pickle its .module instead")

    def extra_repr(self) -> str:
        return (
            f"world_size={self._world_size}, buckets={len(self._buckets)}, bucket_cap_mb={self.bucket_bytes_cap / _MiB:g}, "
            f"find_unused_parameters={self.find_unused_parameters}"
        )

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the wrapper stops synchronizing)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    # ------------------------------------------------------------------ communication helpers
    def _broadcast_coalesced(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from the group's rank 0, one flat tensor per dtype/device chunk."""
        groups: "OrderedDict[tuple, list[torch.Tensor]]" = OrderedDict()
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        for group in groups.values():
            chunk: list[torch.Tensor] = []
            size = 0
            for t in group:
                chunk.append(t)
                size += t.numel() * t.element_size()
                if size >= _BROADCAST_BUCKET_BYTES:
                    self._broadcast_flat(chunk)
                    chunk, size = [], 0
            if chunk:
                self._broadcast_flat(chunk)

    def _broadcast_flat(self, tensors: list[torch.Tensor]) -> None:
        with torch.no_grad():
            single = len(tensors) == 1 and tensors[0].is_contiguous()
            flat = tensors[0].detach() if single else torch.cat([t.detach().reshape(-1) for t in tensors])
            if flat.numel() == 0:
                return
            dist.broadcast(flat, src=self._src, group=self.process_group)
            self.stats.broadcast_calls += 1
            self.stats.broadcast_bytes += flat.numel() * flat.element_size()
            if single:
                return
            flat = flat.reshape(-1)
            offset = 0
            for t in tensors:
                n = t.numel()
                t.detach().copy_(flat[offset : offset + n].view_as(t))
                offset += n

    # ------------------------------------------------------------------ reducer
    def _prepare_for_backward(self, output: Any) -> None:
        with self._lock:
            if self._in_backward:
                # The previous backward failed before its end (an error in autograd or
                # in communication): drop what it issued and start afresh.
                self._in_backward = False
                for bucket in self._buckets:
                    if bucket.work is not None:
                        with contextlib.suppress(Exception):
                            bucket.work.wait()
            for bucket in self._buckets:
                bucket.reset()
            self._next_bucket = 0
            self._used = set()
            self._unused = self._find_unused(output) if self.find_unused_parameters else []
            self._armed = True

    def _find_unused(self, output: Any) -> list[int]:
        """Indices of the parameters the autograd graph of ``output`` does not reach."""
        reached: set[int] = set()
        seen: set[Any] = set()
        stack = []
        for t in tensors_in(output):
            if t.grad_fn is not None:
                stack.append(t.grad_fn)
            elif id(t) in self._param_index:
                reached.add(self._param_index[id(t)])
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            variable = getattr(fn, "variable", None)
            if variable is not None:
                index = self._param_index.get(id(variable))
                if index is not None:
                    reached.add(index)
            for next_fn, _ in fn.next_functions:
                if next_fn is not None and next_fn not in seen:
                    stack.append(next_fn)
        return [i for i in range(len(self._params)) if i not in reached]

    def _on_grad_ready(self, index: int) -> None:
        """The hook: parameter ``index``'s gradient is accumulated in ``.grad``."""
        with self._lock:
            if not (self._armed or self._in_backward):
                # the forward ran under no_sync (or there was none through this
                # wrapper, or this is a second backward through one graph): the
                # gradient only accumulates locally, to be reduced with the next sync
                self._accumulated.add(index)
                return
            if not self._in_backward:  # the first hook of this backward
                self._armed = False
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
                for i in self._unused:
                    self._mark_ready(i, from_hook=False)
            self._used.add(index)
            self._mark_ready(index, from_hook=True)

    def _mark_ready(self, index: int, from_hook: bool) -> None:
        bucket, slot = self._locate[index]
        param = self._params[index]
        if bucket.ready[slot]:
            name = self._named_params[index][0]
            raise RuntimeError(
                f"DistributedDataParallel: parameter {name!r} received a gradient twice in one backward, or after "
                "it was marked unused (find_unused_parameters=True found no path to it from forward's outputs). "
                "Make the loss depend on the parameters only through the wrapped module's forward."
            )
        offset = bucket.offsets[slot]
        view = bucket.buffer[offset : offset + param.numel()].view_as(param)
        grad = param.grad
        if from_hook or index in self._accumulated:
            if grad is None:
                view.zero_()
            else:
                if grad.is_sparse:
                    raise RuntimeError(
                        f"DistributedDataParallel: parameter {self._named_params[index][0]!r} has a sparse gradient; "
                        "sparse gradients are not supported"
                    )
                if grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
        else:
            view.zero_()
        bucket.ready[slot] = True
        bucket.pending -= 1
        if bucket.pending == 0:
            self._issue_ready_buckets()

    def _issue_ready_buckets(self) -> None:
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            if self._comm_hook is not None:
                bucket.work = self._run_comm_hook(bucket)
            elif self._world_size > 1:
                bucket.buffer.div_(self._world_size)
                bucket.work = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)
                self.stats.allreduce_calls += 1
                self.stats.allreduce_bytes += bucket.nbytes
            self._next_bucket += 1

    def _run_comm_hook(self, bucket: Bucket) -> Any:
        state, hook = self._comm_hook  # type: ignore[misc]
        params = [self._params[i] for i in bucket.params]
        is_last = bucket.index == len(self._buckets) - 1
        grad_bucket = GradBucket(bucket.index, bucket.buffer, params, bucket.offsets, is_last)
        self.stats.comm_hook_calls += 1
        try:
            future = hook(state, grad_bucket)
            if not isinstance(future, torch._C.Future):  # torch.futures.Future, or what its then() returns
                raise TypeError(
                    f"DistributedDataParallel: the communication hook returned {type(future).__name__}, "
                    "not a torch.futures.Future of the reduced bucket"
                )
        except Exception as exc:  # noqa: BLE001 - raised at the end of backward, the reducer's state intact
            future = torch.futures.Future()
            future.set_exception(exc)
        return future

    def _complete(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all_reduce or hook future; a hook's result goes into the buffer."""
        work, bucket.work = bucket.work, None
        if isinstance(work, dist.Work):
            work.wait()
            return
        done = threading.Event()
        work.add_done_callback(lambda _: done.set())
        if not done.wait(self._timeout_s):
            raise dist.DistBackendTimeoutError(
                f"DistributedDataParallel: the communication hook's future for bucket {bucket.index} did not "
                f"complete within the group's timeout ({self._timeout_s:g} s)"
            )
        result = work.wait()
        if isinstance(result, (list, tuple)) and len(result) == 1:
            result = result[0]
        if not isinstance(result, torch.Tensor) or result.numel() != bucket.buffer.numel():
            shape = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise RuntimeError(
                f"DistributedDataParallel: the communication hook's future for bucket {bucket.index} holds {shape}, "
                f"expected a tensor of {bucket.buffer.numel()} elements"
            )
        if result.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(result.reshape(-1))

    def _finalize_backward(self) -> None:
        """End of backward: complete every bucket, then write the averaged gradients back."""
        with self._lock:
            self._in_backward = False
            missing = [i for bucket in self._buckets for slot, i in enumerate(bucket.params) if not bucket.ready[slot]]
            # Complete the buckets with zeros for what never arrived, so that every
            # rank issues the same all-reduces and none is left waiting.
            for i in missing:
                self._mark_ready(i, from_hook=False)
            start = time.perf_counter()
            errors = []
            for bucket in self._buckets:
                if bucket.work is not None:
                    try:
                        self._complete(bucket)
                    except Exception as exc:  # noqa: BLE001 - every bucket is completed, then the first error raised
                        errors.append(exc)
            self.stats.wait_seconds += time.perf_counter() - start
            if errors:
                self._accumulated = set()
                raise errors[0]
            if missing and not self.find_unused_parameters:
                self._accumulated = set()
                names = [self._named_params[i][0] for i in missing]
                shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
                raise RuntimeError(
                    f"DistributedDataParallel: backward finished on rank {dist.get_rank()} but {len(missing)} "
                    f"parameter(s) received no gradient: {shown}. Their gradient buckets could not be reduced "
                    "(gradients were left unchanged on this rank). If forward does not use every parameter in "
                    "every iteration, or the loss does not depend on every output, construct "
                    "DistributedDataParallel(module, find_unused_parameters=True): unused parameters are then "
                    "detected after each forward and reduced as zeros. Parameters that never need gradients "
                    "should have requires_grad=False."
                )
            used_somewhere = None
            if self.find_unused_parameters and self._world_size > 1:
                flags = torch.zeros(len(self._params), dtype=torch.int32)
                for i in self._used | self._accumulated:
                    flags[i] = 1
                dist.all_reduce(flags, group=self.process_group)
                used_somewhere = flags.tolist()
            elif self.find_unused_parameters:
                used_somewhere = [
                    1 if i in self._used or i in self._accumulated else 0 for i in range(len(self._params))
                ]
            self._accumulated = set()
            for bucket in self._buckets:
                for slot, i in enumerate(bucket.params):
                    if used_somewhere is not None and not used_somewhere[i]:
                        continue  # no rank used it: leave .grad alone (None), as torch does
                    param = self._params[i]
                    offset = bucket.offsets[slot]
                    view = bucket.buffer[offset : offset + param.numel()].view_as(param)
                    if self.gradient_as_bucket_view:
                        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                            param.grad = view
                    elif param.grad is None:
                        param.grad = view.clone()
                    else:
                        param.grad.copy_(view)
            self.stats.sync_steps += 1


def _make_hook(ref: "weakref.ref[DistributedDataParallel]", index: int) -> Callable[[torch.Tensor], None]:
    def hook(_param: torch.Tensor) -> None:
        ddp = ref()
        if ddp is not None:
            ddp._on_grad_ready(index)

    return hook
