"""Reductions over the shared segment: numpy ufuncs for the dtypes numpy has, tdist's
torch functions for the others (bfloat16, float8, complex32, ...)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from . import native

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

    from .shmstep import ShmSteps

__all__ = ["Kernel", "numpy_dtype"]


_NP_DTYPES: Optional[dict] = None


def numpy_dtype(dtype: "torch.dtype") -> Any:
    """The numpy dtype of ``dtype``, or None where numpy has none (bfloat16, ...)."""
    global _NP_DTYPES
    if _NP_DTYPES is None:
        import torch

        table = {
            torch.float32: np.float32,
            torch.float64: np.float64,
            torch.float16: np.float16,
            torch.complex64: np.complex64,
            torch.complex128: np.complex128,
            torch.int8: np.int8,
            torch.uint8: np.uint8,
            torch.int16: np.int16,
            torch.int32: np.int32,
            torch.int64: np.int64,
            torch.bool: np.bool_,
        }
        for name, npt in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
            if isinstance(getattr(torch, name, None), torch.dtype):
                table[getattr(torch, name)] = npt
        _NP_DTYPES = table
    return _NP_DTYPES.get(dtype)


_UFUNCS = {
    "SUM": np.add,
    "AVG": np.add,
    "PREMUL_SUM": np.add,
    "PRODUCT": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}
_UFUNCS_BOOL = {
    **_UFUNCS,
    "SUM": np.logical_or,
    "AVG": np.logical_or,
    "MAX": np.logical_or,
    "PRODUCT": np.logical_and,
    "MIN": np.logical_and,
}


class Kernel:
    """Views of the segment and of tensors as numpy arrays (or torch tensors for the
    dtypes numpy lacks), and the reduction ``out = in0 op in1 op ...`` on them."""

    __slots__ = ("eng", "dtype", "es", "op", "npdt", "ufunc", "c_codes", "codes")

    def __init__(self, eng: "ShmSteps", dtype: "torch.dtype", op: Optional["Reduction"]) -> None:
        self.eng = eng
        self.dtype = dtype
        self.es = dtype.itemsize
        self.op = op
        self.npdt = numpy_dtype(dtype)
        self.ufunc = None
        if op is not None and self.npdt is not None:
            table = _UFUNCS_BOOL if self.npdt is np.bool_ else _UFUNCS
            self.ufunc = table.get(op.op.name)
        if self.ufunc is None:
            self.npdt = None  # reductions (and so views) in torch
        etype = native.element_type(dtype)
        eop = native.operator(op, etype) if op is not None else 0
        #: the C part's element type and operator codes if it can do this reduction, whether or
        #: not this rank has the C part (the same on every rank)
        self.c_codes: Optional[tuple[int, int]] = (etype, eop) if eop else None
        #: the same, when this rank has the C part
        self.codes = self.c_codes if eng.combine is not None else None

    def shm(self, off: int, count: int) -> Any:
        if self.npdt is not None:
            return self.eng.u8[off : off + count * self.es].view(self.npdt)
        return self.eng.t8()[off : off + count * self.es].view(self.dtype)

    def ten(self, flat: "torch.Tensor", a: int, b: int) -> Any:
        piece = flat[a:b]
        return piece.numpy() if self.npdt is not None else piece

    def reduce(self, out: Any, ins: Sequence[Any]) -> None:
        """``out = ins[0] op ins[1] op ...`` in that order (``out`` may be ``ins[0]`` itself,
        and overlaps none of the others).

        Like torch, never warns or raises on floating-point overflow or NaN (numpy's
        error state is only consulted after the fact, and the reduction redone quietly
        if it objected; the inputs are untouched, so redoing it is exact)."""
        if self.ufunc is not None:
            try:
                _ufunc_reduce(self.ufunc, out, ins)
            except FloatingPointError:  # the program asked numpy to raise: torch would not
                with np.errstate(all="ignore"):
                    _ufunc_reduce(self.ufunc, out, ins)
            return
        from ..collectives.algorithms import combine_serial, copy_serial

        copy_serial(out, ins[0])
        for x in ins[1:]:
            combine_serial(out, x, self.op)  # type: ignore[arg-type]


def _ufunc_reduce(uf: Any, out: Any, ins: Sequence[Any]) -> None:
    uf(ins[0], ins[1], out=out)
    for x in ins[2:]:
        uf(out, x, out=out)


# numpy warns about floating-point overflow/invalid values in its default error state;
# torch never does, so the warnings numpy attributes to this module are not shown.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=__name__.replace(".", r"\."))
