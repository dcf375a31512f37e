"""Where a job's store lives, and which local address reaches it: what a backend needs
to pick the address it listens on (:func:`local_address_for`)."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any, Optional

from ._store import HashStore

__all__ = ["store_endpoint", "route_address", "local_address_for"]


def store_endpoint(store: Any) -> tuple[Optional[str], Optional[int]]:
    """The (host, port) of the server behind ``store`` (a TCPStore, looking through
    PrefixStore and similar wrappers); (None, None) for a store without one."""
    seen: set[int] = set()
    current = store
    for _ in range(8):
        if current is None or id(current) in seen:
            break
        seen.add(id(current))
        host = getattr(current, "host", None)
        if isinstance(host, str) and host:
            port = getattr(current, "port", None)
            return host, port if isinstance(port, int) else None
        nxt = None
        for attr in ("underlying_store", "_store"):  # PrefixStore and similar wrappers
            candidate = getattr(current, attr, None)
            if candidate is not None and hasattr(candidate, "get") and hasattr(candidate, "set"):
                nxt = candidate
                break
        current = nxt
    return None, None


def route_address(host: str) -> Optional[str]:
    """The local address this machine uses to reach ``host`` (IPv4 first; 127.0.0.1 or ::1
    for a loopback or unspecified address; the routing table is asked, nothing is sent);
    None when ``host`` does not resolve or no route leads there."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    for family, _, _, _, sockaddr in infos:
        try:
            ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        except ValueError:
            continue
        if ip.is_loopback or ip.is_unspecified:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((sockaddr[0], 9, *sockaddr[2:]))  # UDP connect sends nothing
                return str(probe.getsockname()[0])
        except OSError:
            continue
    return None


def local_address_for(store: Any) -> Optional[str]:
    """The address to listen on for a job rendezvousing through ``store``: 127.0.0.1 for an
    in-process store (HashStore), the local address of the route to the store's server,
    else None (unknown: a file store)."""
    inner = store
    while getattr(inner, "underlying_store", None) is not None:
        inner = inner.underlying_store
    if isinstance(inner, HashStore):
        return "127.0.0.1"
    host, _ = store_endpoint(store)
    return route_address(host) if host else None
