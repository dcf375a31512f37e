"""Registers the built-in init methods through the ``tdist`` entry point group."""

from __future__ import annotations

from .._plugins import RendezvousRegistry
from ..hookspecs import hookimpl
from .env import env_rendezvous
from .file import file_rendezvous
from .tcp import tcp_rendezvous

TDIST_HOOKSPEC_VERSION = "1.0"


@hookimpl
def tdist_register_rendezvous(registry: RendezvousRegistry) -> None:
    registry.add("env", env_rendezvous)
    registry.add("tcp", tcp_rendezvous)
    registry.add("file", file_rendezvous)
