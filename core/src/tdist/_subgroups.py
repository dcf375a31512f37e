"""``new_subgroups``, ``new_subgroups_by_enumeration`` and ``split_group``: a partition
of ranks into groups.

The first two are :func:`new_group` called once per subgroup, in the same order on every
rank (so every rank must call them, like ``new_group``). They return
``(this rank's subgroup or None, every subgroup handle)``, as torch.distributed does.
``split_group`` is called by the ranks of the group it splits only, and returns the
calling rank's part.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Sequence

from ._groups import GroupMember, get_process_group_ranks, get_rank, get_world_size, resolve_group
from ._init import new_group

__all__ = ["new_subgroups", "new_subgroups_by_enumeration", "split_group"]


def new_subgroups(
    group_size: Optional[int] = None,
    group: Any = None,
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Optional[dict[str, Any]] = None,
    group_desc: Optional[str] = None,
) -> tuple[Any, list[Any]]:
    """Split ``group`` (default: the world) into consecutive subgroups of ``group_size``
    ranks each (default: the number of local CUDA devices). The group's size must be a
    multiple of ``group_size``."""
    if group_size is None:
        import torch

        if not torch.cuda.is_available():
            raise ValueError("new_subgroups: group_size is required where CUDA is not available")
        group_size = torch.cuda.device_count()
    if not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"new_subgroups: group_size must be a positive integer, got {group_size!r}")
    size = get_world_size(group)
    if size < 0:
        raise ValueError("new_subgroups: this rank is not a member of the group")
    if group_size > size or size % group_size:
        raise ValueError(f"new_subgroups: group_size {group_size} must divide the group's size {size}")
    ranks = get_process_group_ranks(group)
    chunks = [ranks[i : i + group_size] for i in range(0, size, group_size)]
    return new_subgroups_by_enumeration(chunks, timeout, backend, pg_options, group_desc)


def new_subgroups_by_enumeration(
    ranks_per_subgroup_list: Sequence[Sequence[int]],
    timeout: Optional[timedelta] = None,
    backend: Optional[str] = None,
    pg_options: Optional[dict[str, Any]] = None,
    group_desc: Optional[str] = None,
) -> tuple[Any, list[Any]]:
    """One subgroup per list of global ranks in ``ranks_per_subgroup_list``; no rank may be
    in two of them (checked before any group is created)."""
    if not ranks_per_subgroup_list:
        raise ValueError("new_subgroups_by_enumeration: ranks_per_subgroup_list is empty")
    owner: dict[int, list[int]] = {}
    for ranks in ranks_per_subgroup_list:
        for rank in ranks:
            if rank in owner:
                raise ValueError(
                    f"new_subgroups_by_enumeration: rank {rank} is in both subgroup {owner[rank]} and {list(ranks)}"
                )
            owner[rank] = list(ranks)
    me = get_rank()
    mine, subgroups = None, []
    for ranks in ranks_per_subgroup_list:
        subgroup = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options, group_desc=group_desc)
        subgroups.append(subgroup)
        if me in ranks:
            mine = subgroup
    return mine, subgroups


def split_group(
    parent_pg: Any = None,
    split_ranks: Optional[Sequence[Sequence[int]]] = None,
    timeout: Optional[timedelta] = None,
    pg_options: Optional[dict[str, Any]] = None,
    group_desc: Optional[str] = None,
    backend: Optional[str] = None,
) -> Any:
    """Split ``parent_pg`` (default: the default group): every rank of it calls this with
    the same ``split_ranks``, disjoint lists of the parent's *group* ranks. Each list
    becomes a group whose rank i is the list's i-th entry; the parent's backend and
    timeout unless ``backend``/``timeout`` say otherwise. Returns this rank's group, or
    ``GroupMember.NON_GROUP_MEMBER`` where no list names it. Ranks outside the parent
    do not call it; bad ``split_ranks`` raise ValueError before any communication."""
    if not split_ranks:
        raise ValueError("split_group: split_ranks cannot be None or empty")
    parent = resolve_group(parent_pg)
    if parent is None:
        raise ValueError("split_group: this rank is not a member of the parent group")
    owner: dict[int, list[int]] = {}
    for split in split_ranks:
        if not split:
            raise ValueError(f"split_group: an empty split in {[list(s) for s in split_ranks]}")
        for rank in split:
            if not isinstance(rank, int) or not 0 <= rank < parent.size:
                raise ValueError(
                    f"split_group: rank {rank!r} of {list(split)} is out of range for the parent group of size "
                    f"{parent.size} (split_ranks are group ranks of the parent)"
                )
            if rank in owner:
                raise ValueError(f"split_group: group rank {rank} is in both {owner[rank]} and {list(split)}")
            owner[rank] = list(split)
    mine = owner.get(parent.rank)
    if mine is None:
        return GroupMember.NON_GROUP_MEMBER
    return new_group(
        [parent.ranks[r] for r in mine],
        timeout=timeout or parent.timeout,
        backend=backend or parent.backend_name,
        pg_options=pg_options,
        use_local_synchronization=True,
        group_desc=group_desc,
        sort_ranks=False,
    )
