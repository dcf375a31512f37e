"""``torch.distributed.shrink_group`` on tdist's groups.

torch's ``shrink_group`` asks the group's C++ backend to shrink itself (``Backend.shrink``,
implemented by NCCL only) and registers the result on a new C++ ``ProcessGroup``. A tdist
group's backend lives in Python, and torch's C++ ``Backend`` has no Python constructor
(torch 2.13 to 2.15), so torch's own path cannot end on a tdist group. The bridge
therefore puts a thin wrapper in front of torch's function (:func:`install`, once, when
the first tdist group is mirrored): on a tdist group -- a :class:`TorchProcessGroup`, or
the default group when it is one -- it runs :func:`tdist.shrink_group` (torch's
signature and semantics; torch's default group follows the shrunken default group) and
returns the new group as torch's ``ProcessGroup``. Every other group goes to torch's
function unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.distributed as torch_dist
import torch.distributed.distributed_c10d as c10d

from .._shrink import SHRINK_DEFAULT
from .._shrink import shrink_group as tdist_shrink_group
from .process_group import TorchProcessGroup

__all__ = ["install"]

_WRAPPED = "__tdist_shrink_group__"


def install() -> None:
    """Route ``torch.distributed.shrink_group`` on tdist groups to tdist (idempotent;
    nothing on a torch without ``shrink_group``)."""
    original: Optional[Callable[..., Any]] = getattr(c10d, "shrink_group", None)
    if original is None or getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def shrink_group(
        ranks_to_exclude: list[int],
        group: Any = None,
        shrink_flags: int = SHRINK_DEFAULT,
        pg_options: Any = None,
    ) -> Any:
        if isinstance(_target(group), TorchProcessGroup):
            return tdist_shrink_group(ranks_to_exclude, group=group, shrink_flags=shrink_flags, pg_options=pg_options)
        return original(ranks_to_exclude, group, shrink_flags, pg_options)

    setattr(shrink_group, _WRAPPED, True)
    c10d.shrink_group = shrink_group
    if getattr(torch_dist, "shrink_group", None) is original:
        torch_dist.shrink_group = shrink_group


def _target(group: Any) -> Any:
    """The group torch's ``shrink_group`` would shrink (None when torch has no default group)."""
    if group is not None:
        return group
    return c10d._get_default_group() if torch_dist.is_initialized() else None
