"""Unique-id encoding and the torch -> NCCL tables (CPU-only, no CuPy needed).

The NCCL constants come from ``nccl_fakes.CONSTANTS``, a copy of CuPy's
``cupy_backends/cuda/libs/nccl.pxd`` values (a test stand-in, see nccl_fakes.py).
"""

from __future__ import annotations

import contextlib
import threading
import types
from datetime import timedelta
from typing import Any

import pytest
import tdist
import torch
from nccl_fakes import CONSTANTS, FakeNccl
from tdist import ReduceOp, Reduction, make_premul_sum
from tdist_nccl import dtypes
from tdist_nccl.backend import parse_device
from tdist_nccl.comm import (
    UNIQUE_ID_BYTES,
    decode_unique_id,
    encode_unique_id,
    new_communicator,
    share_unique_id,
    version_string,
)

C = types.SimpleNamespace(**CONSTANTS)


# ------------------------------------------------------------------ unique id
def test_unique_id_roundtrip_signed():
    uid = tuple(range(-128, 0))
    assert len(uid) == UNIQUE_ID_BYTES
    data = encode_unique_id(uid)
    assert isinstance(data, bytes) and len(data) == 128
    assert data == bytes(v & 0xFF for v in uid)  # the raw bytes, no pickle framing
    assert decode_unique_id(data) == uid


def test_unique_id_roundtrip_mixed_and_extremes():
    uid = tuple([-128, -1, 0, 1, 127] + [(i * 37) % 256 - 128 for i in range(123)])
    assert decode_unique_id(encode_unique_id(uid)) == uid


def test_unique_id_unsigned_platform_values():
    uid = tuple(range(128, 256))  # what get_unique_id returns where char is unsigned
    data = encode_unique_id(uid)
    assert decode_unique_id(data, signed=False) == uid
    assert decode_unique_id(data) == tuple(v - 256 for v in uid)


@pytest.mark.parametrize("bad", [(), (0,) * 127, (0,) * 129, (300,) + (0,) * 127, (-129,) + (0,) * 127])
def test_unique_id_rejects_bad_ids(bad):
    with pytest.raises(ValueError):
        encode_unique_id(bad)


def test_decode_rejects_wrong_length():
    with pytest.raises(tdist.DistBackendError, match="127 bytes"):
        decode_unique_id(b"\0" * 127)


@pytest.mark.parametrize("id_type", [bytes, tuple], ids=["cupy14-bytes", "cupy13-tuple"])
def test_share_unique_id_through_the_store(id_type):
    nccl = FakeNccl(unique_id=id_type)
    store = tdist.HashStore()
    got: dict[int, bytes] = {}

    def rank(r: int) -> None:
        got[r] = share_unique_id(nccl, store, "nccl/unique_id", r, timedelta(seconds=10))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (2, 1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert got[0] == got[1] == got[2] and isinstance(got[0], bytes) and len(got[0]) == 128
    assert store.get("nccl/unique_id") == got[0]


def test_encode_unique_id_takes_cupy14_bytes():
    raw = bytes(range(128))
    assert encode_unique_id(raw) == raw
    assert encode_unique_id(bytearray(raw)) == raw
    with pytest.raises(ValueError, match="128 bytes, got 3"):
        encode_unique_id(b"abc")


class _Communicator:
    """Takes the unique id only in ``accepts`` form, converting like CuPy's Cython does."""

    def __init__(self, accepts: str, seen: list) -> None:
        self.accepts, self.seen = accepts, seen

    def __call__(self, ndev: int, uid: Any, rank: int) -> Any:
        if self.accepts == "bytes" and not isinstance(uid, bytes):
            raise TypeError("Argument 'commId' has incorrect type (expected bytes, got tuple)")
        if self.accepts != "bytes" and not isinstance(uid, tuple):
            raise TypeError("Argument 'commId' has incorrect type (expected tuple, got bytes)")
        if self.accepts == "unsigned" and min(uid) < 0:
            raise OverflowError("can't convert negative value to char")
        if self.accepts == "signed" and max(uid) > 127:
            raise OverflowError("value too large to convert to char")
        self.seen.append(uid)
        return (ndev, rank)


@pytest.mark.parametrize(
    ("accepts", "expected"),
    [
        ("bytes", bytes(range(128, 256))),  # CuPy >= 14
        ("signed", tuple(range(-128, 0))),  # CuPy < 14, char signed (x86)
        ("unsigned", tuple(range(128, 256))),  # CuPy < 14, char unsigned (ARM, POWER)
    ],
)
def test_new_communicator_offers_the_id_in_the_form_cupy_takes(accepts, expected):
    seen: list = []
    nccl = types.SimpleNamespace(NcclCommunicator=_Communicator(accepts, seen))
    comm = new_communicator(nccl, 2, bytes(range(128, 256)), 1, contextlib.nullcontext)
    assert comm == (2, 1) and seen == [expected]


def test_new_communicator_reports_cupys_last_refusal():
    def refuse(ndev: int, uid: Any, rank: int) -> None:
        raise TypeError(f"refused {type(uid).__name__}")

    with pytest.raises(TypeError, match="refused tuple"):
        new_communicator(types.SimpleNamespace(NcclCommunicator=refuse), 2, bytes(128), 0, contextlib.nullcontext)


def test_version_string():
    assert version_string(21803) == "2.18.3"
    assert version_string(2708) == "2.7.8"
    assert version_string(0) == "unknown"


# ------------------------------------------------------------------ dtypes
EXPECTED_TYPES = {
    torch.float16: C.NCCL_FLOAT16,
    torch.bfloat16: C.NCCL_BFLOAT16,
    torch.float32: C.NCCL_FLOAT32,
    torch.float64: C.NCCL_FLOAT64,
    torch.int8: C.NCCL_INT8,
    torch.uint8: C.NCCL_UINT8,
    torch.int32: C.NCCL_INT32,
    torch.int64: C.NCCL_INT64,
    torch.bool: C.NCCL_UINT8,
}


@pytest.mark.parametrize("dtype", list(EXPECTED_TYPES), ids=str)
def test_dtype_table(dtype):
    assert dtypes.nccl_type(FakeNccl(), dtype, 21803, "all_reduce") == EXPECTED_TYPES[dtype]


@pytest.mark.parametrize(
    "op, code",
    [
        (ReduceOp.SUM, C.NCCL_SUM),
        (ReduceOp.PRODUCT, C.NCCL_PROD),
        (ReduceOp.MIN, C.NCCL_MIN),
        (ReduceOp.MAX, C.NCCL_MAX),
        (ReduceOp.AVG, C.NCCL_AVG),
    ],
)
def test_op_table(op, code):
    plan = dtypes.plan_reduction(FakeNccl(), 21803, torch.float32, Reduction(op), "all_reduce")
    assert (plan.nccl_type, plan.nccl_op, plan.divide, plan.prescale) == (C.NCCL_FLOAT32, code, False, False)


@pytest.mark.parametrize(
    "op, code",
    [
        (ReduceOp.SUM, C.NCCL_MAX),
        (ReduceOp.MAX, C.NCCL_MAX),
        (ReduceOp.PRODUCT, C.NCCL_MIN),
        (ReduceOp.MIN, C.NCCL_MIN),
    ],
)
def test_bool_reduces_as_uint8_max_min(op, code):
    plan = dtypes.plan_reduction(FakeNccl(), 21803, torch.bool, Reduction(op), "all_reduce")
    assert (plan.nccl_type, plan.nccl_op) == (C.NCCL_UINT8, code)


def test_avg_native_from_nccl_2_10_else_sum_then_divide():
    native = dtypes.plan_reduction(FakeNccl(), 21000, torch.float16, Reduction(ReduceOp.AVG), "all_reduce")
    assert (native.nccl_op, native.divide) == (C.NCCL_AVG, False)
    old = dtypes.plan_reduction(FakeNccl(version=20907), 20907, torch.float16, Reduction(ReduceOp.AVG), "x")
    assert (old.nccl_op, old.divide) == (C.NCCL_SUM, True)
    no_const = dtypes.plan_reduction(FakeNccl(avg=False), 21803, torch.float32, Reduction(ReduceOp.AVG), "x")
    assert (no_const.nccl_op, no_const.divide) == (C.NCCL_SUM, True)


def test_premul_sum_is_prescale_then_sum():
    plan = dtypes.plan_reduction(FakeNccl(), 21803, torch.float32, make_premul_sum(0.5), "all_reduce")
    assert (plan.nccl_op, plan.prescale, plan.factor) == (C.NCCL_SUM, True, 0.5)
    with pytest.raises(ValueError, match="factor"):
        dtypes.plan_reduction(FakeNccl(), 21803, torch.float32, Reduction(ReduceOp.PREMUL_SUM), "all_reduce")


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_ops_are_refused(op):
    with pytest.raises(TypeError, match=f"ReduceOp.{op.name} is not supported: NCCL has no bitwise reductions"):
        dtypes.plan_reduction(FakeNccl(), 21803, torch.int32, Reduction(op), "all_reduce")


def test_complex_reduces_as_real_pairs_for_sums_only():
    plan = dtypes.plan_reduction(FakeNccl(), 21803, torch.complex64, Reduction(ReduceOp.SUM), "all_reduce")
    assert (plan.as_real, plan.nccl_type) == (True, C.NCCL_FLOAT32)
    with pytest.raises(TypeError, match="complex"):
        dtypes.plan_reduction(FakeNccl(), 21803, torch.complex128, Reduction(ReduceOp.PRODUCT), "all_reduce")


def test_unreducible_dtypes_and_missing_bfloat16():
    with pytest.raises(TypeError, match="cannot reduce int16"):
        dtypes.plan_reduction(FakeNccl(), 21803, torch.int16, Reduction(ReduceOp.SUM), "all_reduce")
    with pytest.raises(TypeError, match="does not expose NCCL_BFLOAT16"):
        dtypes.plan_reduction(FakeNccl(bfloat16=False), 21803, torch.bfloat16, Reduction(ReduceOp.SUM), "all_reduce")
    with pytest.raises(TypeError, match="NCCL >= 2.10"):
        dtypes.plan_reduction(FakeNccl(), 20907, torch.bfloat16, Reduction(ReduceOp.SUM), "all_reduce")
    with pytest.raises(TypeError, match="AVG"):
        dtypes.plan_reduction(FakeNccl(), 21803, torch.bool, Reduction(ReduceOp.AVG), "all_reduce")


def test_integer_avg_is_ncclavg_or_a_truncating_division():
    """Integer AVG as NCCL defines it: the sum divided by the ranks, truncated toward zero."""
    native = dtypes.plan_reduction(FakeNccl(), 21803, torch.int64, Reduction(ReduceOp.AVG), "all_reduce")
    assert not native.divide and native.nccl_op == FakeNccl().NCCL_AVG
    old = dtypes.plan_reduction(FakeNccl(version=20907), 20907, torch.int32, Reduction(ReduceOp.AVG), "all_reduce")
    assert old.divide
    assert dtypes.average_(torch.tensor([7, -7, 6], dtype=torch.int32), 2).tolist() == [3, -3, 3]


@pytest.mark.parametrize(
    "value, index", [(None, None), (3, 3), ("cuda:1", 1), (torch.device("cuda", 2), 2), (torch.device("cuda"), 0)]
)
def test_parse_device(value, index):
    assert parse_device(value) == index


@pytest.mark.parametrize("value", ["cpu", torch.device("cpu"), True, "gpu1"])
def test_parse_device_rejects(value):
    with pytest.raises((ValueError, TypeError), match="device_id"):
        parse_device(value)
