"""The CUDA side of the backend: torch's current stream, events, device guards.

Everything the backend needs from CUDA goes through one :class:`TorchCuda` object,
so the NCCL call logic can also be driven by a stand-in on a machine without a GPU
(the unit tests do). NCCL kernels are queued on torch's *current* stream of the
tensor's device, so they are ordered with the caller's own kernels and the caching
allocator needs no ``record_stream``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager

if TYPE_CHECKING:
    import torch

__all__ = ["CudaEvent", "TorchCuda"]


class CudaEvent:
    """A ``torch.cuda.Event`` recorded after an operation on ``device``'s stream."""

    __slots__ = ("device", "event")

    def __init__(self, event: Any, device: int) -> None:
        self.event = event
        self.device = device

    def query(self) -> bool:
        """True once every kernel queued before the event has finished (never blocks)."""
        return bool(self.event.query())

    def synchronize(self) -> None:
        """Block the calling thread until the event has completed."""
        self.event.synchronize()

    def block_current_stream(self) -> None:
        """Make the current stream of ``device`` wait for the event (the host does not block)."""
        import torch

        torch.cuda.current_stream(self.device).wait_event(self.event)


class TorchCuda:
    """Streams, events and device selection through ``torch.cuda``."""

    def device_index(self, tensor: torch.Tensor, operation: str) -> int:
        """The CUDA device index of ``tensor``; a ValueError for any other device."""
        if tensor.device.type != "cuda":
            raise ValueError(f"nccl {operation}: NCCL needs CUDA tensors, got a tensor on {tensor.device}")
        index = tensor.device.index
        return self.current_device() if index is None else int(index)

    def current_device(self) -> int:
        import torch

        return int(torch.cuda.current_device())

    def device_count(self) -> int:
        import torch

        return int(torch.cuda.device_count())

    def stream(self, device: int) -> Any:
        """torch's current stream on ``device``."""
        import torch

        return torch.cuda.current_stream(device)

    def handle(self, stream: Any) -> int:
        """The ``cudaStream_t`` of ``stream`` as an int, for CuPy."""
        return int(stream.cuda_stream)

    def record(self, stream: Any, device: int) -> CudaEvent:
        """Record a new event on ``stream`` (after everything queued so far)."""
        import torch

        event = torch.cuda.Event()
        event.record(stream)
        return CudaEvent(event, device)

    def zeros(self, numel: int, device: int) -> torch.Tensor:
        """A float32 tensor of zeros on ``device``."""
        import torch

        return torch.zeros(numel, dtype=torch.float32, device=f"cuda:{device}")

    def guard(self, device: int) -> ContextManager[Any]:
        """A context making ``device`` the current CUDA device."""
        import torch

        return torch.cuda.device(device)
