"""Conformance bodies: process groups (new_group, rank translation, non-members,
point-to-point inside a group, several overlapping groups, destroying a group),
monitored_barrier and the multi-GPU API names on CPU tensor lists."""

from __future__ import annotations

from datetime import timedelta

from ._registry import body
from .helpers import (
    assert_equal,
    assert_tensor,
    assert_true,
    backend_name,
    cached_group,
    check_world_works,
    dist,
    is_tdist,
    subgroup_ranks,
    value,
)

__all__ = [
    "group_queries",
    "split_group",
    "local_synchronization",
    "shrink_group_refusals",
    "group_p2p",
    "new_group_options",
    "overlapping_groups",
    "destroy_subgroup",
    "subgroups",
    "unsorted_group",
    "barrier_timeout",
    "monitored_barrier",
    "multigpu_all_reduce",
    "multigpu_broadcast",
    "multigpu_reduce",
    "multigpu_all_gather",
]


def _torch():
    import torch

    return torch


@body
def group_queries():
    """get_rank/get_world_size/get_global_rank/get_group_rank/get_process_group_ranks on
    subgroups (ranks given unsorted); non-members see rank -1 and size -1."""
    r, n = dist.get_rank(), dist.get_world_size()
    shapes = [subgroup_ranks(n), sorted({n - 1, 0}, reverse=True)]  # [n-1, 0]: given in descending order
    for ranks in shapes:
        g = cached_group(ranks)
        members = sorted(ranks)
        if r in members:
            me = members.index(r)
            assert_equal(dist.get_rank(g), me, f"get_rank(group {ranks})")
            assert_equal(dist.get_world_size(g), len(members), f"get_world_size(group {ranks})")
            assert_equal(list(dist.get_process_group_ranks(g)), members, f"get_process_group_ranks(group {ranks})")
            for i, m in enumerate(members):
                assert_equal(dist.get_global_rank(g, i), m, f"get_global_rank(group {ranks}, {i})")
                assert_equal(dist.get_group_rank(g, m), i, f"get_group_rank(group {ranks}, {m})")
            assert_equal(str(dist.get_backend(g)).lower(), backend_name().lower(), f"get_backend(group {ranks})")
        else:
            assert_equal(dist.get_rank(g), -1, f"non-member get_rank(group {ranks})")
            assert_equal(dist.get_world_size(g), -1, f"non-member get_world_size(group {ranks})")
    check_world_works("group queries")


@body(min_world_size=2, requires=("recv_anysource",))
def group_p2p():
    """send/recv with group=: peers are global ranks, recv(src=None) returns the sender's global rank."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    members = [1, 3] if n >= 4 else [0, 1]
    g = cached_group(members)
    a, b = members
    if r == a:
        dist.send(value(a, 3), dst=b, group=g)
        t = torch.zeros(3)
        got = dist.recv(t, src=b, group=g)
        assert_tensor(t, value(b, 3), f"group recv from global rank {b}")
        assert_true(got == b, f"recv(src={b}, group) returned {got!r}, expected global rank {b}")
    elif r == b:
        t = torch.zeros(3)
        sender = dist.recv(t, group=g)
        assert_true(sender == a, f"recv(src=None, group=...) returned {sender!r}, expected global rank {a}")
        assert_tensor(t, value(a, 3), f"group recv from global rank {a}")
        w = dist.isend(value(b, 3), dst=a, group=g)
        w.wait()
    dist.barrier()


@body
def new_group_options():
    """new_group() without ranks is every rank; timeout= and backend= are accepted."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    everyone = dist.new_group()
    assert_true(
        list(dist.get_process_group_ranks(everyone)) == list(range(n)),
        f"new_group() ranks {dist.get_process_group_ranks(everyone)}",
    )
    t = torch.ones(2) * r
    dist.all_reduce(t, group=everyone)
    assert_tensor(t, torch.ones(2) * (n * (n - 1) / 2), "all_reduce on new_group()")
    g = dist.new_group(list(range(n)), timeout=timedelta(seconds=30), backend=backend_name())
    t = torch.ones(2) * r
    dist.all_reduce(t, group=g, op=dist.ReduceOp.MAX)
    assert_tensor(t, torch.ones(2) * (n - 1), "all_reduce MAX on new_group(timeout=, backend=)")


@body(min_world_size=2)
def overlapping_groups():
    """Operations on overlapping groups do not mix: each group's result is its own."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    ga_ranks = [0, 1]
    gb_ranks = list(range(1, n)) if n > 2 else [0, 1]
    ga = cached_group(ga_ranks)
    gb = cached_group(gb_ranks)
    for round_ in range(3):
        if r in ga_ranks:
            t = torch.full((3,), float(r + 10 * round_))
            dist.all_reduce(t, group=ga)
            assert_tensor(t, torch.full((3,), float(sum(ga_ranks) + 20 * round_)), f"group A round {round_}")
        if r in gb_ranks:
            t = torch.full((3,), float(r * 100 + round_))
            dist.all_reduce(t, group=gb)
            expected = torch.full((3,), float(sum(gb_ranks) * 100 + len(gb_ranks) * round_))
            assert_tensor(t, expected, f"group B round {round_}")
        t = torch.full((1,), float(r))
        dist.broadcast(t, src=n - 1)
        assert_tensor(t, torch.full((1,), float(n - 1)), f"world broadcast round {round_}")


@body
def destroy_subgroup():
    """destroy_process_group(group) releases a subgroup; the default group keeps working."""
    torch = _torch()
    n = dist.get_world_size()
    g = dist.new_group(list(range(n)))
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert_tensor(t, torch.ones(1) * n, "all_reduce before destroy")
    dist.destroy_process_group(g)
    assert_true(dist.is_initialized(), "destroying a subgroup de-initialised the default group")
    check_world_works("destroy_process_group(subgroup)")


@body
def subgroups():
    """new_subgroups (consecutive blocks of ranks) and new_subgroups_by_enumeration: every
    rank gets its own subgroup and all handles; get_pg_count counts each creation."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    size = 2 if n % 2 == 0 else 1
    count = dist.get_pg_count()
    mine, handles = dist.new_subgroups(group_size=size)
    assert_equal(len(handles), n // size, "number of subgroups from new_subgroups")
    assert_equal(dist.get_pg_count(), count + n // size, "get_pg_count after new_subgroups")
    block = list(range(r - r % size, r - r % size + size))
    assert_equal(list(dist.get_process_group_ranks(mine)), block, "this rank's subgroup")
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mine)
    assert_tensor(t, torch.tensor([float(sum(block))]), "all_reduce in this rank's subgroup")
    split = [[0], list(range(1, n))] if n > 1 else [[0]]
    mine, handles = dist.new_subgroups_by_enumeration(split)
    assert_equal(len(handles), len(split), "number of subgroups from new_subgroups_by_enumeration")
    members = split[0] if r == 0 else split[1]
    t = torch.ones(1)
    dist.all_reduce(t, group=mine)
    assert_tensor(t, torch.ones(1) * len(members), "all_reduce in an enumerated subgroup")
    if n > 1:
        try:
            dist.new_subgroups(group_size=n + 1)
        except ValueError:
            pass
        else:
            raise AssertionError(f"new_subgroups(group_size={n + 1}) in a world of {n} did not raise ValueError")
    check_world_works("subgroups")


@body(min_world_size=2)
def unsorted_group():
    """new_group(ranks, sort_ranks=False): ``ranks[i]`` is group rank i, for rank queries,
    group_src roots and the order of all_gather's outputs."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    ranks = list(reversed(range(n)))
    g = dist.new_group(ranks, sort_ranks=False)
    assert_equal(dist.get_rank(g), ranks.index(r), "get_rank of an unsorted group")
    assert_equal(list(dist.get_process_group_ranks(g)), ranks, "get_process_group_ranks of an unsorted group")
    assert_equal(dist.get_global_rank(g, 0), n - 1, "get_global_rank(g, 0) of an unsorted group")
    out = [torch.zeros(2) for _ in range(n)]
    dist.all_gather(out, value(r, 2), group=g)
    for i, m in enumerate(ranks):
        assert_tensor(out[i], value(m, 2), f"all_gather entry {i} of an unsorted group (global rank {m})")
    t = value(r, 3)
    dist.broadcast(t, group=g, group_src=0)
    assert_tensor(t, value(n - 1, 3), "broadcast from group rank 0 (global rank n-1)")
    check_world_works("unsorted group")


@body
def barrier_timeout():
    """barrier(timeout=...) completes when every rank arrives; a non-timedelta timeout is
    refused before communicating."""
    dist.barrier(timeout=timedelta(seconds=60))
    if is_tdist():
        try:
            dist.barrier(timeout=5)
        except TypeError:
            pass
        else:
            raise AssertionError("barrier(timeout=5) accepted a number instead of a timedelta")
    check_world_works("barrier(timeout)")


@body(tdist_only="torch's split_group needs an accelerator and a backend that splits communicators (NCCL, XCCL)")
def split_group():
    """split_group: the world split into its even ranks (listed backwards: the order is
    kept) and its odd ranks, each a working group; a rank no split names gets the
    non-member handle; a subgroup is split by its own ranks only; bad ``split_ranks``
    are refused before any communication."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    evens, odds = list(range(0, n, 2))[::-1], list(range(1, n, 2))
    splits = [evens, odds] if odds else [evens]
    g = dist.split_group(split_ranks=splits)
    mine = evens if r in evens else odds
    assert_equal(dist.get_process_group_ranks(g), mine, "the split's ranks, in split order")
    assert_equal(dist.get_rank(g), mine.index(r), "group rank in the split")
    t = torch.full((2,), float(r + 1))
    dist.all_reduce(t, group=g)
    assert_tensor(t, torch.full((2,), float(sum(mine) + len(mine))), "all_reduce in the split")
    lone = dist.split_group(split_ranks=[[n - 1]])
    if r == n - 1:
        assert_equal(dist.get_world_size(lone), 1, "a one-rank split")
    else:
        assert_true(lone is dist.GroupMember.NON_GROUP_MEMBER, f"a rank in no split got {lone!r}")
    members = subgroup_ranks(n)
    if r in members:  # only the parent's ranks call
        parent = cached_group(members)
        part = dist.split_group(parent, [list(range(len(members)))[::-1]])
        assert_equal(dist.get_process_group_ranks(part), members[::-1], "a split of a subgroup")
        t = torch.ones(1)
        dist.all_reduce(t, group=part)
        assert_tensor(t, torch.full((1,), float(len(members))), "all_reduce in a split of a subgroup")
    for bad in ([], [[]], [[0, 0]], [[n]], [[0], [0]], [[-1]]):
        try:
            dist.split_group(split_ranks=bad)
        except ValueError:
            continue
        raise AssertionError(f"split_group accepted split_ranks={bad}")
    for group in (g, lone):
        if group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)
    check_world_works("split_group")


@body(
    min_world_size=2,
    tdist_only="torch names a use_local_synchronization group after how many groups its process knows, "
    "which differs between ranks once some ranks made groups others did not: its ranks then never meet",
)
def local_synchronization():
    """new_group(use_local_synchronization=True) is called by the group's ranks only,
    twice for the same ranks (two distinct groups); both work."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    ends = [0, n - 1]
    if r in ends:
        first = dist.new_group(ends, use_local_synchronization=True)
        second = dist.new_group(ends, use_local_synchronization=True)
        for k, group in enumerate((first, second)):
            t = torch.full((2,), float(r + k))
            dist.all_reduce(t, group=group)
            assert_tensor(t, torch.full((2,), float(n - 1 + 2 * k)), f"all_reduce in local group {k}")
        dist.destroy_process_group(second)
        dist.destroy_process_group(first)
    check_world_works("use_local_synchronization")


@body(min_world_size=3, requires=("shrink_group",), tdist_only="torch's shrink_group is NCCL-only")
def shrink_group_refusals():
    """shrink_group refuses bad arguments before any communication (not a list, empty,
    out of range, a rank twice, every rank, this rank); live ranks that disagree on the
    ranks to exclude all raise DistError at once (none waits for the timeout); the
    world goes on."""
    r, n = dist.get_rank(), dist.get_world_size()
    cases = [((1,), TypeError), ([], ValueError), ([n], ValueError), ([1, 1], ValueError)]
    cases += [(list(range(n)), ValueError), ([r], RuntimeError)]
    for bad, error in cases:
        try:
            dist.shrink_group(bad)
        except error:
            continue
        raise AssertionError(f"shrink_group({bad!r}) did not raise {error.__name__}")
    trio = dist.new_group([0, 1, 2])
    if r < 3:  # rank 0 drops rank 2, rank 1 drops rank 0, rank 2 drops rank 1: each keeps a rank that
        # disagrees with it, and that rank's claim is sure to come (it calls shrink_group too)
        view = [(r + 2) % 3]
        try:
            dist.shrink_group(view, group=trio)
        except dist.DistError as exc:
            assert_true("disagree" in str(exc), f"rank {r}: the refusal does not say why: {exc}")
        else:
            raise AssertionError(f"rank {r}: shrink_group({view}) succeeded although the ranks disagree")
        dist.destroy_process_group(trio)
    check_world_works("shrink_group refusals")


@body(requires=("monitored_barrier",))
def monitored_barrier():
    """monitored_barrier passes when every rank arrives (also wait_all_ranks=True, and in a
    subgroup), also after a send/recv that only ranks 0 and 1 took part in."""
    n, r = dist.get_world_size(), dist.get_rank()
    if n > 1 and r < 2:
        t = _torch().ones(1)
        dist.send(t, 1) if r == 0 else dist.recv(t, 0)
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    members = subgroup_ranks(n)
    g = cached_group(members)
    if dist.get_rank() in members:
        dist.monitored_barrier(group=g, timeout=timedelta(seconds=30))
    check_world_works("monitored_barrier")


# ----------------------------------------------------------------------------- multi-GPU API names
_K = 2  # tensors per rank ("devices")


@body(requires=("multigpu",))
def multigpu_all_reduce():
    """all_reduce_multigpu: every tensor of every rank ends with the sum over all of them."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    tensors = [value(r, 3, salt=k) for k in range(_K)]
    dist.all_reduce_multigpu(tensors)
    total = sum(value(q, 3, salt=k) for q in range(n) for k in range(_K))
    for k in range(_K):
        assert_tensor(tensors[k], total, f"all_reduce_multigpu tensor {k}")
    del torch


@body(requires=("multigpu",))
def multigpu_broadcast():
    """broadcast_multigpu: every tensor everywhere becomes src's tensor_list[src_tensor]."""
    r, n = dist.get_rank(), dist.get_world_size()
    src = n - 1
    tensors = [value(r, 4, salt=k) for k in range(_K)]
    dist.broadcast_multigpu(tensors, src=src, src_tensor=1)
    for k in range(_K):
        assert_tensor(tensors[k], value(src, 4, salt=1), f"broadcast_multigpu tensor {k}")


@body(requires=("multigpu",))
def multigpu_reduce():
    """reduce_multigpu: dst's tensor_list[dst_tensor] gets the sum over every tensor of every rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    tensors = [value(r, 2, salt=k) for k in range(_K)]
    dist.reduce_multigpu(tensors, dst=0, dst_tensor=1)
    if r == 0:
        total = sum(value(q, 2, salt=k) for q in range(n) for k in range(_K))
        assert_tensor(tensors[1], total, "reduce_multigpu result in dst_tensor")
    dist.barrier()


@body(requires=("multigpu",))
def multigpu_all_gather():
    """all_gather_multigpu: each output list holds every rank's every input, rank-major."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    inputs = [value(r, 3, salt=k) for k in range(_K)]
    outputs = [[torch.zeros(3) for _ in range(n * _K)] for _ in range(_K)]
    dist.all_gather_multigpu(outputs, inputs)
    for lst, out in enumerate(outputs):
        for idx in range(n * _K):
            q, k = divmod(idx, _K)
            assert_tensor(out[idx], value(q, 3, salt=k), f"all_gather_multigpu list {lst} entry {idx}")
