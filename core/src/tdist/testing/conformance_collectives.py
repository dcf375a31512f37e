"""Conformance bodies: every collective, on the world and on a subgroup, blocking
and with ``async_op=True``; sizes from empty to 4 Mi elements; strided views.

In the "sub" runs the non-members call every operation too and must get
``None`` back with their tensors untouched, as in torch.distributed. Roots
(``src``/``dst``) are global ranks.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

from ._registry import body
from .helpers import (
    GROUP_ASYNC,
    GROUP_KINDS,
    Sub,
    assert_tensor,
    assert_true,
    dist,
    is_tdist,
    value,
    value_sum,
)

__all__ = [
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "gather_single",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_uneven",
    "barrier",
    "barrier_blocks",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all_single_uneven",
    "collective_sizes",
    "zero_dim_and_empty",
    "noncontiguous",
    "work_api",
    "future_callback_issues_collective",
]

#: torch gloo's Work of these reports is_completed() == False after wait() returned
#: (the deprecated docs guarantee True); only tolerated for the reference.
_REFERENCE_IS_COMPLETED_QUIRK = ("reduce_scatter", "reduce_scatter_tensor")


def _torch():
    import torch

    return torch


def issue(s: Sub, fn: Callable[..., Any], *args: Any, async_op: bool = False, **kwargs: Any) -> None:
    """Call collective ``fn`` in group ``s``; check what it returns (None for a blocking
    call or a non-member, a Work otherwise) and wait for it."""
    name = getattr(fn, "__name__", str(fn))
    result = fn(*args, async_op=async_op, **s.kw, **kwargs)
    if not s.is_member:
        assert_true(result is None, f"non-member call of {name} returned {result!r}, expected None")
        return
    if not async_op:
        assert_true(result is None, f"blocking {name} returned {result!r}, expected None")
        return
    assert_true(result is not None, f"{name}(async_op=True) returned None instead of a Work")
    result.wait()
    if is_tdist() or name not in _REFERENCE_IS_COMPLETED_QUIRK:
        assert_true(result.is_completed(), f"{name}: is_completed() is False after wait()")


def _untouched(t: Any, fill: float, what: str) -> None:
    torch = _torch()
    assert_tensor(t, torch.full_like(t, fill), f"non-member's {what} must stay untouched")


@body(params=GROUP_ASYNC)
def broadcast(group: str = "world", async_op: bool = False):
    """broadcast from every member as root; float32, int64 and bool."""
    torch = _torch()
    s = Sub(group)
    for src in s.members:
        for dtype in ("float32", "int64", "bool"):
            t = value(src, 3, 2, dtype=dtype) if s.rank == src else torch.zeros(3, 2, dtype=getattr(torch, dtype))
            before = t.clone()
            issue(s, dist.broadcast, t, src=src, async_op=async_op)
            if s.is_member:
                assert_tensor(t, value(src, 3, 2, dtype=dtype), f"broadcast from {src} ({dtype})")
            else:
                assert_tensor(t, before, "non-member's tensor must stay untouched")


@body(params=GROUP_ASYNC)
def all_reduce(group: str = "world", async_op: bool = False):
    """all_reduce SUM (default op) and MAX in the group."""
    torch = _torch()
    s = Sub(group)
    t = value(s.rank, 5)
    issue(s, dist.all_reduce, t, async_op=async_op)
    if s.is_member:
        assert_tensor(t, value_sum(s.members, 5), "all_reduce SUM")
    else:
        assert_tensor(t, value(s.rank, 5), "non-member's tensor must stay untouched")
    t = torch.tensor([float(s.rank), -float(s.rank)])
    issue(s, dist.all_reduce, t, op=dist.ReduceOp.MAX, async_op=async_op)
    if s.is_member:
        assert_tensor(t, torch.tensor([float(max(s.members)), -float(min(s.members))]), "all_reduce MAX")


@body(params=GROUP_ASYNC)
def reduce(group: str = "world", async_op: bool = False):
    """reduce SUM to every member in turn; only the destination's result is defined."""
    s = Sub(group)
    for dst in s.members:
        t = value(s.rank, 4)
        issue(s, dist.reduce, t, dst=dst, async_op=async_op)
        if s.rank == dst:
            assert_tensor(t, value_sum(s.members, 4), f"reduce to {dst}")
        elif not s.is_member:
            assert_tensor(t, value(s.rank, 4), "non-member's tensor must stay untouched")


@body(params=GROUP_ASYNC)
def all_gather(group: str = "world", async_op: bool = False):
    """all_gather into a list: entry i is group rank i's tensor."""
    torch = _torch()
    s = Sub(group)
    out = [torch.full((2, 3), -1.0) for _ in range(s.size)]
    issue(s, dist.all_gather, out, value(s.rank, 2, 3), async_op=async_op)
    for i, m in enumerate(s.members):
        if s.is_member:
            assert_tensor(out[i], value(m, 2, 3), f"all_gather entry {i} (rank {m})")
        else:
            _untouched(out[i], -1.0, "output list")


@body(params=GROUP_ASYNC)
def gather(group: str = "world", async_op: bool = False):
    """gather to every member in turn; gather_list only on the destination."""
    torch = _torch()
    s = Sub(group)
    for dst in s.members:
        gather_list = [torch.full((3,), -1.0) for _ in range(s.size)] if s.rank == dst else None
        issue(s, dist.gather, value(s.rank, 3, salt=dst), gather_list=gather_list, dst=dst, async_op=async_op)
        if gather_list is not None:  # this rank is dst
            for i, m in enumerate(s.members):
                assert_tensor(gather_list[i], value(m, 3, salt=dst), f"gather to {dst}, entry {i}")


@body(params=GROUP_ASYNC, tdist_only="gather_single is torch 2.14's (the reference runs torch's older release)")
def gather_single(group: str = "world", async_op: bool = False):
    """gather_single to every member in turn, into a flat and into a stacked gather_tensor
    (and under its older name gather_into_tensor); a missing or wrongly sized
    gather_tensor on the destination is refused before communicating."""
    torch = _torch()
    s = Sub(group)
    for dst in s.members:
        for shape in ((s.size * 6,), (s.size, 2, 3)):
            out = torch.full(shape, -1.0) if s.rank == dst else None
            issue(s, dist.gather_single, value(s.rank, 2, 3, salt=dst), out, dst=dst, async_op=async_op)
            if out is not None:
                expected = torch.stack([value(m, 2, 3, salt=dst) for m in s.members]).view(shape)
                assert_tensor(out, expected, f"gather_single to {dst} into shape {shape}")
    if not s.is_member:
        return
    dst = s.members[0]
    if s.rank == dst:
        for bad in (None, torch.zeros(s.size * 6 + 1), torch.zeros(s.size * 12)[::2]):
            try:
                dist.gather_single(value(s.rank, 2, 3), bad, dst=dst, **s.kw)
            except ValueError:
                continue
            raise AssertionError(f"gather_single accepted gather_tensor {bad if bad is None else tuple(bad.shape)}")
    out = torch.zeros(s.size * 4) if s.rank == dst else None
    issue(s, dist.gather_into_tensor, value(s.rank, 4), out, dst=dst)
    if out is not None:
        assert_tensor(out, torch.cat([value(m, 4) for m in s.members]), "gather_into_tensor")


@body(params=GROUP_ASYNC)
def scatter(group: str = "world", async_op: bool = False):
    """scatter from every member in turn; scatter_list only on the source."""
    torch = _torch()
    s = Sub(group)
    for src in s.members:
        scatter_list = [value(src, 2, 2, salt=i) for i in range(s.size)] if s.rank == src else None
        out = torch.full((2, 2), -1.0)
        issue(s, dist.scatter, out, scatter_list=scatter_list, src=src, async_op=async_op)
        if s.is_member:
            assert_tensor(out, value(src, 2, 2, salt=s.me), f"scatter from {src}")
        else:
            _untouched(out, -1.0, "output")


@body(params=GROUP_ASYNC, requires=("reduce_scatter",))
def reduce_scatter(group: str = "world", async_op: bool = False):
    """reduce_scatter (list form): group rank i gets the sum of everyone's input i."""
    torch = _torch()
    s = Sub(group)
    inputs = [value(s.rank, 3, salt=i) for i in range(s.size)]
    out = torch.full((3,), -1.0)
    issue(s, dist.reduce_scatter, out, inputs, async_op=async_op)
    if s.is_member:
        assert_tensor(out, value_sum(s.members, 3, salt=s.me), "reduce_scatter")
    else:
        _untouched(out, -1.0, "output")


@body(params=GROUP_ASYNC, requires=("all_to_all",))
def all_to_all(group: str = "world", async_op: bool = False):
    """all_to_all (list form): output j holds group rank j's input for me."""
    torch = _torch()
    s = Sub(group)
    inputs = [value(s.rank, 3, salt=j) for j in range(s.size)]
    outputs = [torch.full((3,), -1.0) for _ in range(s.size)]
    issue(s, dist.all_to_all, outputs, inputs, async_op=async_op)
    for j, m in enumerate(s.members):
        if s.is_member:
            assert_tensor(outputs[j], value(m, 3, salt=s.me), f"all_to_all from {m}")
        else:
            _untouched(outputs[j], -1.0, "output list")


@body(
    params=[{"group": g} for g in GROUP_KINDS],
    requires=("all_to_all",),
    reference_xfail="torch gloo's all_to_all needs every tensor to have the same size",
)
def all_to_all_uneven(group: str = "world"):
    """all_to_all (list form) with a different tensor size per destination, as torch documents."""
    torch = _torch()
    s = Sub(group)
    inputs = [value(s.rank, j + 1, salt=j) for j in range(s.size)]  # size j+1 for group rank j
    me = max(s.me, 0)
    outputs = [torch.full((me + 1,), -1.0) for _ in range(s.size)]
    issue(s, dist.all_to_all, outputs, inputs)
    for j, m in enumerate(s.members):
        if s.is_member:
            assert_tensor(outputs[j], value(m, s.me + 1, salt=s.me), f"all_to_all from {m}")


@body(params=GROUP_ASYNC)
def barrier(group: str = "world", async_op: bool = False):
    """barrier returns (three times in a row) on every member."""
    s = Sub(group)
    for _ in range(3):
        issue(s, dist.barrier, async_op=async_op)


@body(min_world_size=2)
def barrier_blocks():
    """barrier waits for the last rank: rank 0 arrives 0.5 s late and nobody leaves before it."""
    r = dist.get_rank()
    dist.barrier()
    if r == 0:
        time.sleep(0.5)
    start = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - start
    if r != 0:
        assert_true(waited >= 0.3, f"left the barrier after {waited:.3f} s, before rank 0 (0.5 s late) entered")


@body(params=GROUP_ASYNC, requires=("all_gather_into_tensor",))
def all_gather_into_tensor(group: str = "world", async_op: bool = False):
    """all_gather_into_tensor: output is every member's input concatenated in group-rank order."""
    torch = _torch()
    s = Sub(group)
    out = torch.full((s.size * 3, 2), -1.0)
    issue(s, dist.all_gather_into_tensor, out, value(s.rank, 3, 2), async_op=async_op)
    if s.is_member:
        assert_tensor(out, torch.cat([value(m, 3, 2) for m in s.members]), "all_gather_into_tensor")
    else:
        _untouched(out, -1.0, "output")


@body(params=GROUP_ASYNC, requires=("reduce_scatter_tensor",))
def reduce_scatter_tensor(group: str = "world", async_op: bool = False):
    """reduce_scatter_tensor: chunk i of the sum over members goes to group rank i."""
    torch = _torch()
    s = Sub(group)
    inp = torch.cat([value(s.rank, 4, salt=i) for i in range(s.size)])
    out = torch.full((4,), -1.0)
    issue(s, dist.reduce_scatter_tensor, out, inp, async_op=async_op)
    if s.is_member:
        assert_tensor(out, value_sum(s.members, 4, salt=s.me), "reduce_scatter_tensor")
    else:
        _untouched(out, -1.0, "output")


@body(params=GROUP_ASYNC, requires=("all_to_all_single",))
def all_to_all_single(group: str = "world", async_op: bool = False):
    """all_to_all_single with even splits (no split sizes given)."""
    torch = _torch()
    s = Sub(group)
    inp = torch.cat([value(s.rank, 2, 3, salt=j) for j in range(s.size)])
    out = torch.full((s.size * 2, 3), -1.0)
    issue(s, dist.all_to_all_single, out, inp, async_op=async_op)
    if s.is_member:
        expected = torch.cat([value(m, 2, 3, salt=s.me) for m in s.members])
        assert_tensor(out, expected, "all_to_all_single")
    else:
        _untouched(out, -1.0, "output")


def _split(a: int, b: int) -> int:
    """Rows group rank ``a`` sends to group rank ``b`` (0 included: empty pieces)."""
    return (a + 2 * b) % 3


@body(params=[{"group": g} for g in GROUP_KINDS], requires=("all_to_all_single",))
def all_to_all_single_uneven(group: str = "world"):
    """all_to_all_single with uneven split sizes, some of them zero, on 2-D rows."""
    torch = _torch()
    s = Sub(group)
    me = max(s.me, 0)
    in_splits = [_split(me, j) for j in range(s.size)]
    out_splits = [_split(j, me) for j in range(s.size)]
    pieces = [value(s.rank, in_splits[j], 2, salt=j) for j in range(s.size)]
    inp = torch.cat(pieces) if pieces else torch.zeros(0, 2)
    out = torch.full((sum(out_splits), 2), -1.0)
    issue(s, dist.all_to_all_single, out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    if s.is_member:
        expected = torch.cat([value(m, out_splits[j], 2, salt=s.me) for j, m in enumerate(s.members)])
        assert_tensor(out, expected, f"uneven all_to_all_single (in {in_splits}, out {out_splits})")


_SIZES = (1, 3, 1023, 4 * 1024 * 1024)


@body(params=[{"numel": n} for n in _SIZES], timeout=180)
def collective_sizes(numel: int = 1):
    """all_reduce, broadcast, all_gather_into_tensor, reduce_scatter_tensor and
    all_to_all_single at odd and large sizes (4 Mi elements exercises bandwidth paths)."""
    torch = _torch()
    from .helpers import supports

    r, n = dist.get_rank(), dist.get_world_size()
    base = torch.arange(numel, dtype=torch.float32) % 1000
    t = base + r
    dist.all_reduce(t)
    assert_tensor(t, base * n + n * (n - 1) / 2, f"all_reduce of {numel}")
    t = base + r
    dist.broadcast(t, src=n - 1)
    assert_tensor(t, base + (n - 1), f"broadcast of {numel}")
    if supports("all_gather_into_tensor"):
        out = torch.empty(n * numel)
        dist.all_gather_into_tensor(out, base + r)
        assert_tensor(out, torch.cat([base + i for i in range(n)]), f"all_gather_into_tensor of {numel}")
    k = max(1, numel // n)
    chunk = torch.arange(k, dtype=torch.float32) % 1000
    if supports("reduce_scatter_tensor"):
        inp = torch.cat([chunk + r + 10 * j for j in range(n)])
        out = torch.empty(k)
        dist.reduce_scatter_tensor(out, inp)
        assert_tensor(out, chunk * n + n * (n - 1) / 2 + 10 * r * n, f"reduce_scatter_tensor of {k} per rank")
    if supports("all_to_all_single"):
        inp = torch.cat([chunk + 100 * r + j for j in range(n)])
        out = torch.empty(n * k)
        dist.all_to_all_single(out, inp)
        assert_tensor(out, torch.cat([chunk + 100 * i + r for i in range(n)]), f"all_to_all_single of {k} per rank")


@body
def zero_dim_and_empty():
    """0-dim tensors and tensors with no elements through the collectives torch allows them in."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.tensor(float(r + 1))
    dist.all_reduce(t)
    assert_tensor(t, torch.tensor(n * (n + 1) / 2), "0-dim all_reduce")
    t = torch.tensor(r + 5)
    dist.broadcast(t, src=0)
    assert_tensor(t, torch.tensor(5), "0-dim broadcast")
    out = [torch.tensor(-1.0) for _ in range(n)]
    dist.all_gather(out, torch.tensor(float(r)))
    for i in range(n):
        assert_tensor(out[i], torch.tensor(float(i)), f"0-dim all_gather entry {i}")
    e = torch.zeros(0)
    dist.all_reduce(e)
    assert_tensor(e, torch.zeros(0), "empty all_reduce")
    e = torch.zeros(0, 3)
    dist.broadcast(e, src=n - 1)
    assert_tensor(e, torch.zeros(0, 3), "empty broadcast")
    outs = [torch.zeros(0) for _ in range(n)]
    dist.all_gather(outs, torch.zeros(0))
    for i in range(n):
        assert_tensor(outs[i], torch.zeros(0), f"empty all_gather entry {i}")
    t = torch.tensor(float(r + 1))
    dist.reduce(t, dst=0)
    if r == 0:
        assert_tensor(t, torch.tensor(n * (n + 1) / 2), "0-dim reduce")
    dist.barrier()


@body(reference_xfail="torch gloo reduces/broadcasts the underlying storage of a strided view, not the view's elements")
def noncontiguous():
    """Strided views (t[:, ::2]) and transposed tensors: exactly the view's elements
    take part and the rest of the base tensor is untouched."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    base = torch.full((4, 6), float(r + 1))
    base[:, 1::2] = -7.0
    dist.all_reduce(base[:, ::2])
    expected = torch.full((4, 6), float(n * (n + 1) // 2))
    expected[:, 1::2] = -7.0
    assert_tensor(base, expected, "all_reduce of t[:, ::2] (base tensor)")
    tr = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)).t()
    dist.all_reduce(tr)
    expected = (torch.arange(6, dtype=torch.float32).reshape(2, 3) * (n * (n + 1) // 2)).t()
    assert_tensor(tr, expected, "transposed all_reduce")
    base = torch.full((4, 6), float(r))
    dist.broadcast(base[:, ::2], src=0)
    expected = torch.full((4, 6), float(r))
    expected[:, ::2] = 0.0
    assert_tensor(base, expected, "broadcast into t[:, ::2]")
    outs_base = torch.full((n, 3, 4), -1.0)
    outs = [outs_base[i][:, ::2] for i in range(n)]
    src = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * r)[:, 1::2]
    dist.all_gather(outs, src)
    for i in range(n):
        exp = torch.full((3, 4), -1.0)
        exp[:, ::2] = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * i)[:, 1::2]
        assert_tensor(outs_base[i], exp, f"all_gather into strided views, entry {i}")


@body
def work_api():
    """Work from async_op=True: wait(timeout), is_completed, is_success, exception,
    get_future; several outstanding operations waited in reverse order."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    t = torch.ones(3) * (r + 1)
    work = dist.all_reduce(t, async_op=True)
    assert_true(work is not None, "all_reduce(async_op=True) returned None")
    assert_true(work.wait(timeout=timedelta(seconds=30)) in (True, None), "wait(timeout) did not return True")
    assert_true(work.is_completed(), "is_completed() False after wait")
    assert_true(work.is_success(), "is_success() False after a successful wait")
    assert_true(work.exception() is None, f"exception() = {work.exception()!r} after success")
    expected = torch.ones(3) * (n * (n + 1) / 2)
    assert_tensor(t, expected, "async all_reduce")
    fut = work.get_future()
    got = fut.wait()
    assert_true(isinstance(got, (list, tuple)) and len(got) == 1, f"future value {got!r}, expected [tensor]")
    assert_tensor(got[0], expected, "future value of all_reduce")
    # several outstanding at once, waited in reverse order
    tensors = [torch.full((5,), float(r + k)) for k in range(5)]
    works = [dist.all_reduce(x, async_op=True) for x in tensors]
    for w in reversed(works):
        w.wait()
    for k, x in enumerate(tensors):
        assert_tensor(x, torch.full((5,), float(n * k + n * (n - 1) / 2)), f"outstanding all_reduce #{k}")
    # a future callback sees the result
    t2 = torch.full((2,), float(r))
    w2 = dist.all_reduce(t2, async_op=True)
    chained = w2.get_future().then(lambda f: f.value()[0] * 2)
    assert_tensor(chained.wait(), torch.full((2,), float(n * (n - 1))), "future.then on all_reduce")


@body
def future_callback_issues_collective():
    """A Future's ``then`` callback that issues another collective on the same group and
    waits for that one's Future (DDP's PowerSGD hook does this, in the thread that
    completed the first): no deadlock, right values. The callback is attached while the
    first collective is still queued, so a backend runs it in its own thread."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    for round_ in range(3):
        first = torch.full((3,), float(r + round_))
        second = torch.full((2,), float(r + 1))

        def then(fut: Any, second: Any = second) -> Any:
            inner = dist.all_reduce(second, async_op=True).get_future().wait()
            return fut.value()[0] + inner[0].sum()

        chained = dist.all_reduce(first, async_op=True).get_future().then(then)
        expected = n * (n - 1) / 2 + n * round_ + 2 * n * (n + 1) / 2
        assert_tensor(chained.wait(), torch.full((3,), float(expected)), f"round {round_}: then-callback's all_reduce")
