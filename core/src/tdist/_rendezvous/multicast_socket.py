"""The UDP socket of the multicast ``tcp://`` rendezvous: its options and how it is opened.

Options, from the URL's query, else the environment, else the default:

- ``ttl`` / ``TDIST_MULTICAST_TTL`` (default 1): how many routers a datagram may cross
  (IPv6: the hop limit). 1 keeps the rendezvous on one subnet; 0 on this host.
- ``interface`` / ``TDIST_MULTICAST_INTERFACE`` (default: the system's choice, the
  interface of the route to the group, usually the default route's): an interface name
  (``eth0``) or, for IPv4, one of its addresses. An IPv6 group may also carry it as a
  scope: ``tcp://[ff02::1234%25eth0]:port``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import urllib.parse
from dataclasses import dataclass
from typing import Optional

from .._errors import DistNetworkError

__all__ = ["MulticastOptions", "open_multicast_socket", "TTL_ENV", "INTERFACE_ENV"]

TTL_ENV = "TDIST_MULTICAST_TTL"
INTERFACE_ENV = "TDIST_MULTICAST_INTERFACE"


@dataclass(frozen=True)
class MulticastOptions:
    group: str  # the multicast address, without a scope
    port: int
    ttl: int = 1
    interface: str = ""  # "" : the system's choice

    @property
    def family(self) -> int:
        return socket.AF_INET6 if ":" in self.group else socket.AF_INET

    @property
    def where(self) -> str:
        return f"[{self.group}]:{self.port}" if self.family == socket.AF_INET6 else f"{self.group}:{self.port}"

    @classmethod
    def from_url(cls, host: str, port: int, url: urllib.parse.SplitResult) -> "MulticastOptions":
        """The options of ``tcp://host:port?...`` (``host`` a multicast address, maybe with a scope)."""
        query = urllib.parse.parse_qs(url.query)

        def option(name: str, env: str) -> str:
            values = query.get(name)
            return values[-1] if values else os.environ.get(env, "")

        group, _, scope = urllib.parse.unquote(host).partition("%")
        interface = option("interface", INTERFACE_ENV) or scope
        raw_ttl = option("ttl", TTL_ENV) or "1"
        try:
            ttl = int(raw_ttl)
        except ValueError:
            ttl = -1
        if not 0 <= ttl <= 255:
            raise ValueError(
                f"tcp:// multicast rendezvous: ttl={raw_ttl!r} (URL ?ttl= or {TTL_ENV}) must be an "
                "integer from 0 to 255"
            )
        return cls(str(ipaddress.ip_address(group)), port, ttl, interface)


def _interface_index(options: MulticastOptions) -> int:
    if not options.interface:
        return 0
    try:
        return socket.if_nametoindex(options.interface)
    except OSError:
        raise DistNetworkError(
            f"tcp:// multicast rendezvous: no network interface named {options.interface!r} on "
            f"this host (URL ?interface= or {INTERFACE_ENV})"
        ) from None


def _set_up_ipv4(sock: socket.socket, options: MulticastOptions) -> None:
    group = socket.inet_aton(options.group)
    try:
        address = socket.inet_aton(str(ipaddress.IPv4Address(options.interface)))
        index = 0
    except ValueError:  # an interface name (or none: the system's choice)
        address, index = socket.inet_aton("0.0.0.0"), _interface_index(options)
    mreqn = group + address + struct.pack("@i", index)  # struct ip_mreqn (Linux; others read its ip_mreq head)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreqn)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, options.ttl)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    if options.interface:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, mreqn)


def _set_up_ipv6(sock: socket.socket, options: MulticastOptions) -> None:
    index = _interface_index(options)
    sock.setsockopt(
        socket.IPPROTO_IPV6,
        socket.IPV6_JOIN_GROUP,
        socket.inet_pton(socket.AF_INET6, options.group) + struct.pack("@I", index),
    )
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_HOPS, options.ttl)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_LOOP, 1)
    if index:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF, index)


def open_multicast_socket(options: MulticastOptions) -> socket.socket:
    """A non-blocking UDP socket bound to the group's port (shared with the other processes of
    this host), member of the group, sending to it with the options' TTL and interface and
    hearing its own datagrams. Raises DistNetworkError, saying what to change, when this host
    cannot join the group (no interface for it: no multicast route, no default route)."""
    sock = socket.socket(options.family, socket.SOCK_DGRAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:  # the group's address: only datagrams sent to this group (Linux, BSD)
            sock.bind((options.group, options.port))
        except OSError:
            sock.bind(("", options.port))
        (_set_up_ipv6 if options.family == socket.AF_INET6 else _set_up_ipv4)(sock, options)
        sock.setblocking(False)
        return sock
    except OSError as exc:
        sock.close()
        raise DistNetworkError(
            f"tcp:// multicast rendezvous: cannot join {options.where}"
            + (f" on {options.interface}" if options.interface else "")
            + f": {exc}. "
            + no_multicast_hint(options)
        ) from exc
    except BaseException:
        sock.close()
        raise


def no_multicast_hint(options: Optional[MulticastOptions] = None) -> str:
    """What to try when this host cannot send to or join the group."""
    route = "ff00::/8" if options is not None and options.family == socket.AF_INET6 else "224.0.0.0/4"
    return (
        f"This host has no route for multicast on the chosen interface: name one with ?interface= or "
        f"{INTERFACE_ENV}, or add a route (e.g. ip route add {route} dev eth0); or use a unicast "
        "address: tcp://<address of one host>:<port>"
    )
