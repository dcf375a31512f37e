"""Tensors as the tcp backend's algorithms take them: flat, contiguous, and scaled for PREMUL_SUM/AVG."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from tdist.plugin import ReduceOp, finalize_, prescale_

from . import algorithms as algo

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

__all__ = ["inplace", "output", "source", "prescale", "finalize", "concat"]


def inplace(t: "torch.Tensor") -> tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """A flat contiguous view of ``t`` holding its data, and ``t`` again if the result must be copied back."""
    if t.requires_grad:
        t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return (t if t.dim() == 1 else t.view(-1)), None
    return t.resolve_conj().resolve_neg().contiguous().view(-1), t


def output(t: "torch.Tensor") -> tuple["torch.Tensor", Optional["torch.Tensor"]]:
    """A flat contiguous buffer to receive into, and ``t`` if it must be copied back."""
    import torch

    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.view(-1), None
    return torch.empty(t.numel(), dtype=t.dtype), t


def source(t: "torch.Tensor") -> "torch.Tensor":
    """A flat contiguous tensor with ``t``'s values (``t``'s own memory when possible)."""
    t = t.detach()
    if t.is_contiguous() and not t.is_conj() and not t.is_neg():
        return t.view(-1)
    return t.resolve_conj().resolve_neg().contiguous().view(-1)


def prescale(flat: "torch.Tensor", op: "Reduction") -> None:
    if op.op is ReduceOp.PREMUL_SUM:
        algo.serially(lambda piece: prescale_(piece, op), flat)


def finalize(flat: "torch.Tensor", op: "Reduction", size: int) -> None:
    if op.op is ReduceOp.AVG:
        algo.serially(lambda piece: finalize_(piece, op, size), flat)


def concat(c: algo.Coll, flats: Sequence["torch.Tensor"]) -> "torch.Tensor":
    """A (scratch) flat tensor holding ``flats`` one after the other."""
    out = c.scratch.get("work", sum(f.numel() for f in flats), flats[0].dtype)
    at = 0
    for f in flats:
        algo.copy_serial(out[at : at + f.numel()], f)
        at += f.numel()
    return out
