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

It is the top of the torch bridge: it calls into tdist (:func:`tdist._torch.create_torch_group`,
which loads the bridge), and nothing in tdist imports it; what both sides share lives in
:mod:`tdist_autoload._shared`, below both.

``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (torch's switch) or ``TDIST_TORCH_BRIDGE=0`` turn
the registration at import off.
"""

from __future__ import annotations

from typing import Any

from ._shared import BRIDGE_ENV, PREFIX, Creator, register_entry_points, torch_backend_name

__all__ = ["register", "TdistCreator", "torch_backend_name", "BRIDGE_ENV", "PREFIX"]


def create_torch_group(name: str, backend_options: Any, pg_options: Any) -> Any:
    """The group torch gets for ``tdist-<name>``: tdist is imported here, on first use."""
    from tdist._torch import create_torch_group as create

    return create(name, backend_options, pg_options)


class TdistCreator(Creator):
    """The creator registered at ``import torch`` for tdist's backend ``name``; tdist is
    imported on the first call."""

    def __init__(self, name: str) -> None:
        super().__init__(name, create_torch_group)


def register() -> None:
    """Register ``tdist-<name>`` with torch.distributed for every plugin entry point of the
    group ``tdist`` not yet registered. Never raises: a failure here would make
    ``import torch`` fail, so it becomes a warning."""
    register_entry_points(create_torch_group)
