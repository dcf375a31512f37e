"""The shared-memory engine's C part (tdist_tcp.shared._shmfast, tdist_tcp.shared.native) on its own:
every reduction it does against torch, bit for bit, with the values that tell
implementations apart (NaN, signed zeros, infinities, integer overflow); the step
protocol (WAIT, finish, MISMATCH) against a peer played by the test on a private
segment; its argument checks; how it is switched off; and that tdist-tcp installs
without a C compiler (the engine then runs the same protocol in Python).

The multi-process behaviour (the quick path inside real groups, C and Python ranks in
one group) is in test_tcp_shm.py."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tdist._reduce_op import ReduceOp, Reduction, make_premul_sum
from tdist_tcp.shared import native
from tdist_tcp.shared import shmstep as S

pytestmark = pytest.mark.timeout(120)

FAST = native.native_module({})
needs_c = pytest.mark.skipif(FAST is None, reason="tdist_tcp.shared._shmfast is not built")

SLOT = 4096
P = 2
CTRL, DATA, TOTAL = S.layout(P, SLOT)
FLOATS = (torch.float32, torch.float64)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
INT_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
FLOAT_OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG)


class Segment:
    """A private two-rank segment: this process is rank 0 through the C part, the test
    plays rank 1 by writing its descriptor, data and counter."""

    def __init__(self, spin_ns: int = 0) -> None:
        self.mm = mmap.mmap(-1, TOTAL)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        self.fast = FAST.Fast(self.base, CTRL, DATA, SLOT, 0, P, spin_ns, False)  # type: ignore[union-attr]

    def peer_posts(self, step: int, seq: int, op: int, redop: int, dtype: int, nbytes: int, root: int) -> None:
        at = CTRL + 1 * S.CTRL
        S.DESC.pack_into(self.mm, at + S.DESC_AT + S.DESC_STRIDE * (seq & 1), seq, nbytes, root, op, redop, dtype)
        self.mm[at : at + 4] = step.to_bytes(4, "little")

    def peer_data(self, buffer: int, data: bytes) -> None:
        at = DATA + (2 * 1 + buffer) * SLOT
        self.mm[at : at + len(data)] = data

    def close(self) -> None:
        self.fast = None
        self.mm.close()


def _reference(a: torch.Tensor, b: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """torch's result; MIN/MAX as numpy's (which the Python steps use): of two equal
    values (-0.0 and 0.0) the second, where torch's choice varies."""
    return {
        ReduceOp.SUM: lambda: a + b,
        ReduceOp.PRODUCT: lambda: a * b,
        ReduceOp.MIN: lambda: torch.from_numpy(np.minimum(a.numpy(), b.numpy())),
        ReduceOp.MAX: lambda: torch.from_numpy(np.maximum(a.numpy(), b.numpy())),
        ReduceOp.BAND: lambda: a & b,
        ReduceOp.BOR: lambda: a | b,
        ReduceOp.BXOR: lambda: a ^ b,
        ReduceOp.AVG: lambda: (a + b) / 2,
    }[op]()


def _operands(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    if dtype.is_floating_point:
        nan, inf = float("nan"), float("inf")
        a = torch.tensor([1.5, -0.0, 0.0, nan, 2.0, inf, -inf, 1e308, 3.0, -7.25, 1e-30], dtype=torch.float64)
        b = torch.tensor([2.25, 0.0, -0.0, 1.0, nan, -inf, 5.0, 1e308, 3.0, 0.5, 1e-30], dtype=torch.float64)
        return a.to(dtype), b.to(dtype)
    info = torch.iinfo(dtype)
    a = torch.tensor([info.max, info.min, 0, -1 if info.min else 1, 7, info.max, 3], dtype=torch.int64)
    b = torch.tensor([1, -1 if info.min else 1, info.max, 5, -3 if info.min else 3, info.max, 3], dtype=torch.int64)
    return a.to(dtype), b.to(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@needs_c
@pytest.mark.parametrize(
    "dtype,op",
    [(d, o) for d in FLOATS for o in FLOAT_OPS] + [(d, o) for d in INTS for o in INT_OPS],
    ids=lambda v: str(v).replace("torch.", "").replace("ReduceOp.", ""),
)
def test_reductions_match_torch_bit_for_bit(dtype, op):
    seg = Segment()
    try:
        mine, theirs = _operands(dtype)
        out = mine.clone()
        etype = native.element_type(dtype)
        eop = native.operator(Reduction(op), etype)
        assert etype and eop
        seg.peer_data(0, _bits(theirs))
        seg.peer_posts(1, 7, 3, 1, 9, out.nbytes, 0)
        outcome = seg.fast.run(native.REDUCE, 7, 3, 1, 9, out.data_ptr(), out.nbytes, -1, etype, eop)
        assert outcome == native.DONE
        want = _reference(mine, theirs, op)
        assert _bits(out) == _bits(want), (out.tolist(), want.tolist())
        assert (seg.fast.k, seg.fast.rounds, seg.fast.runs, seg.fast.pending) == (1, 1, 1, 0)
    finally:
        seg.close()


@needs_c
def test_reduce_to_a_root_leaves_the_others_alone_and_broadcast_reads_the_root():
    seg = Segment()
    try:
        t = torch.tensor([1.0, 2.0])
        seg.peer_data(0, _bits(torch.tensor([10.0, 20.0])))
        seg.peer_posts(1, 1, 3, 1, 9, 8, 1)
        assert seg.fast.run(native.REDUCE, 1, 3, 1, 9, t.data_ptr(), 8, 1, 1, 1) == native.DONE
        assert t.tolist() == [1.0, 2.0]  # rank 1 is the root
        seg.peer_data(1, _bits(torch.tensor([5.0, 6.0])))  # round 2 uses the other buffer
        seg.peer_posts(2, 2, 1, 0, 9, 8, 1)
        assert seg.fast.run(native.BROADCAST, 2, 1, 0, 9, t.data_ptr(), 8, 1, 0, 0) == native.DONE
        assert t.tolist() == [5.0, 6.0]
        seg.peer_posts(3, 3, 9, 0, 0, 0, 0)
        assert seg.fast.run(native.BARRIER, 3, 9, 0, 0, 0, 0, 0, 0, 0) == native.DONE
        assert (seg.fast.k, seg.fast.rounds) == (3, 2)  # a barrier uses no buffer
    finally:
        seg.close()


@needs_c
@pytest.mark.parametrize("spin_ns", [0, 200_000], ids=["no-spin", "spin-200us"])
def test_a_late_peer_leaves_the_step_pending_until_finish(spin_ns):
    seg = Segment(spin_ns)
    try:
        t = torch.tensor([1, 2], dtype=torch.int32)
        assert seg.fast.run(native.REDUCE, 5, 3, 1, 4, t.data_ptr(), 8, -1, 6, 1) == native.WAIT
        assert seg.fast.pending == native.REDUCE
        with pytest.raises(RuntimeError, match="pending"):
            seg.fast.run(native.BARRIER, 6, 9, 0, 0, 0, 0, 0, 0, 0)
        with pytest.raises(RuntimeError, match="not posted"):
            seg.fast.finish()
        seg.peer_data(0, _bits(torch.tensor([30, 40], dtype=torch.int32)))
        seg.peer_posts(1, 5, 3, 1, 4, 8, 0)
        assert seg.fast.finish() == native.DONE
        assert t.tolist() == [31, 42] and seg.fast.pending == 0
        with pytest.raises(RuntimeError, match="nothing is pending"):
            seg.fast.finish()
    finally:
        seg.close()


@needs_c
@pytest.mark.parametrize("field", ["seq", "nbytes", "root", "op", "redop", "dtype"])
def test_a_peer_with_another_descriptor_is_a_mismatch_and_nothing_is_written(field):
    seg = Segment()
    try:
        desc = dict(seq=4, op=3, redop=1, dtype=9, nbytes=8, root=0)
        desc[field] += 2 if field != "seq" else 0
        t = torch.tensor([1.0, 2.0])
        seg.peer_posts(1, **desc)
        outcome = seg.fast.run(native.REDUCE, 4, 3, 1, 9, t.data_ptr(), 8, -1, 1, 1)
        if field == "seq":  # the same sequence number written again: not a difference
            assert outcome == native.DONE
        else:
            assert outcome == native.MISMATCH
            assert t.tolist() == [1.0, 2.0] and seg.fast.pending == 0
    finally:
        seg.close()


@needs_c
def test_bad_arguments_are_refused_before_anything_is_posted():
    seg = Segment()
    try:
        t = torch.zeros(4)
        bad = [
            ((native.REDUCE, 1, 3, 1, 9, t.data_ptr(), 16, -1, 1, 5), ValueError),  # BAND on floats
            ((native.REDUCE, 1, 3, 1, 9, t.data_ptr(), 16, -1, 6, 8), ValueError),  # AVG on integers
            ((native.REDUCE, 1, 3, 1, 9, t.data_ptr(), 14, -1, 1, 1), ValueError),  # not whole elements
            ((native.REDUCE, 1, 3, 1, 9, t.data_ptr(), SLOT + 4, -1, 1, 1), ValueError),  # over a buffer
            ((native.REDUCE, 1, 3, 1, 9, t.data_ptr(), 16, -1, 99, 1), ValueError),  # unknown element type
            ((native.BROADCAST, 1, 1, 0, 9, t.data_ptr(), 16, 2, 0, 0), ValueError),  # root out of range
            ((42, 1, 1, 0, 9, t.data_ptr(), 16, 0, 0, 0), ValueError),  # unknown kind
            ((native.BARRIER, 1, 9), TypeError),  # too few arguments
            ((native.BARRIER, 1, 9, 0, 0, 0, 0, 0, 0, "x"), TypeError),
        ]
        for args, error in bad:
            with pytest.raises(error):
                seg.fast.run(*args)
        assert (seg.fast.k, seg.fast.rounds, seg.fast.runs, seg.fast.pending) == (0, 0, 0, 0)
        with pytest.raises(ValueError, match="geometry"):
            FAST.Fast(seg.base, CTRL, DATA, SLOT, 2, 2, 0, False)  # type: ignore[union-attr]
    finally:
        seg.close()


def _inputs(dtype: torch.dtype, p: int, n: int) -> list[torch.Tensor]:
    """``p`` operands of ``n`` elements with the telling values of :func:`_operands` mixed in."""
    g = torch.Generator().manual_seed(p * 1000 + n)
    special = _operands(dtype)
    out = []
    for q in range(p):
        if dtype.is_floating_point:
            t = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
        else:
            info = torch.iinfo(dtype)
            t = torch.randint(info.min, info.max, (n,), generator=g, dtype=torch.int64).to(dtype)
        t[: special[0].numel()] = special[q % 2]
        out.append(t)
    return out


@needs_c
@pytest.mark.parametrize("p", [1, 3, 5])
@pytest.mark.parametrize(
    "dtype,op",
    [(d, o) for d in FLOATS for o in FLOAT_OPS] + [(torch.int8, o) for o in INT_OPS] + [(torch.int64, ReduceOp.SUM)],
    ids=lambda v: str(v).replace("torch.", "").replace("ReduceOp.", ""),
)
def test_combine_reduces_any_number_of_inputs_in_rank_order_bit_for_bit(dtype, op, p):
    """``combine``, the large all_reduce's reduction: over several cache tiles and a ragged
    end, ``out`` = in0 op in1 op ... in that order, the same bits as reducing pair by pair
    (the Python steps' order), ``also`` a copy of it, and the inputs untouched; ``also`` may
    be one of the inputs."""
    n = 3 * 4096 + 7
    ins = _inputs(dtype, p, n)
    before = [_bits(t) for t in ins]
    want = ins[0].clone()
    for t in ins[1:]:
        want = _reference(want, t, op if op is not ReduceOp.AVG else ReduceOp.SUM)
    if op is ReduceOp.AVG:
        want = want / p
    out, also = torch.empty_like(ins[0]), torch.empty_like(ins[0])
    etype = native.element_type(dtype)
    FAST.combine(
        etype, native.operator(Reduction(op), etype), n, out.data_ptr(), also.data_ptr(), *(t.data_ptr() for t in ins)
    )  # type: ignore[union-attr]
    assert _bits(out) == _bits(want) and _bits(also) == _bits(want)
    assert [_bits(t) for t in ins] == before
    mine = ins[p // 2]  # also may be an input: the rank's own tensor, overwritten with the result
    FAST.combine(
        etype, native.operator(Reduction(op), etype), n, out.data_ptr(), mine.data_ptr(), *(t.data_ptr() for t in ins)
    )  # type: ignore[union-attr]
    assert _bits(mine) == _bits(want)
    FAST.combine(etype, native.operator(Reduction(op), etype), 0, out.data_ptr(), 0, ins[0].data_ptr())  # type: ignore[union-attr]


@needs_c
def test_combine_refuses_bad_arguments():
    t = torch.zeros(4)
    a = t.data_ptr()
    bad = [
        ((1, 1, 4, a, 0), TypeError),  # no input
        ((1, 1, 4, a, 0) + (a,) * 4097, TypeError),  # more inputs than a segment has ranks
        ((1, 5, 4, a, 0, a), ValueError),  # BAND on floats
        ((6, 8, 4, a, 0, a), ValueError),  # AVG on integers
        ((99, 1, 4, a, 0, a), ValueError),  # unknown element type
        ((1, 1, -1, a, 0, a), ValueError),  # negative size
        ((1, 1, 4, 0, 0, a), ValueError),  # no output
        ((1, 1, 4, a, 0, a, 0), ValueError),  # an input at address 0
        ((1, 1, 4, a, 0, "x"), TypeError),
    ]
    for args, error in bad:
        with pytest.raises(error):
            FAST.combine(*args)  # type: ignore[union-attr]


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@needs_c
@pytest.mark.parametrize(
    "dtype,op", [(torch.float32, ReduceOp.SUM), (torch.float64, ReduceOp.AVG), (torch.int16, ReduceOp.BXOR)]
)
def test_cma_combine_reduces_a_slice_from_every_member_and_writes_it_into_all(dtype, op):
    """``cma_combine`` (tdist_tcp.shared.cma): member r's slice of p members' tensors, read
    through ``process_vm_readv`` (here every member is this process), reduced in member
    order over several tiles and a ragged end, and written into every member's tensor;
    the same bits as ``combine``."""
    p, r, n = 3, 1, 50000 + 3
    ins = _inputs(dtype, p, n)
    want = torch.empty_like(ins[0])
    etype = native.element_type(dtype)
    eop = native.operator(Reduction(op), etype)
    FAST.combine(etype, eop, n, want.data_ptr(), 0, *(t.data_ptr() for t in ins))  # type: ignore[union-attr]
    pid = os.getpid()
    done = FAST.cma_combine(etype, eop, n, r, ins[r].data_ptr(), *[pid] * p, *(t.data_ptr() for t in ins))  # type: ignore[union-attr]
    assert done is None
    assert [_bits(t) for t in ins] == [_bits(want)] * p


@needs_c
def test_cma_says_which_member_it_cannot_reach_and_probes_tell_the_right_process():
    import errno

    t = torch.arange(8, dtype=torch.float32)
    a, me, gone = t.data_ptr(), os.getpid(), _gone_pid()
    assert FAST.cma_combine(1, 1, 8, 0, a, me, gone, a, a) == (1, errno.ESRCH)  # type: ignore[union-attr]
    other = torch.arange(8, dtype=torch.float32)
    assert FAST.cma_probe(me, a, other.data_ptr(), 32) == 0  # type: ignore[union-attr]
    other[3] = -1.0
    assert FAST.cma_probe(me, a, other.data_ptr(), 32) == -1  # type: ignore[union-attr]
    assert FAST.cma_probe(gone, a, a, 8) == errno.ESRCH  # type: ignore[union-attr]
    assert FAST.cma_probe(me, 1, a, 8) == errno.EFAULT  # type: ignore[union-attr]
    for args, error in [
        ((1, 1, 8, 0, a, me, a), TypeError),  # one member
        ((1, 5, 8, 0, a, me, me, a, a), ValueError),  # BAND on floats
        ((1, 1, 8, 2, a, me, me, a, a), ValueError),  # no such member
        ((1, 1, 8, 0, 0, me, me, a, a), ValueError),  # no tensor
    ]:
        with pytest.raises(error):
            FAST.cma_combine(*args)  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        FAST.cma_probe(me, a, a, 65)  # type: ignore[union-attr]


def test_codes_cover_what_the_c_part_reduces_and_nothing_else():
    assert [native.element_type(d) for d in FLOATS + INTS] == [1, 2, 3, 4, 5, 6, 7]
    for dtype in (torch.float16, torch.bfloat16, torch.complex64, torch.bool):
        assert native.element_type(dtype) == 0
    f32, i32 = native.element_type(torch.float32), native.element_type(torch.int32)
    assert native.operator(Reduction(ReduceOp.AVG), f32) and not native.operator(Reduction(ReduceOp.AVG), i32)
    assert native.operator(Reduction(ReduceOp.BXOR), i32) and not native.operator(Reduction(ReduceOp.BXOR), f32)
    assert native.operator(make_premul_sum(2.0), f32) == 0
    assert native.operator(Reduction(ReduceOp.SUM), 0) == 0


def test_switched_off_by_option_or_environment(monkeypatch):
    assert native.native_module({"native": False}) is None
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    assert native.native_module({}) is None
    assert native.native_module({"native": True}) is FAST  # the option wins
    monkeypatch.setenv(native.NATIVE_ENV, "maybe")
    with pytest.raises(ValueError, match=native.NATIVE_ENV):
        native.native_module({})


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler here")
def test_installs_without_a_c_compiler(tmp_path):
    """The extension is optional: with a compiler that always fails, the wheel still
    builds (pure Python, no _shmfast), and with one it contains the extension."""
    source = Path(native.__file__).resolve().parents[3]
    assert (source / "setup.py").is_file(), source
    copy = tmp_path / "tdist-tcp"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("*.so", "build", "*.egg-info", "__pycache__"))

    def wheel_files(env: dict, name: str) -> list[str]:
        out = tmp_path / name
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(out),
                str(copy),
            ],
            env=env,
            check=True,
            timeout=100,
            capture_output=True,
        )
        (wheel,) = out.glob("*.whl")
        return zipfile.ZipFile(wheel).namelist()

    names = wheel_files({**os.environ, "CC": "false", "LDSHARED": "false"}, "without")
    assert "tdist_tcp/shared/native.py" in names and "tdist_tcp/shared/shm.py" in names
    assert not [n for n in names if n.endswith((".so", ".pyd", ".c"))], names
    names = wheel_files(dict(os.environ), "with")
    assert [n for n in names if n.startswith("tdist_tcp/shared/_shmfast") and n.endswith(".so")], names
