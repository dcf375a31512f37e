"""The bottom of the torch bridge, shared by :mod:`tdist_autoload` and :mod:`tdist`.

torch's names of tdist's backends, the bridge's switch, the creator torch calls and the
registration of the plugins' entry-point names. It imports neither tdist nor torch at
import, so both sides build on it and the dependency runs one way: ``tdist_autoload``
(torch's entry point, on top) -> ``tdist._torch`` -> the core -> this module. Each side
registers with its own ``create`` (the function a :class:`Creator` calls): the autoload
one imports tdist on first use, tdist's is the bridge's own.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

__all__ = [
    "BRIDGE_ENV",
    "PREFIX",
    "Create",
    "Creator",
    "bridge_disabled",
    "entry_point_names",
    "register_entry_points",
    "torch_backend_name",
]

#: ``TDIST_TORCH_BRIDGE=0`` keeps tdist out of torch.distributed: no autoload, no mirroring.
BRIDGE_ENV = "TDIST_TORCH_BRIDGE"
#: torch.distributed's name of tdist's backend ``tcp`` is ``tdist-tcp``.
PREFIX = "tdist-"
_CORE_MODULE = "tdist."  # entry points of the core itself (built-in init methods) are not backends

#: ``create(name, backend_options, pg_options)``: the process group torch gets for ``tdist-<name>``.
Create = Callable[[str, Any, Any], Any]


def torch_backend_name(name: str) -> str:
    """The name torch.distributed knows tdist's backend ``name`` by."""
    return PREFIX + name


def bridge_disabled() -> bool:
    """Whether ``TDIST_TORCH_BRIDGE`` turns the bridge off (0, false, no, off)."""
    return os.environ.get(BRIDGE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


class Creator:
    """The creator torch's ``Backend.register_backend(..., extended_api=True)`` calls to
    build a process group of tdist's backend ``name``: ``create(name, ...)``."""

    def __init__(self, name: str, create: Create) -> None:
        self.name = name
        self.create = create

    def __call__(self, backend_options: Any, pg_options: Any = None) -> Any:
        return self.create(self.name, backend_options, pg_options)

    def __repr__(self) -> str:
        return f"<tdist creator for {torch_backend_name(self.name)!r}>"


def entry_point_names() -> list[str]:
    """The names of the plugin entry points of the group ``tdist`` (by convention the
    backends' names), without loading any of them."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="tdist") if not ep.value.startswith(_CORE_MODULE)})


def register_entry_points(create: Create) -> None:
    """Register ``tdist-<name>`` with torch.distributed, creating groups with ``create``,
    for every plugin entry point of the group ``tdist`` not yet registered. Never raises:
    inside ``import torch`` a failure would make the import fail, so it becomes a warning."""
    if bridge_disabled():
        return
    try:
        import torch.distributed as torch_dist

        if not torch_dist.is_available():
            return
        known = torch_dist.Backend._plugins
        for name in entry_point_names():
            torch_name = torch_backend_name(name)
            if torch_name.upper() not in known:
                torch_dist.Backend.register_backend(
                    torch_name, Creator(name, create), extended_api=True, devices=["cpu", "cuda"]
                )
    except Exception as exc:  # noqa: BLE001 - must not break `import torch`
        warnings.warn(f"tdist: could not register tdist's backends with torch.distributed: {exc}", stacklevel=3)
