"""The gloo devices (network interfaces) of a process group."""

from __future__ import annotations

import os
from typing import Any, Mapping

from tdist.plugin import local_address_for

from .torch_gloo import PG

__all__ = ["make_devices"]


def make_devices(store: Any, options: Mapping[str, Any]) -> list:
    """gloo devices: ``options["gloo_interface"]`` or ``$GLOO_SOCKET_IFNAME`` (comma-separated
    interface names, one device each), else ``options["gloo_hostname"]`` or
    ``$TDIST_GLOO_HOSTNAME``, else the address that reaches the store's host."""
    lazy = options.get("gloo_lazy_init")
    extra = {} if lazy is None else {"lazy_init": bool(lazy)}
    interfaces = options.get("gloo_interface") or os.environ.get("GLOO_SOCKET_IFNAME", "")
    if isinstance(interfaces, (list, tuple)):
        interfaces = ",".join(interfaces)
    names = [name.strip() for name in str(interfaces).split(",") if name.strip()]
    if names:
        return [PG.create_device(interface=name, **extra) for name in names]
    hostname = options.get("gloo_hostname") or os.environ.get("TDIST_GLOO_HOSTNAME", "")
    if not hostname:
        hostname = local_address_for(store) or ""
    if hostname:
        return [PG.create_device(hostname=str(hostname), **extra)]
    return [PG.create_default_device(**extra)] if extra else [PG.create_default_device()]
