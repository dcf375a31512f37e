"""Helpers for test bodies (they run inside the workers).

``dist`` is the module under test; :func:`raises` checks an error without
pytest; :func:`assert_tensor` compares with a message naming the rank;
:class:`Sub` describes the group a body runs in (the world or a subgroup,
created once per worker and cached); :func:`check_world_works` is the "real
all_reduce afterwards" that proves a failed call left the group usable.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any, Iterator, Optional, Sequence, Union

from ._common import backend_name, dist, is_tdist
from .capabilities import supports

__all__ = [
    "dist",
    "is_tdist",
    "backend_name",
    "supports",
    "raises",
    "assert_tensor",
    "assert_true",
    "assert_equal",
    "rank",
    "world_size",
    "Sub",
    "sub",
    "GROUP_KINDS",
    "subgroup_ranks",
    "check_world_works",
    "DTYPES",
    "dtype_of",
    "expected_world_size",
    "value",
    "value_sum",
    "cached_group",
    "GROUP_ASYNC",
]

#: Every group shape a body can be asked to run in (the ``group`` parameter).
GROUP_KINDS = ("world", "sub")
#: ``params=`` for a body run in every group shape, blocking and with ``async_op=True``.
GROUP_ASYNC = [{"group": g, "async_op": a} for g in GROUP_KINDS for a in (False, True)]


def rank() -> int:
    return dist.get_rank()


def world_size() -> int:
    return dist.get_world_size()


def expected_world_size() -> int:
    """The world size the harness started (independent of the module under test)."""
    return int(os.environ.get("TDIST_TESTING_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))


def _torch() -> Any:
    import torch

    return torch


def dtype_of(name: str) -> Any:
    return getattr(_torch(), name)


#: The dtypes every reduction is checked on (names, so they can be test ids).
DTYPES = (
    "float32",
    "float64",
    "int32",
    "int64",
    "int16",
    "int8",
    "uint8",
    "float16",
    "bfloat16",
    "bool",
    "complex64",
)


class raises:
    """``with raises(ValueError, RuntimeError, match="rank"):`` — like pytest.raises, without pytest.

    Fails with AssertionError when nothing (or something else) is raised;
    ``.value`` holds the exception afterwards.
    """

    def __init__(self, *types: type, match: Optional[str] = None, what: str = "") -> None:
        self.types = types or (Exception,)
        self.match = match
        self.what = what
        self.value: Optional[BaseException] = None

    def __enter__(self) -> "raises":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        names = " or ".join(t.__name__ for t in self.types)
        label = f" ({self.what})" if self.what else ""
        if exc_type is None:
            raise AssertionError(f"rank {_safe_rank()}: expected {names}{label}, nothing was raised")
        if not issubclass(exc_type, self.types):
            return False  # propagate the unexpected exception unchanged
        if self.match is not None and not re.search(self.match, str(exc), re.IGNORECASE | re.DOTALL):
            raise AssertionError(
                f"rank {_safe_rank()}: {exc_type.__name__}{label} message {str(exc)!r} does not match {self.match!r}"
            ) from exc
        self.value = exc
        return True


def _safe_rank() -> Any:
    try:
        return dist.get_rank()
    except Exception:
        return os.environ.get("RANK", "?")


def assert_true(cond: Any, message: str) -> None:
    if not cond:
        raise AssertionError(f"rank {_safe_rank()}: {message}")


def assert_equal(actual: Any, expected: Any, what: str) -> None:
    """``actual == expected`` for plain values, else AssertionError "rank r: what = actual, expected ..."."""
    if not (actual == expected):
        raise AssertionError(f"rank {_safe_rank()}: {what} = {actual!r}, expected {expected!r}")


def assert_tensor(actual: Any, expected: Any, what: str = "", *, atol: float = 0.0, rtol: float = 0.0) -> None:
    """``actual`` equals ``expected`` (a tensor, or a number / list converted with actual's dtype)."""
    torch = _torch()
    if not isinstance(expected, torch.Tensor):
        expected = torch.tensor(expected, dtype=actual.dtype)
    label = f" {what}" if what else ""
    where = f"rank {_safe_rank()}:{label}"
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{where} dtype {actual.dtype}, expected {expected.dtype}")
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(f"{where} shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if atol or rtol:
        ok = torch.allclose(
            actual.to(torch.complex128 if actual.is_complex() else torch.float64),
            expected.to(torch.complex128 if expected.is_complex() else torch.float64),
            atol=atol,
            rtol=rtol,
        )
    else:
        ok = torch.equal(actual, expected)
    if not ok:
        raise AssertionError(f"{where}\n  got      {_short(actual)}\n  expected {_short(expected)}")


def _short(t: Any) -> str:
    flat = t.reshape(-1)
    if flat.numel() <= 16:
        return f"{t.tolist()} ({t.dtype})"
    return f"{tuple(t.shape)} {t.dtype} first {flat[:8].tolist()} ... last {flat[-4:].tolist()}"


def subgroup_ranks(n: int) -> list[int]:
    """The ranks of the "sub" group in a world of ``n``: the odd ranks, so that
    group ranks differ from global ranks (1 -> 0, 3 -> 1); ``[0]`` when n == 1."""
    odd = list(range(1, n, 2))
    return odd or [0]


_GROUPS: dict[tuple, Any] = {}


def cached_group(ranks: Sequence[int], timeout: Optional[float] = None) -> Any:
    """``new_group(ranks)`` created once per worker (every rank must ask for the same groups
    in the same order, which bodies do since they run on every rank)."""
    key = (tuple(sorted(ranks)), timeout)
    group = _GROUPS.get(key)
    if group is None:
        kwargs = {"timeout": timedelta(seconds=timeout)} if timeout else {}
        group = dist.new_group(list(ranks), **kwargs)
        _GROUPS[key] = group
    return group


class Sub:
    """The group a body runs its operations in.

    ``kind`` "world": the default group (``group`` is None, so calls use the
    default exactly as user code does); "sub": :func:`subgroup_ranks`.
    ``members`` are global ranks; ``me`` this rank's group rank (-1 if not a member).
    Roots (``src``/``dst``) are *global* ranks, as in torch.distributed.
    """

    def __init__(self, kind: str = "world") -> None:
        if kind not in GROUP_KINDS:
            raise ValueError(f"unknown group kind {kind!r} (known: {GROUP_KINDS})")
        self.kind = kind
        n = dist.get_world_size()
        self.rank = dist.get_rank()
        if kind == "world":
            self.group = None
            self.members = list(range(n))
        else:
            self.members = subgroup_ranks(n)
            self.group = cached_group(self.members)
        self.size = len(self.members)
        self.is_member = self.rank in self.members
        self.me = self.members.index(self.rank) if self.is_member else -1

    @property
    def kw(self) -> dict:
        """``{"group": group}`` for a subgroup, ``{}`` for the world."""
        return {} if self.group is None else {"group": self.group}

    def global_rank(self, group_rank: int) -> int:
        return self.members[group_rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self.members)


def sub(kind: str = "world") -> Sub:
    return Sub(kind)


def check_world_works(tag: str = "") -> None:
    """A real all_reduce on the default group: proves an earlier error left no
    half-sent message or broken connection behind."""
    torch = _torch()
    n = dist.get_world_size()
    t = torch.arange(4, dtype=torch.float32) + dist.get_rank()
    dist.all_reduce(t)
    expected = torch.arange(4, dtype=torch.float32) * n + n * (n - 1) / 2
    assert_tensor(t, expected, f"all_reduce after {tag or 'the error'}")


def value(rank_: int, *shape: int, dtype: Union[str, Any] = "float32", salt: int = 0) -> Any:
    """A tensor only ``rank_`` would send: ``(rank_ + 1) * 1000 + salt * 100 + arange`` (mod dtype)."""
    torch = _torch()
    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    numel = 1
    for s in shape:
        numel *= s
    base = torch.arange(numel, dtype=torch.float64) % 97 + (rank_ + 1) * 100 + salt * 10
    if dtype == torch.bool:
        return ((torch.arange(numel) + rank_ + salt) % 2 == 0).reshape(shape)
    if dtype in (torch.float16, torch.bfloat16):
        base = torch.arange(numel, dtype=torch.float64) % 17 + (rank_ + 1) * 20 + salt
    if dtype in (torch.int8, torch.uint8):
        base = base % 100
    return base.to(dtype).reshape(shape)


def value_sum(members: Sequence[int], *shape: int, salt: int = 0) -> Any:
    """The sum over ``members`` of :func:`value` (float32): what a SUM reduction gives."""
    total = None
    for m in members:
        v = value(m, *shape, salt=salt)
        total = v if total is None else total + v
    return total
