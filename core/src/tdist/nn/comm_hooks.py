"""Communication hooks of :class:`~tdist.nn.DistributedDataParallel`: :class:`GradBucket`
and the built-in hooks, as ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``
has them, over tdist.

A hook is ``hook(state, bucket) -> torch.futures.Future`` whose value is the bucket's
reduced gradients: one flat tensor of ``bucket.buffer()``'s size and dtype (or a list
holding it). Register it with ``ddp.register_comm_hook(state, hook)`` before the first
backward. DDP calls it once per bucket, as soon as the bucket's gradients are all
ready, in bucket order on every rank, and waits for the futures at the end of backward
(each at most the process group's timeout).
Without a hook DDP averages (divide by the world size, all_reduce SUM); a hook does
its own averaging, as :func:`allreduce_hook` does. ``state`` is passed through as the
hook's first argument; for the built-in hooks it is the process group (None: the
default group).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

import tdist as dist

__all__ = ["GradBucket", "CommHook", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]

#: ``hook(state, bucket)`` returning a future of the reduced flat gradients.
CommHook = Callable[[Any, "GradBucket"], "torch.futures.Future"]


class GradBucket:
    """The gradients of one DDP bucket, flattened into one buffer (what a hook reduces)."""

    __slots__ = ("_index", "_buffer", "_parameters", "_offsets", "_is_last")

    def __init__(
        self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor], offsets: list[int], is_last: bool
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._parameters = parameters
        self._offsets = offsets
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's position (0 holds the last parameters: buckets follow backward's order)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat buffer of the bucket's gradients (1-D, one dtype)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient, as a view of :meth:`buffer` shaped like the parameter."""
        return [
            self._buffer[offset : offset + p.numel()].view_as(p) for p, offset in zip(self._parameters, self._offsets)
        ]

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of :meth:`gradients`."""
        return list(self._parameters)

    def is_last(self) -> bool:
        """Whether this is the iteration's last bucket to be reduced."""
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the buffer's contents with ``tensor`` (same number of elements)."""
        if tensor.numel() != self._buffer.numel():
            raise ValueError(
                f"GradBucket.set_buffer: {tensor.numel()} elements, the bucket holds {self._buffer.numel()}"
            )
        self._buffer.copy_(tensor.reshape(-1))

    def __repr__(self) -> str:
        size = f"{self._buffer.numel()} {self._buffer.dtype}"
        return f"<GradBucket {self._index}: {len(self._parameters)} parameters, {size}>"


def allreduce_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """What DDP does without a hook: divide by the group's size, all_reduce SUM."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(process_group))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    assert work is not None  # DDP's processes are members of its group
    return work.get_future().then(lambda _: buffer)


def _compressed_allreduce(process_group: Any, bucket: GradBucket, dtype: torch.dtype) -> torch.futures.Future:
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(dist.get_world_size(process_group))
    work = dist.all_reduce(compressed, group=process_group, async_op=True)
    assert work is not None  # DDP's processes are members of its group

    def decompress(_: Any) -> torch.Tensor:
        buffer.copy_(compressed)
        return buffer

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in float16 (half the bytes on the wire), then write the result
    back in the bucket's dtype. Gradients beyond float16's range (about ±65504) overflow."""
    return _compressed_allreduce(process_group, bucket, torch.float16)


def bf16_compress_hook(process_group: Any, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket in bfloat16 (half the bytes, float32's range, 8 bits of
    mantissa), then write the result back in the bucket's dtype."""
    return _compressed_allreduce(process_group, bucket, torch.bfloat16)
