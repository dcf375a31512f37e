"""The bridge to torch.distributed: one group seen by both.

After ``tdist.init_process_group`` torch.distributed's default group is tdist's default
group (served by the same backend instance), ``tdist.new_group`` groups are torch groups,
and ``torch.distributed.init_process_group("tdist-<name>")`` builds tdist groups. The
modules under this package import torch; this one does not, so ``import tdist`` installs
it unconditionally:

* :mod:`.process_group` -- ``TorchProcessGroup``, a tdist group as a torch ProcessGroup;
* :mod:`.work` -- ``BridgeWork``, a tdist Work as a torch Work;
* :mod:`.registry` -- ``tdist-<name>`` registered with torch, the creator torch calls;
* :mod:`.mirror` -- what init/new_group/destroy do on torch's side;
* :mod:`.features` -- what the installed torch has (every difference between releases).

The bridge is on unless ``init_process_group(..., torch_bridge=False)`` or
``TDIST_TORCH_BRIDGE=0``.

The core does not import this package: it reports its groups to :mod:`tdist._bridge`,
and ``import tdist`` installs this package's :class:`TorchBridge` there (:func:`install`).
The modules here import the core, never the other way round; what they share with
:mod:`tdist_autoload` is in :mod:`tdist_autoload._shared`.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import Any, Optional, Sequence

from tdist_autoload._shared import BRIDGE_ENV, PREFIX, register_entry_points

from .. import _bridge
from .._bridge import wanted
from .._errors import DistError
from .._groups import STATE, ProcessGroup
from .._version import TORCH_REQUIREMENT

__all__ = [
    "wanted",
    "install",
    "TorchBridge",
    "torch_is_free",
    "mirror_world",
    "mirror_new_group",
    "forget",
    "forget_all",
    "register_with_torch",
    "create_torch_group",
    "BRIDGE_ENV",
]

_warned_left_alone = False
_warned_unattached = False


def install(public: ModuleType) -> None:
    """At the end of ``import tdist`` (``public`` is the ``tdist`` package): the core's
    groups are reported to the bridge from now on, and torch knows ``tdist-<name>``
    (:func:`register_with_torch`)."""
    _bridge.install(TorchBridge(), public)  # TorchBridge: at the end of the module, after its functions
    register_with_torch()


def register_with_torch() -> None:
    """At ``import tdist``: register ``tdist-<name>`` with torch.distributed when torch is
    already imported and its extension autoloading (which does this at ``import torch``)
    was off. Costs nothing otherwise."""
    if "torch.distributed" in sys.modules and os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1") != "1":
        register_entry_points(create_torch_group)


def _torch_dist() -> Any:
    """torch.distributed if the program has imported it (it cannot be initialized otherwise)."""
    module = sys.modules.get("torch.distributed")
    return module if module is not None and module.is_available() else None


def torch_is_free(rank: int, world_size: int) -> bool:
    """True when torch.distributed is not initialized. When the program initialized it
    itself: a ValueError if its world differs from ``rank``/``world_size`` (where known,
    i.e. >= 0), else a warning (once) and False -- tdist leaves it alone. Asked before the
    rendezvous; a True answer also imports the mirror's modules then (:func:`_preload`)."""
    global _warned_left_alone
    torch_dist = _torch_dist()
    if torch_dist is None or not torch_dist.is_initialized():
        _preload()
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


def _preload() -> None:
    """Import what :func:`mirror_world` needs (about 4 ms of CPU) while this rank would wait
    for the others in the rendezvous anyway, not once they all arrived; nothing where the
    bridge cannot attach (``mirror_world`` then says why)."""
    from .features import unattachable

    if unattachable() is None:
        from . import mirror  # noqa: F401


def mirror_world(world: ProcessGroup) -> None:
    """Make torch.distributed's default group ``world``'s mirror. Fails safe: where the bridge
    cannot attach to the installed torch (a release it does not know), tdist's group stays
    tdist's only, with one warning that says so; never an error from inside torch."""
    from .features import unattachable

    why = unattachable()
    if why is not None:
        _warn_unattached(why)
        return
    from .mirror import mirror_world as mirror

    try:
        mirror(world)
    except Exception as exc:  # noqa: BLE001 - whatever a torch release raises, tdist's group stays usable
        _undo_mirror(world)
        from .features import features

        _warn_unattached(
            f"torch {features().version} refused tdist's group ({type(exc).__name__}: {exc}); "
            f"tdist is tested with torch{TORCH_REQUIREMENT}"
        )


def _warn_unattached(why: str) -> None:
    """Say once per process that torch.distributed does not see tdist's groups, and why."""
    global _warned_unattached
    if _warned_unattached:
        return
    _warned_unattached = True
    warnings.warn(
        f"tdist: torch.distributed does not see tdist's groups: {why}. tdist's own API works; what does not "
        "carry over: torch.distributed's functions on tdist's groups and the torch utilities built on them "
        "(torch's DistributedDataParallel, FSDP, DistributedSampler, torch.distributed.checkpoint), and "
        f"torch.distributed.init_process_group('tdist-<name>'). {BRIDGE_ENV}=0 silences this.",
        stacklevel=4,
    )


def _undo_mirror(world: ProcessGroup) -> None:
    """After torch failed to take ``world``: forget the half-made mirror without destroying ``world``."""
    mirror, world.torch_group = world.torch_group, None
    if mirror is not None:
        mirror.closing = True  # torch's destroy must not destroy the tdist group
    torch_dist = _torch_dist()
    if torch_dist is not None and torch_dist.is_initialized():
        try:
            torch_dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort: torch's state is torch's
            pass


def create_torch_group(name: str, options: Any, pg_options: Any) -> Any:
    """What torch's creator for ``tdist-<name>`` returns (:func:`.registry.create_torch_group`),
    or a :class:`~tdist.DistError` naming the supported torch range where the bridge cannot
    attach to this torch."""
    from .features import unattachable

    why = unattachable()
    if why is not None:
        raise DistError(f"torch.distributed.init_process_group({PREFIX + name!r}): {why}")
    try:
        from .registry import create_torch_group as create
    except (ImportError, AttributeError, TypeError) as exc:  # torch's classes changed under the bridge
        raise DistError(
            f"torch.distributed.init_process_group({PREFIX + name!r}): tdist's bridge does not load on this "
            f"torch ({exc}); tdist is tested with torch{TORCH_REQUIREMENT}"
        ) from exc
    return create(name, options, pg_options)


def mirror_new_group(
    pg: Optional[ProcessGroup],
    members: Sequence[int],
    devices: dict[str, str],
    group_desc: Optional[str],
    local: bool = False,
) -> None:
    """Mirror a group ``tdist.new_group`` made (``pg`` None on non-members) when the world
    is mirrored; ``local``: only its members made it (``use_local_synchronization``)."""
    world = _world_mirrored()
    if world:
        from .mirror import mirror_new_group as mirror

        mirror(pg, members, devices, group_desc, local)


def forget(pg: ProcessGroup) -> None:
    """tdist destroyed ``pg``: drop its torch mirror."""
    if pg.torch_group is not None:
        from .mirror import forget as drop

        drop(pg)


def forget_all(groups: Sequence[ProcessGroup]) -> None:
    """tdist destroyed every group: drop torch's world if it is tdist's."""
    if any(pg.torch_group is not None for pg in groups):
        from .mirror import forget_all as drop

        drop(groups)


def _world_mirrored() -> bool:
    return STATE.world is not None and STATE.world.torch_group is not None


class TorchBridge(_bridge.Bridge):
    """The core's reports (:class:`tdist._bridge.Bridge`) go to this module's functions."""

    torch_is_free = staticmethod(torch_is_free)
    mirror_world = staticmethod(mirror_world)
    mirror_new_group = staticmethod(mirror_new_group)
    forget = staticmethod(forget)
    forget_all = staticmethod(forget_all)
