"""tdist.plugin.plan_reduction: how a library with some native dtypes runs a reduction
(gloo, mpi and nccl plan theirs with it)."""

from __future__ import annotations

import pytest
import torch

from tdist import make_premul_sum
from tdist.plugin import ReduceOp, Reduction, plan_reduction

NATIVE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.bool}
WIDER = {torch.float16: torch.float32, torch.int16: torch.int64}


def _plan(op, dtype, **kwargs):
    reduction = op if isinstance(op, Reduction) else Reduction(op)
    return plan_reduction(reduction, dtype, NATIVE, widen=WIDER, backend="lib", operation="all_reduce", **kwargs)


def test_native_widened_and_real():
    plan = _plan(ReduceOp.MAX, torch.float32)
    assert (plan.op, plan.compute, plan.widened, plan.as_real, plan.prescale, plan.divide) == (
        ReduceOp.MAX,
        torch.float32,
        False,
        False,
        False,
        False,
    )
    assert _plan(ReduceOp.SUM, torch.float16).compute == torch.float32 and _plan(ReduceOp.SUM, torch.float16).widened
    real = _plan(ReduceOp.SUM, torch.complex128, complex_as_real=True)
    assert (real.compute, real.as_real, real.widened) == (torch.float64, True, False)


def test_avg_and_premul_sum_become_sums():
    assert _plan(ReduceOp.AVG, torch.float32).op is ReduceOp.AVG
    divided = _plan(ReduceOp.AVG, torch.float32, native_avg=False)
    assert (divided.op, divided.divide) == (ReduceOp.SUM, True)
    integer = _plan(ReduceOp.AVG, torch.int64)  # a library's AVG is for floats unless it says otherwise
    assert (integer.op, integer.divide) == (ReduceOp.SUM, True)
    assert not _plan(ReduceOp.AVG, torch.int64, native_int_avg=True).divide
    premul = _plan(make_premul_sum(0.5), torch.float64)
    assert (premul.op, premul.prescale) == (ReduceOp.SUM, True)


def test_integer_avg_truncates_toward_zero_as_nccl():
    from tdist.plugin import finalize_

    summed = torch.tensor([7, -7, 6, -1], dtype=torch.int64)
    assert finalize_(summed, Reduction(ReduceOp.AVG), 2).tolist() == [3, -3, 3, 0]
    assert finalize_(torch.tensor([7.0]), Reduction(ReduceOp.AVG), 2).tolist() == [3.5]


@pytest.mark.parametrize(
    "op, dtype, error, words",
    [
        (ReduceOp.BAND, torch.float32, TypeError, "BAND needs an integer"),
        (ReduceOp.AVG, torch.bool, TypeError, "AVG is not defined for bool"),
        (ReduceOp.MIN, torch.complex64, TypeError, "not supported for complex"),
        (ReduceOp.PREMUL_SUM, torch.float32, ValueError, "needs a factor"),
        (ReduceOp.SUM, torch.uint8, TypeError, "cannot reduce torch.uint8 tensors with ReduceOp.SUM"),
        (ReduceOp.SUM, torch.complex64, TypeError, "cannot reduce torch.complex64"),  # not as real: no complex
    ],
)
def test_refusals_name_the_operation_and_backend(op, dtype, error, words):
    with pytest.raises(error, match="all_reduce: backend 'lib'") as caught:
        _plan(op, dtype)
    assert words in str(caught.value)
