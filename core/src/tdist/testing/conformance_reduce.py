"""Conformance bodies: every ReduceOp on every dtype through all_reduce, reduce
and reduce_scatter_tensor; AVG; PREMUL_SUM; invalid operator/dtype pairs raise
before any communication.

Inputs are small integers (sign alternating for signed types) so that every
result is exact even in float16/bfloat16 and products stay in range (int8 and
uint8 sums and products wrap past 4 ranks, as the expected values do); expected
values are computed on the rank from every rank's (deterministic) input.
"""

from __future__ import annotations

from typing import Any

from ._registry import body
from .capabilities import supports
from .helpers import DTYPES, assert_tensor, check_world_works, dist, dtype_of, is_tdist, raises

__all__ = ["reduce_ops", "reduce_avg", "reduce_avg_integers", "reduce_premul_sum", "reduce_invalid_op_dtype"]

_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_tensor")
_FLOATS = ("float32", "float64", "float16", "bfloat16")
_INTS = ("int32", "int64", "int16", "int8", "uint8")
_UNSIGNED = ("uint8",)
_LEN = 6  # elements per rank (per chunk for reduce_scatter_tensor)


def _torch():
    import torch

    return torch


def valid_ops(dtype: str) -> list[str]:
    """The operators torch.distributed defines on ``dtype`` (AVG and PREMUL_SUM have their own bodies)."""
    if dtype == "complex64":
        return ["SUM"]
    if dtype in _FLOATS:
        return ["SUM", "PRODUCT", "MAX", "MIN"]
    return ["SUM", "PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR"]


def invalid_ops(dtype: str) -> list[str]:
    if dtype == "complex64":
        return ["PRODUCT", "MAX", "MIN", "BAND", "BOR", "BXOR"]
    if dtype in _FLOATS:
        return ["BAND", "BOR", "BXOR"]
    return []


def rank_input(rank: int, dtype: str, numel: int) -> Any:
    """Rank ``rank``'s input: small integers in [1, 3] (signed types alternate sign),
    bit patterns for integer types, a pattern of booleans, complex from two reals."""
    torch = _torch()
    i = torch.arange(numel)
    if dtype == "bool":
        return ((i + rank) % 3 == 0) | ((i * rank) % 4 == 1)
    mag = (i + rank) % 3 + 1
    sign = torch.where((i + 2 * rank) % 4 == 0, -1, 1)
    if dtype == "complex64":
        return torch.complex((mag * sign).to(torch.float32), (mag - 2).to(torch.float32))
    if dtype in _INTS:
        bits = (i * 5 + rank * 3) % 16 + 1
        value = mag if dtype in _UNSIGNED else mag * sign
        return torch.where(i % 2 == 0, value, bits).to(dtype_of(dtype))
    return (mag * sign).to(dtype_of(dtype))


def expected_reduction(inputs: list, op: str, dtype: str) -> Any:
    """Reduce the ranks' inputs exactly (int64 / float64 / complex128), cast back."""
    torch = _torch()
    target = dtype_of(dtype)
    if dtype == "bool":
        stack = torch.stack(inputs)
        if op in ("SUM", "MAX", "BOR"):
            return stack.any(0)
        if op in ("PRODUCT", "MIN", "BAND"):
            return stack.all(0)
        if op == "BXOR":
            return stack.to(torch.int64).sum(0) % 2 == 1
    wide = torch.complex128 if dtype == "complex64" else (torch.int64 if dtype in _INTS else torch.float64)
    stack = torch.stack([x.to(wide) for x in inputs])
    if op == "SUM":
        out = stack.sum(0)
    elif op == "PRODUCT":
        out = stack.prod(0)
    elif op == "MAX":
        out = stack.max(0).values
    elif op == "MIN":
        out = stack.min(0).values
    else:
        out = stack[0].clone()
        for x in stack[1:]:
            out = {"BAND": out & x, "BOR": out | x, "BXOR": out ^ x}[op]
    return out.to(target)


def _run(collective: str, op: Any, dtype: str, label: str, expect: Any = None) -> None:
    """Run ``collective`` with ``op`` on every rank's input; compare with ``expect(inputs)``."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype in ("float16", "bfloat16") else {"atol": 1e-6, "rtol": 1e-6}
    exact = dtype in _INTS or dtype == "bool"
    if collective == "reduce_scatter_tensor":
        inputs = [rank_input(k, dtype, _LEN * n) for k in range(n)]
        out = torch.zeros(_LEN, dtype=dtype_of(dtype))
        dist.reduce_scatter_tensor(out, inputs[r].clone(), op=op)
        chunks = [x[r * _LEN : (r + 1) * _LEN] for x in inputs]
        want = expect(chunks)
        assert_tensor(out, want, label, **({} if exact else tol))
        return
    inputs = [rank_input(k, dtype, _LEN) for k in range(n)]
    t = inputs[r].clone()
    if collective == "all_reduce":
        dist.all_reduce(t, op=op)
        assert_tensor(t, expect(inputs), label, **({} if exact else tol))
    else:
        dst = n - 1
        dist.reduce(t, dst=dst, op=op)
        if r == dst:
            assert_tensor(t, expect(inputs), label, **({} if exact else tol))


def _dtype_requires(dtype: str, collective: str = "all_reduce") -> list:
    return [collective, f"dtype.{dtype}"]


@body(
    params=[{"dtype": d, "collective": c} for d in DTYPES for c in _COLLECTIVES],
    requires=lambda dtype, collective: _dtype_requires(dtype, collective),
)
def reduce_ops(dtype: str = "float32", collective: str = "all_reduce"):
    """Every operator valid on ``dtype`` gives the exact reduction; invalid ones raise first.
    An operator the backend declares unsupported (``reduce_op.<NAME>``) must raise too."""
    problems = []
    for op in valid_ops(dtype):
        if not supports(f"reduce_op.{op}"):
            try:
                _expect_invalid(collective, op, dtype)
            except AssertionError as exc:
                problems.append(f"{exc} (the backend declares reduce_op.{op} unsupported: the declaration is wrong)")
            continue
        _run(
            collective,
            getattr(dist.ReduceOp, op),
            dtype,
            f"{collective} {op} on {dtype}",
            expect=lambda xs, op=op: expected_reduction(xs, op, dtype),
        )
    for op in invalid_ops(dtype):
        try:
            _expect_invalid(collective, op, dtype)
        except AssertionError as exc:
            problems.append(str(exc))
    check_world_works(f"{collective} on {dtype}")
    assert not problems, "operator/dtype pairs that must raise did not:\n  " + "\n  ".join(problems)


def _expect_invalid(collective: str, op_name: str, dtype: str) -> None:
    """An operator the dtype does not support raises on every rank, before communicating."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    op = getattr(dist.ReduceOp, op_name)
    t = rank_input(r, dtype, _LEN * n)
    with raises(ValueError, TypeError, RuntimeError, what=f"{collective} {op_name} on {dtype}") as caught:
        if collective == "all_reduce":
            dist.all_reduce(t, op=op)
        elif collective == "reduce":
            dist.reduce(t, dst=0, op=op)
        else:
            dist.reduce_scatter_tensor(torch.zeros(_LEN, dtype=t.dtype), t, op=op)
    if is_tdist():
        assert isinstance(caught.value, (ValueError, TypeError, dist.DistError)), (
            f"{collective} {op_name} on {dtype} raised {type(caught.value).__name__}, "
            "expected ValueError/TypeError/DistError"
        )


@body(
    params=[{"dtype": d, "collective": c} for d in (*_FLOATS, "complex64") for c in _COLLECTIVES],
    requires=lambda dtype, collective: ["reduce_op.AVG", *_dtype_requires(dtype, collective)],
)
def reduce_avg(dtype: str = "float32", collective: str = "all_reduce"):
    """AVG is the sum divided by the group size."""
    n = dist.get_world_size()

    def expect(xs: list) -> Any:
        torch = _torch()
        wide = torch.complex128 if dtype == "complex64" else torch.float64
        return (torch.stack([x.to(wide) for x in xs]).sum(0) / n).to(dtype_of(dtype))

    _run(collective, dist.ReduceOp.AVG, dtype, f"{collective} AVG on {dtype}", expect=expect)
    check_world_works(f"AVG on {dtype}")


@body(
    params=[{"dtype": d} for d in _INTS],
    requires=lambda dtype: ["reduce_op.AVG", f"dtype.{dtype}"],
    tdist_only="torch's gloo refuses AVG on integers; tdist defines it as NCCL does",
)
def reduce_avg_integers(dtype: str = "int32"):
    """AVG on integers (Lightning averages int64 counters) is NCCL's: the sum divided by the
    group size, truncated toward zero, on all_reduce, reduce and reduce_scatter_tensor."""
    n = dist.get_world_size()

    def expect(xs: list) -> Any:
        torch = _torch()
        total = torch.stack([x.to(torch.int64) for x in xs]).sum(0)
        return torch.div(total, n, rounding_mode="trunc").to(dtype_of(dtype))

    for collective in _COLLECTIVES:
        if supports(collective):
            _run(collective, dist.ReduceOp.AVG, dtype, f"{collective} AVG on {dtype}", expect=expect)
    check_world_works(f"AVG on {dtype}")


@body(
    params=[{"dtype": d, "collective": c} for d in _FLOATS for c in _COLLECTIVES],
    requires=lambda dtype, collective: ["reduce_op.PREMUL_SUM", *_dtype_requires(dtype, collective)],
)
def reduce_premul_sum(dtype: str = "float32", collective: str = "all_reduce"):
    """PREMUL_SUM (make_premul_sum / _make_nccl_premul_sum) multiplies by the factor, then sums;
    the factor may be a Python number or a one-element tensor."""
    torch = _torch()
    maker = getattr(dist, "make_premul_sum", None) or dist._make_nccl_premul_sum

    def expect(xs: list, factor: float) -> Any:
        return (torch.stack([x.to(torch.float64) for x in xs]).sum(0) * factor).to(dtype_of(dtype))

    _run(collective, maker(2.0), dtype, f"{collective} PREMUL_SUM(2.0) on {dtype}", expect=lambda xs: expect(xs, 2.0))
    _run(
        collective,
        dist._make_nccl_premul_sum(0.5),
        dtype,
        f"{collective} _make_nccl_premul_sum(0.5) on {dtype}",
        expect=lambda xs: expect(xs, 0.5),
    )
    _run(
        collective,
        maker(torch.tensor([4.0], dtype=dtype_of(dtype))),
        dtype,
        f"{collective} PREMUL_SUM(tensor 4.0) on {dtype}",
        expect=lambda xs: expect(xs, 4.0),
    )
    check_world_works(f"PREMUL_SUM on {dtype}")


@body(params=[{"dtype": "bool"}])
def reduce_invalid_op_dtype(dtype: str = "bool"):
    """AVG on bool raises on every rank, and the world keeps working."""
    r = dist.get_rank()
    t = rank_input(r, dtype, _LEN)
    with raises(ValueError, TypeError, RuntimeError, what=f"all_reduce AVG on {dtype}"):
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
    check_world_works(f"AVG on {dtype}")
