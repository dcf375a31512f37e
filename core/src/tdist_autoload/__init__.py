"""tdist's backends as ``torch.distributed`` backends, registered while torch imports.

torch calls :func:`register` from its extension autoloading (entry-point group
``torch.backends``, ``torch/__init__.py: _import_device_backends``) at the end of every
``import torch``, so ``torch.distributed.init_process_group("tdist-tcp")`` works in a
program that never imports tdist. This module lives outside the ``tdist`` package on
purpose: it must stay cheap (no ``import tdist``, no plugin module loaded) and must not
import anything that imports torch while torch is initialising. It only reads the
entry-point names of the group ``tdist`` (by convention the backend's name) and
registers ``tdist-<name>`` with a creator that imports tdist on first use. Once tdist
has loaded its plugins it registers every backend precisely (its real names and
devices), see :mod:`tdist._torch.registry`.

``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch's switch) or ``TDIST_TORCH_BRIDGE=0`` turn
the registration at import off.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["register", "TdistCreator", "torch_backend_name", "BRIDGE_ENV", "PREFIX"]

#: ``TDIST_TORCH_BRIDGE=0`` keeps tdist out of torch.distributed: no autoload, no mirroring.
BRIDGE_ENV = "TDIST_TORCH_BRIDGE"
#: torch.distributed's name of tdist's backend ``tcp`` is ``tdist-tcp``.
PREFIX = "tdist-"
_CORE_MODULE = "tdist."  # entry points of the core itself (built-in init methods) are not backends


def torch_backend_name(name: str) -> str:
    """The name torch.distributed knows tdist's backend ``name`` by."""
    return PREFIX + name


def bridge_disabled() -> bool:
    """Whether ``TDIST_TORCH_BRIDGE`` turns the bridge off (0, false, no, off)."""
    return os.environ.get(BRIDGE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


class TdistCreator:
    """The creator torch's ``Backend.register_backend(..., extended_api=True)`` calls to
    build a process group of tdist's backend ``name``; tdist is imported on the first call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, backend_options: Any, pg_options: Any = None) -> Any:
        from tdist._torch import create_torch_group

        return create_torch_group(self.name, backend_options, pg_options)

    def __repr__(self) -> str:
        return f"<tdist creator for {torch_backend_name(self.name)!r}>"


def _entry_point_names() -> list[str]:
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group="tdist") if not ep.value.startswith(_CORE_MODULE)})


def register() -> None:
    """Register ``tdist-<name>`` with torch.distributed for every plugin entry point of the
    group ``tdist`` not yet registered. Never raises: a failure here would make
    ``import torch`` fail, so it becomes a warning."""
    if bridge_disabled():
        return
    try:
        import torch.distributed as torch_dist

        if not torch_dist.is_available():
            return
        known = torch_dist.Backend._plugins
        for name in _entry_point_names():
            torch_name = torch_backend_name(name)
            if torch_name.upper() not in known:
                torch_dist.Backend.register_backend(
                    torch_name, TdistCreator(name), extended_api=True, devices=["cpu", "cuda"]
                )
    except Exception as exc:  # noqa: BLE001 - must not break `import torch`
        warnings.warn(f"tdist: could not register tdist's backends with torch.distributed: {exc}", stacklevel=2)
