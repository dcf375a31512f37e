"""What the core tells the torch bridge: the observer between tdist's groups and torch's.

``init_process_group``, ``new_group``, ``destroy_process_group`` and ``shrink_group``
(:mod:`tdist._init`, :mod:`tdist._shrink`) report here what they made or destroyed; the
bridge (:mod:`tdist._torch`) installs the object that acts on it when ``import tdist``
finishes (:func:`install`). So the core never imports the bridge and the bridge imports
the core: the dependency runs one way. Until a bridge is installed, nothing is mirrored.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Optional, Sequence

from tdist_autoload._shared import bridge_disabled

if TYPE_CHECKING:
    from ._groups import ProcessGroup

__all__ = ["Bridge", "install", "installed", "public_api", "wanted"]


class Bridge:
    """What the core calls on the torch bridge (``installed().mirror_world(world)``); these
    defaults are those of no bridge. The bridge's methods are its functions themselves
    (staticmethods): a call adds no frame, so its warnings' ``stacklevel`` reaches the caller."""

    def torch_is_free(self, rank: int, world_size: int) -> bool:
        """Whether tdist may make torch.distributed's default group (see :mod:`tdist._torch`)."""
        return False

    def mirror_world(self, world: ProcessGroup) -> None:
        """tdist made its default group ``world``."""

    def mirror_new_group(
        self,
        pg: Optional[ProcessGroup],
        members: Sequence[int],
        devices: dict[str, str],
        group_desc: Optional[str],
        local: bool = False,
    ) -> None:
        """tdist's ``new_group`` made a group of ``members`` (``pg`` None on non-members)."""

    def forget(self, pg: ProcessGroup) -> None:
        """tdist destroyed ``pg``."""

    def forget_all(self, groups: Sequence[ProcessGroup]) -> None:
        """tdist destroyed every group, ``groups``."""


_bridge = Bridge()
_public: Optional[ModuleType] = None


def install(bridge: Bridge, public: ModuleType) -> None:
    """Send the core's reports to ``bridge`` from now on; ``public`` is the ``tdist``
    package, whose API the bridge prepares for torch.compile (:mod:`tdist._torch.dynamo`)."""
    global _bridge, _public
    _bridge, _public = bridge, public


def installed() -> Bridge:
    """The bridge the core reports to (a :class:`Bridge` that does nothing before :func:`install`)."""
    return _bridge


def public_api() -> ModuleType:
    """The ``tdist`` package, as :func:`install` was given it."""
    if _public is None:
        raise RuntimeError("tdist's torch bridge is not installed (import tdist installs it)")
    return _public


def wanted(flag: Optional[bool]) -> bool:
    """Whether to bridge: the ``torch_bridge`` keyword when given, else ``TDIST_TORCH_BRIDGE``."""
    return bool(flag) if flag is not None else not bridge_disabled()
