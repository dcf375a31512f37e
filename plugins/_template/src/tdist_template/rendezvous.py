"""``indexed://host:port``: an init method for schedulers that number their processes.

Kubernetes Indexed Jobs give each pod its index in ``JOB_COMPLETION_INDEX``
(0 .. completions-1), and a headless Service gives pod 0 a stable DNS name; array
jobs of other schedulers work alike (``?index_var=AWS_BATCH_JOB_ARRAY_INDEX``).
The index is the rank; rank 0 hosts a :class:`tdist.TCPStore` at ``host:port``
and every other rank connects to it::

    init_process_group("store", init_method="indexed://myjob-0.myjob:29500?world_size=4")

Query parameters: ``world_size`` (required unless passed to ``init_process_group``),
``index_var`` (default ``JOB_COMPLETION_INDEX``). A ``rank`` passed to
``init_process_group`` wins over the index variable.

This module uses only tdist's public API (``TCPStore``, ``PrefixStore``), as a
third-party init method must.
"""

from __future__ import annotations

import os
import urllib.parse
from datetime import timedelta
from typing import Optional

from tdist import PrefixStore, Store, TCPStore

from . import SCHEME

__all__ = ["indexed_rendezvous", "DEFAULT_INDEX_VAR"]

DEFAULT_INDEX_VAR = "JOB_COMPLETION_INDEX"


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{SCHEME}:// rendezvous: {what} is not an integer") from None


def _query(url: urllib.parse.SplitResult, name: str) -> Optional[str]:
    values = urllib.parse.parse_qs(url.query).get(name)
    return values[-1] if values else None


def indexed_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    """The handler registered for ``indexed://``: returns ``(store, rank, world_size)``.

    ``rank``/``world_size`` are ``init_process_group``'s arguments (-1 when not given),
    ``timeout`` is in seconds, ``group_name`` keeps several jobs apart on one address.
    Arguments are checked before anything connects.
    """
    where = urllib.parse.urlunsplit(url)
    if not url.hostname:
        raise ValueError(f"{SCHEME}:// rendezvous: host missing in {where!r} (expected {SCHEME}://host:port)")
    try:
        port = url.port
    except ValueError:
        raise ValueError(f"{SCHEME}:// rendezvous: invalid port in {where!r}") from None
    if port is None:
        raise ValueError(f"{SCHEME}:// rendezvous: port number missing in {where!r}")
    size = _query(url, "world_size")
    if size is not None:
        from_url = _int(size, f"world_size={size!r} in the URL")
        if world_size >= 0 and world_size != from_url:
            raise ValueError(f"{SCHEME}:// rendezvous: world_size={world_size} conflicts with {where!r}")
        world_size = from_url
    if world_size < 1:
        raise ValueError(f"{SCHEME}:// rendezvous: world_size is required (argument or ?world_size= in {where!r})")
    if rank < 0:
        var = _query(url, "index_var") or DEFAULT_INDEX_VAR
        index = os.environ.get(var, "")
        if not index:
            raise ValueError(
                f"{SCHEME}:// rendezvous: environment variable {var} is not set (nor passed as rank=); "
                "name another one with ?index_var="
            )
        rank = _int(index, f"environment variable {var}={index!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"{SCHEME}:// rendezvous: rank {rank} is out of range for world_size {world_size}")
    store: Store = TCPStore(
        url.hostname,
        port,
        world_size,
        is_master=(rank == 0),
        timeout=timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    if group_name:
        store = PrefixStore(f"job/{group_name}", store, owns=True)
    return store, rank, world_size
