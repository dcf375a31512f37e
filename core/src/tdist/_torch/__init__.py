"""The bridge to torch.distributed: one group seen by both.

After ``tdist.init_process_group`` torch.distributed's default group is tdist's default
group (served by the same backend instance), ``tdist.new_group`` groups are torch groups,
and ``torch.distributed.init_process_group("tdist-<name>")`` builds tdist groups. The
modules under this package import torch; this one does not, so the core calls it
unconditionally:

* :mod:`.process_group` -- ``TorchProcessGroup``, a tdist group as a torch ProcessGroup;
* :mod:`.work` -- ``BridgeWork``, a tdist Work as a torch Work;
* :mod:`.registry` -- ``tdist-<name>`` registered with torch, the creator torch calls;
* :mod:`.mirror` -- what init/new_group/destroy do on torch's side.

The bridge is on unless ``init_process_group(..., torch_bridge=False)`` or
``TDIST_TORCH_BRIDGE=0``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Optional, Sequence

from tdist_autoload import BRIDGE_ENV, bridge_disabled, register

__all__ = [
    "wanted",
    "torch_is_free",
    "mirror_world",
    "mirror_new_group",
    "forget",
    "forget_all",
    "register_with_torch",
    "BRIDGE_ENV",
]

_warned_left_alone = False


def register_with_torch() -> None:
    """At ``import tdist``: register ``tdist-<name>`` with torch.distributed when torch is
    already imported and its extension autoloading (which does this at ``import torch``)
    was off. Costs nothing otherwise."""
    if "torch.distributed" in sys.modules and os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        register()


def wanted(flag: Optional[bool]) -> bool:
    """Whether to bridge: the ``torch_bridge`` keyword when given, else ``TDIST_TORCH_BRIDGE``."""
    return bool(flag) if flag is not None else not bridge_disabled()


def _torch_dist() -> Any:
    """torch.distributed if the program has imported it (it cannot be initialized otherwise)."""
    module = sys.modules.get("torch.distributed")
    return module if module is not None and module.is_available() else None


def torch_is_free(rank: int, world_size: int) -> bool:
    """True when torch.distributed is not initialized. When the program initialized it
    itself: a ValueError if its world differs from ``rank``/``world_size`` (where known,
    i.e. >= 0), else a warning (once) and False -- tdist leaves it alone."""
    global _warned_left_alone
    torch_dist = _torch_dist()
    if torch_dist is None or not torch_dist.is_initialized():
        return True
    theirs = (torch_dist.get_rank(), torch_dist.get_world_size())
    if (rank >= 0 and rank != theirs[0]) or (world_size > 0 and world_size != theirs[1]):
        raise ValueError(
            f"init_process_group: torch.distributed is already initialized as rank {theirs[0]} of {theirs[1]} "
            f"(backend {torch_dist.get_backend()!r}), a different world from tdist's rank {rank} of {world_size}; "
            "destroy torch's group first (torch.distributed.destroy_process_group()) or pass torch_bridge=False"
        )
    if not _warned_left_alone:
        _warned_left_alone = True
        warnings.warn(
            f"tdist: torch.distributed was initialized by the program (backend {torch_dist.get_backend()!r}); "
            "tdist leaves it alone, so torch's utilities use torch's group and tdist's API tdist's "
            f"(torch_bridge=False or {BRIDGE_ENV}=0 silences this)",
            stacklevel=3,
        )
    return False


def mirror_world(world: Any) -> None:
    """Make torch.distributed's default group ``world``'s mirror."""
    from .mirror import mirror_world as mirror

    mirror(world)


def mirror_new_group(pg: Any, members: Sequence[int], devices: dict[str, str], group_desc: Optional[str]) -> None:
    """Mirror a group ``tdist.new_group`` made (``pg`` None on non-members) when the world is mirrored."""
    world = _world_mirrored()
    if world:
        from .mirror import mirror_new_group as mirror

        mirror(pg, members, devices, group_desc)


def forget(pg: Any) -> None:
    """tdist destroyed ``pg``: drop its torch mirror."""
    if pg.torch_group is not None:
        from .mirror import forget as drop

        drop(pg)


def forget_all(groups: Sequence[Any]) -> None:
    """tdist destroyed every group: drop torch's world if it is tdist's."""
    if any(pg.torch_group is not None for pg in groups):
        from .mirror import forget_all as drop

        drop(groups)


def _world_mirrored() -> bool:
    from .._groups import STATE

    return STATE.world is not None and STATE.world.torch_group is not None
