"""Which ranks of a group share a host: the layout the hierarchical collectives follow.

A *host* here is a shared-memory scope (:func:`tdist_tcp.shared.segment.scope`: the kernel's
boot id and the IPC namespace), the set of processes that can share a segment, or
what the options say instead: ``ranks_per_host`` / ``$TDIST_TCP_RANKS_PER_HOST`` (every
N consecutive ranks of the group are one host) or ``host_id`` / ``$TDIST_TCP_HOST_ID``
(this process's host, any string) — to try a multi-host layout on one machine, or to
split a big machine into several "hosts". A "host" that is not one shared-memory scope
gets no segment, and the whole group then runs the flat algorithms. Every rank publishes
its host in its record of the group's setup; rank 0 derives the layout from every record
and hands it to all (:mod:`tdist_tcp.net.roster`), so all ranks use the same layout.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple

from . import segment

__all__ = [
    "Layout",
    "host_id",
    "hierarchy_mode",
    "HOST_ID_ENV",
    "RANKS_PER_HOST_ENV",
    "HIERARCHY_ENV",
]

HOST_ID_ENV = "TDIST_TCP_HOST_ID"
RANKS_PER_HOST_ENV = "TDIST_TCP_RANKS_PER_HOST"
HIERARCHY_ENV = "TDIST_TCP_HIERARCHY"
_MODES = {
    "auto": "auto",
    **dict.fromkeys(("on", "1", "true", "yes"), "on"),
    **dict.fromkeys(("off", "0", "false", "no", "flat"), "off"),
}


class Layout(NamedTuple):
    """The group's ranks by host: ``hosts[h]`` lists host h's ranks in increasing order;
    hosts are ordered by their lowest rank (so rank 0 is on host 0)."""

    hosts: tuple[tuple[int, ...], ...]

    def host_of(self, rank: int) -> int:
        for h, members in enumerate(self.hosts):
            if rank in members:
                return h
        raise ValueError(f"rank {rank} is on no host of {self.hosts}")

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len({len(m) for m in self.hosts}) == 1

    def leaders(self) -> list[int]:
        """Every host's lowest rank, host 0's first."""
        return [m[0] for m in self.hosts]

    @property
    def worth_it(self) -> bool:
        """Several hosts, one of them with several ranks: what the hierarchy pays off for."""
        return len(self.hosts) > 1 and any(len(m) > 1 for m in self.hosts)


def hierarchy_mode(options: Mapping[str, Any]) -> str:
    """``options["hierarchy"]`` or ``$TDIST_TCP_HIERARCHY``: ``auto`` (the default: hierarchical
    collectives when the group spans several hosts, one of them with several ranks), ``on``
    (the same; the word says it is wanted) or ``off`` (the flat algorithms everywhere)."""
    value = options.get("hierarchy")
    if value is None:
        value = os.environ.get(HIERARCHY_ENV, "") or "auto"
    word = str(value).strip().lower() if not isinstance(value, bool) else ("on" if value else "off")
    mode = _MODES.get(word)
    if mode is None:
        raise ValueError(f"tcp backend: option hierarchy must be auto, on or off, got {value!r}")
    return mode


def host_id(options: Mapping[str, Any], rank: int) -> str:
    """What this rank publishes as its host (see the module's description); a ValueError
    for a ``ranks_per_host`` that is not a positive integer."""
    per_host = options.get("ranks_per_host") or os.environ.get(RANKS_PER_HOST_ENV)
    if per_host:
        try:
            count = int(per_host)
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"tcp backend: ranks_per_host must be a positive integer, got {per_host!r}")
        return f"block:{rank // count}"
    given = options.get("host_id") or os.environ.get(HOST_ID_ENV)
    return f"id:{given}" if given else f"scope:{segment.scope()}"
