"""Conformance bodies: bad arguments raise a clear error without communicating,
and the world keeps working afterwards (each body ends with a real all_reduce).

Each bad call is made only on the ranks where it is wrong by themselves (e.g.
``scatter_list`` given on a non-source rank), so that no rank is left waiting
for a peer that raised. The checks tdist promises beyond torch.distributed
(validating peers of point-to-point calls, error classes) are gated on
:func:`~tdist.testing.helpers.is_tdist`.
"""

from __future__ import annotations

from typing import Any

from ._registry import body
from .helpers import assert_true, check_world_works, dist, is_tdist, raises

__all__ = [
    "bad_roots",
    "bad_p2p_peers",
    "send_to_self",
    "bad_tensor_lists",
    "bad_tensor_sizes",
    "bad_root_only_arguments",
    "bad_group_ranks",
    "bad_argument_types",
    "init_twice",
]

_ARG_ERRORS = (ValueError, TypeError, RuntimeError)


def _torch():
    import torch

    return torch


def _clear(exc: Any, what: str) -> None:
    """tdist's errors are ValueError/TypeError or a DistError (a RuntimeError), with a message."""
    if exc is None:
        return
    assert_true(str(exc).strip() != "", f"{what}: {type(exc).__name__} with an empty message")
    if is_tdist():
        assert_true(
            isinstance(exc, (ValueError, TypeError, dist.DistError)),
            f"{what}: raised {type(exc).__name__}, expected ValueError, TypeError or a tdist DistError",
        )


def _expect(what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    with raises(*_ARG_ERRORS, what=what) as caught:
        fn(*args, **kwargs)
    _clear(caught.value, what)


@body
def bad_roots():
    """broadcast/reduce/gather/scatter with a root outside the world raise on every rank."""
    torch = _torch()
    n = dist.get_world_size()
    for root in (n, n + 3):
        _expect(f"broadcast(src={root})", dist.broadcast, torch.ones(2), src=root)
        _expect(f"reduce(dst={root})", dist.reduce, torch.ones(2), dst=root)
        if is_tdist():  # torch gloo waits for the missing root instead
            _expect(f"gather(dst={root})", dist.gather, torch.ones(2), None, dst=root)
            _expect(f"scatter(src={root})", dist.scatter, torch.ones(2), None, src=root)
    if is_tdist():
        _expect("broadcast(src=-1)", dist.broadcast, torch.ones(2), src=-1)
    check_world_works("bad roots")


@body(tdist_only="torch.distributed does not validate point-to-point peers (send to rank n waits on the store)")
def bad_p2p_peers():
    """send/recv/isend/irecv to a rank outside the world, or to oneself, raise at once."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    for peer in (n, n + 1, -2):
        _expect(f"send(dst={peer})", dist.send, torch.ones(1), dst=peer)
        _expect(f"isend(dst={peer})", dist.isend, torch.ones(1), dst=peer)
        _expect(f"recv(src={peer})", dist.recv, torch.ones(1), src=peer)
        _expect(f"irecv(src={peer})", dist.irecv, torch.ones(1), src=peer)
    _expect("send to self", dist.send, torch.ones(1), dst=r)
    _expect("recv from self", dist.recv, torch.ones(1), src=r)
    check_world_works("bad p2p peers")


@body
def send_to_self():
    """send to one's own rank is a ValueError (as in torch.distributed)."""
    torch = _torch()
    r = dist.get_rank()
    _expect("send to self", dist.send, torch.ones(1), dst=r)
    check_world_works("send to self")


@body
def bad_tensor_lists():
    """all_gather / all_to_all / reduce_scatter with a list of the wrong length raise on every rank."""
    torch = _torch()
    from .helpers import supports

    n = dist.get_world_size()
    _expect("all_gather with n+1 outputs", dist.all_gather, [torch.zeros(2) for _ in range(n + 1)], torch.ones(2))
    _expect("all_gather with an empty list", dist.all_gather, [], torch.ones(2))
    if n > 1:
        _expect("all_gather with n-1 outputs", dist.all_gather, [torch.zeros(2) for _ in range(n - 1)], torch.ones(2))
    if supports("reduce_scatter"):
        _expect(
            "reduce_scatter with n+1 inputs", dist.reduce_scatter, torch.zeros(2), [torch.ones(2) for _ in range(n + 1)]
        )
    if supports("all_to_all") and is_tdist():
        _expect(
            "all_to_all with n+1 inputs",
            dist.all_to_all,
            [torch.zeros(1) for _ in range(n)],
            [torch.ones(1) for _ in range(n + 1)],
        )
    check_world_works("wrong list lengths")


@body
def bad_tensor_sizes():
    """Mismatched tensor sizes within one rank's arguments raise on every rank."""
    torch = _torch()
    from .helpers import supports

    n = dist.get_world_size()
    _expect(
        "all_gather outputs larger than the input", dist.all_gather, [torch.zeros(3) for _ in range(n)], torch.ones(2)
    )
    if supports("all_gather_into_tensor"):
        _expect(
            "all_gather_into_tensor with a wrong output size",
            dist.all_gather_into_tensor,
            torch.zeros(2 * n + 1),
            torch.ones(2),
        )
    if supports("reduce_scatter_tensor"):
        _expect(
            "reduce_scatter_tensor with a wrong input size",
            dist.reduce_scatter_tensor,
            torch.zeros(2),
            torch.ones(2 * n + 1),
        )
    if supports("all_to_all_single"):
        _expect(
            "all_to_all_single with split sizes not matching the tensors",
            dist.all_to_all_single,
            torch.zeros(n),
            torch.ones(n),
            [2] * n,
            [1] * n,
        )
    check_world_works("mismatched sizes")


@body(min_world_size=2)
def bad_root_only_arguments():
    """scatter_list / gather_list given on a non-root rank, or with the wrong length on the
    root, raise on that rank (the only rank that calls)."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    if r != 0:
        _expect(
            "scatter_list on a non-source rank", dist.scatter, torch.zeros(1), [torch.ones(1) for _ in range(n)], src=0
        )
        _expect(
            "gather_list on a non-destination rank",
            dist.gather,
            torch.zeros(1),
            [torch.zeros(1) for _ in range(n)],
            dst=0,
        )
    else:
        _expect(
            "scatter_list of n+1 tensors on the source",
            dist.scatter,
            torch.zeros(1),
            [torch.ones(1) for _ in range(n + 1)],
            src=0,
        )
        if is_tdist():  # torch gloo fails later, from inside the collective
            _expect(
                "gather_list of n-1 tensors on the destination",
                dist.gather,
                torch.zeros(1),
                [torch.zeros(1) for _ in range(n - 1)],
                dst=0,
            )
    check_world_works("root-only arguments")


@body
def bad_group_ranks():
    """new_group with a rank outside the world (or repeated, for tdist) raises on every rank;
    get_global_rank / get_group_rank outside the group raise."""
    n = dist.get_world_size()
    _expect(f"new_group([0, {n}])", dist.new_group, [0, n])
    _expect("new_group([-1])", dist.new_group, [-1])
    if is_tdist():
        if n > 1:
            _expect("new_group([0, 0, 1]) (duplicate rank)", dist.new_group, [0, 0, 1])
        _expect(f"get_global_rank(WORLD, {n})", dist.get_global_rank, dist.group.WORLD, n)
        _expect(f"get_group_rank(WORLD, {n})", dist.get_group_rank, dist.group.WORLD, n)
    check_world_works("bad group ranks")


@body
def bad_argument_types():
    """A non-tensor where a tensor is expected raises TypeError/ValueError-like errors, no I/O."""
    torch = _torch()
    _expect("all_reduce of a list", dist.all_reduce, [1.0, 2.0])
    _expect("broadcast of a number", dist.broadcast, 3.0, src=0)
    _expect("all_gather with a tensor instead of a list", dist.all_gather, torch.zeros(2), torch.ones(2))
    check_world_works("bad argument types")


@body
def init_twice():
    """init_process_group while initialised raises, and the default group keeps working."""
    from .helpers import backend_name

    _expect("second init_process_group", dist.init_process_group, backend_name())
    assert_true(dist.is_initialized(), "is_initialized() became False after a rejected second init")
    check_world_works("init twice")
