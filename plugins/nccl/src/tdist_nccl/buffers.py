"""Device pointers of torch tensors, and contiguous stand-ins for tensors that are not.

NCCL reads and writes flat memory: inputs that are not contiguous (or carry a lazy
conjugate/negative bit) are copied first; outputs that are not contiguous get a
contiguous buffer whose contents are copied back, on the same stream, after the
NCCL calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["Staging", "nbytes", "ptr", "readable"]


def ptr(tensor: torch.Tensor) -> int:
    """The device address of a contiguous tensor's first element."""
    if not tensor.is_contiguous():
        raise ValueError("nccl: internal error: a tensor passed to NCCL must be contiguous")
    return int(tensor.data_ptr())


def nbytes(tensor: torch.Tensor) -> int:
    """The size in bytes of ``tensor``'s elements."""
    return tensor.numel() * tensor.element_size()


def readable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as flat memory NCCL may read: itself when it already is, else a copy."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class Staging:
    """Contiguous stand-ins for output tensors; :meth:`copy_back` writes them into the originals."""

    def __init__(self) -> None:
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def writable(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` if NCCL can write it in place, else a contiguous copy to write instead."""
        if tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg():
            return tensor
        staged = readable(tensor)
        if staged is tensor:
            staged = tensor.clone()
        self._copies.append((tensor, staged))
        return staged

    def copy_back(self) -> None:
        for target, staged in self._copies:
            target.copy_(staged)
        self._copies.clear()
