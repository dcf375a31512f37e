"""DDP's gradient buckets: which parameters share one (reverse order, per dtype and
device, capped in bytes), the flat buffer they share, and walking a forward's output."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

__all__ = ["Bucket", "compute_buckets", "tensors_in", "to_device"]


class Bucket:
    """A flat buffer holding the gradients of several parameters of one dtype and device."""

    __slots__ = ("index", "params", "offsets", "buffer", "ready", "pending", "work", "dtype", "device")

    def __init__(self, index: int, params: list[int], sizes: list[int], dtype: torch.dtype, device: torch.device):
        self.index = index
        self.params = params  # indices into DistributedDataParallel._params
        self.offsets = []
        offset = 0
        for size in sizes:
            self.offsets.append(offset)
            offset += size
        self.dtype = dtype
        self.device = device
        self.buffer = torch.zeros(offset, dtype=dtype, device=device)
        self.ready = [False] * len(params)
        self.pending = len(params)
        self.work: Any = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        self.ready = [False] * len(self.params)
        self.pending = len(self.params)
        self.work = None


def compute_buckets(params: Sequence[torch.Tensor], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket: reverse parameter order, one dtype/device per bucket,
    a bucket closed once it holds at least its cap (the first bucket of each kind: ``first_cap_bytes``)."""
    open_buckets: dict[tuple, list[int]] = {}
    open_sizes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    buckets: list[list[int]] = []
    for i in reversed(range(len(params))):
        p = params[i]
        key = (p.dtype, p.device)
        open_buckets.setdefault(key, []).append(i)
        open_sizes[key] = open_sizes.get(key, 0) + p.numel() * p.element_size()
        limit = first_cap_bytes if closed_count.get(key, 0) == 0 else cap_bytes
        if open_sizes[key] >= limit:
            buckets.append(open_buckets.pop(key))
            open_sizes.pop(key)
            closed_count[key] = closed_count.get(key, 0) + 1
    buckets.extend(b for b in open_buckets.values() if b)
    return buckets


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors in a forward's output: nested tuples, lists, dicts, dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            yield from tensors_in(getattr(obj, name, None))


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` (tensors in nested lists, tuples, namedtuples, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(to_device(o, device) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj
