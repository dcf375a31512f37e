"""torch dtypes and tdist reductions as MPI datatypes and operators; zero-copy buffers.

Buffers are mpi4py buffer objects over the tensor's memory (its address and size,
``MPI.buffer.fromaddress``), which mpi4py passes to MPI through the buffer protocol;
nothing is pickled, nothing is copied. Data that is only moved uses an unsigned type
of the element's size; reductions use the element's own MPI type. float16/bfloat16 (and complex32) are reduced in float32 (complex64) staging
buffers: MPI has no half-precision types, and the result is at least as accurate.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tdist import DistBackendError, ReduceOp
from tdist.plugin import Reduction, plan_reduction

from . import _runtime

__all__ = ["Plan", "Tables", "buffer"]

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_STAGED = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.complex32: torch.complex64}
_FLOAT = (torch.float32, torch.float64)
_COMPLEX = (torch.complex64, torch.complex128)
_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))
_INTEGER = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64) + _UNSIGNED


#: ``MPI.buffer.fromaddress`` once MPI is loaded (set by :class:`Tables`).
_fromaddress: Any = None


def buffer(t: torch.Tensor) -> Any:
    """An mpi4py buffer over ``t``'s memory (``t`` contiguous): no copy, no numpy array.

    ``MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)`` costs ~0.2 µs against ~0.6 µs for
    ``t.numpy()``, serves every dtype (bfloat16 included) and, measured, avoids a ~3%
    slowdown of 16 MiB operations seen with a fresh numpy view per call. The buffer does
    not keep ``t`` alive: the work that uses it must hold ``t`` until it completes.
    """
    if t.is_cpu and not (t.is_conj() or t.is_neg()):
        n = t.nbytes
        if n:
            return _fromaddress(t.data_ptr(), n)
    return _slow_buffer(t)


def _slow_buffer(t: torch.Tensor) -> Any:
    if not t.is_cpu:
        return _device_buffer(t)
    if t.is_conj() or t.is_neg():
        raise ValueError(
            "mpi backend: tensor has a lazy conjugate/negative bit; call resolve_conj()/resolve_neg() first"
        )
    return _EMPTY  # no elements


def _device_buffer(t: torch.Tensor) -> Any:
    if t.device.type == "cuda" and _runtime.cuda_aware():
        if t.requires_grad:
            t = t.detach()
        # MPI reads device memory directly: kernels queued on the stream must be done.
        torch.cuda.current_stream(t.device).synchronize()
        if t.dtype in _STAGED or t.dtype not in _REDUCE_KEYS:
            t = t.view(_SAME_SIZE_INT.get(t.element_size(), t.dtype))
        return t  # mpi4py takes it through __cuda_array_interface__ / DLPack
    raise DistBackendError(
        f"mpi backend: {t.device} tensors need a CUDA-aware MPI library and this one is not "
        f"(set {_runtime.CUDA_ENV}=1 if it is); move the tensor to the CPU or use a GPU backend"
    )


_REDUCE_KEYS = _FLOAT + _COMPLEX + _INTEGER + (torch.bool,)
_EMPTY: Any = None


class Plan:
    """How to run one (dtype, ReduceOp): MPI datatype and operator, staging dtype,
    divide by the group size afterwards (AVG), multiply by a factor first (PREMUL_SUM)."""

    __slots__ = ("dt", "op", "stage", "avg", "premul", "direct")

    def __init__(self, dt: Any, op: Any, stage: Optional[torch.dtype], avg: bool, premul: bool) -> None:
        self.dt = dt
        self.op = op
        self.stage = stage
        self.avg = avg
        self.premul = premul
        #: one MPI call on the tensor itself, nothing before or after
        self.direct = stage is None and not avg and not premul


class Tables:
    """MPI datatypes and operators for torch dtypes, built once MPI is loaded."""

    def __init__(self, MPI: Any) -> None:
        global _fromaddress, _EMPTY
        self.MPI = MPI
        _fromaddress = MPI.buffer.fromaddress if hasattr(MPI, "buffer") else MPI.memory.fromaddress
        _EMPTY = bytearray(0)
        by_size = {1: MPI.BYTE, 2: MPI.UINT16_T, 4: MPI.UINT32_T, 8: MPI.UINT64_T, 16: MPI.C_DOUBLE_COMPLEX}
        self._by_size = by_size
        self._xfer: dict[torch.dtype, Any] = {}
        reduce_types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.complex64: MPI.C_FLOAT_COMPLEX,
            torch.complex128: MPI.C_DOUBLE_COMPLEX,
            torch.uint8: MPI.UINT8_T,
            torch.int8: MPI.INT8_T,
            torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T,
            torch.bool: MPI.C_BOOL,
        }
        for name, mpi_name in (("uint16", "UINT16_T"), ("uint32", "UINT32_T"), ("uint64", "UINT64_T")):
            if hasattr(torch, name):
                reduce_types[getattr(torch, name)] = getattr(MPI, mpi_name)
        self._reduce_types = reduce_types
        self._ops = {
            ReduceOp.SUM: MPI.SUM,
            ReduceOp.PRODUCT: MPI.PROD,
            ReduceOp.MIN: MPI.MIN,
            ReduceOp.MAX: MPI.MAX,
            ReduceOp.BAND: MPI.BAND,
            ReduceOp.BOR: MPI.BOR,
            ReduceOp.BXOR: MPI.BXOR,
            ReduceOp.AVG: MPI.SUM,
            ReduceOp.PREMUL_SUM: MPI.SUM,
        }
        # MPI defines only logical operators on C_BOOL: torch's bool semantics (sum = or).
        self._bool_ops = {
            ReduceOp.SUM: MPI.LOR,
            ReduceOp.PRODUCT: MPI.LAND,
            ReduceOp.MIN: MPI.LAND,
            ReduceOp.MAX: MPI.LOR,
            ReduceOp.BAND: MPI.LAND,
            ReduceOp.BOR: MPI.LOR,
            ReduceOp.BXOR: MPI.LXOR,
        }

    def xfer(self, dtype: torch.dtype) -> Any:
        """The MPI datatype that moves elements of ``dtype`` (an unsigned type of its size)."""
        dt = self._xfer.get(dtype)
        if dt is None:
            size = torch.empty((), dtype=dtype).element_size()
            dt = self._xfer[dtype] = self._by_size.get(size, self.MPI.BYTE)
        return dt

    def plan(self, dtype: torch.dtype, reduction: Reduction, operation: str) -> Plan:
        """How to reduce ``dtype`` with ``reduction``; a TypeError for a combination MPI
        cannot reduce, before anything is sent: tdist's rules (:func:`tdist.plugin.plan_reduction`),
        half-precision staged in float32/complex64, AVG as SUM then a division."""
        plan = plan_reduction(
            reduction, dtype, self._reduce_types, widen=_STAGED, native_avg=False, backend="mpi", operation=operation
        )
        ops = self._bool_ops if plan.compute is torch.bool else self._ops
        return Plan(
            self._reduce_types[plan.compute],
            ops[plan.op],
            plan.compute if plan.widened else None,
            plan.divide,
            plan.prescale,
        )
