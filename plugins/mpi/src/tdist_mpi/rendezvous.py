"""``mpi://``: rank and world size from MPI, a tdist TCPStore bootstrapped over MPI.

Under ``mpirun -n N``, ``init_process_group("mpi")`` (whose default init method
is ``mpi://``) takes this process's rank and the world size from MPI_COMM_WORLD.
Rank 0 starts a TCPStore server on a free port (on 127.0.0.1 when every rank runs
on its host, else on every interface, advertised by its host's address) and
broadcasts ``host:port`` with ``MPI_Bcast`` of a fixed-size byte buffer; the other
ranks connect. ``mpi://HOST:PORT`` fixes the address rank 0 binds and advertises.

A ``rank=`` or ``world_size=`` that disagrees with MPI is an error on every rank
(the check is agreed with an MPI_Allgather, so no rank is left waiting), and so are
``RANK`` / ``WORLD_SIZE`` environment variables that disagree: a launcher that is not
MPI's (tdistrun, torchrun) starts processes MPI does not connect, each of which would
otherwise be rank 0 of its own one-process world and compute wrong results silently.
``world_size=0`` means "not given", as torch.distributed's MPI tutorial passes
``rank=0, world_size=0`` on every rank.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from datetime import timedelta
from typing import Any

import numpy as np

from tdist import DistBackendError, PrefixStore, Store, TCPStore

from ._runtime import mpi_error, runtime

__all__ = ["mpi_rendezvous"]

_ADDR_BYTES = 1024


def _host_address() -> str:
    """An address of this host that other hosts can reach (best effort)."""
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return host
    if not addr.startswith("127."):
        return addr
    try:  # the hostname resolves to loopback: ask the routing table (a UDP connect sends nothing)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
            if addr and not addr.startswith("127."):
                return addr
    except OSError:
        pass
    return host


def _launcher_problem(me: int, n: int) -> str:
    """Why RANK / WORLD_SIZE (set by a launcher such as tdistrun or torchrun) contradict
    MPI's world, or ""."""
    for name, mpi_value, what in (
        ("WORLD_SIZE", n, f"MPI_COMM_WORLD has {n} rank(s)"),
        ("RANK", me, f"this process is MPI rank {me} of {n}"),
    ):
        raw = os.environ.get(name, "").strip()
        if not raw:
            continue
        try:
            value = int(raw)
        except ValueError:
            return f"the environment sets {name}={raw!r}, which is not an integer"
        if value != mpi_value:
            hint = " (this process was not started by mpirun: MPI sees it alone, as rank 0 of 1)" if n == 1 else ""
            return (
                f"the launcher set {name}={value} but {what}{hint}; the mpi backend takes its ranks "
                "from MPI: start the program with mpirun -n N, not tdistrun or torchrun"
            )
    return ""


def mpi_rendezvous(
    url: urllib.parse.SplitResult, *, rank: int, world_size: int, timeout: float, group_name: str
) -> tuple[Store, int, int]:
    rt = runtime()
    MPI = rt.MPI
    world = rt.world
    me, n = rt.world_rank, rt.world_size
    if world_size == 0:  # the tutorial's init_process(0, 0, run, backend="mpi")
        rank = world_size = -1
    from_mpi = "; under mpirun the rank and world size come from MPI (omit rank= and world_size=, or pass MPI's values)"
    if world_size > 0 and world_size != n:
        problem = f"world_size={world_size} was passed but the MPI job has {n} ranks" + from_mpi
    elif rank >= 0 and rank != me:
        problem = f"rank={rank} was passed but this process is MPI rank {me}" + from_mpi
    else:
        problem = _launcher_problem(me, n)
    try:
        flags = np.zeros(n, dtype=np.int32)
        with rt.lock:
            world.Allgather([np.array([1 if problem else 0], dtype=np.int32), MPI.INT], [flags, MPI.INT])
        if flags.any():
            bad = [int(r) for r in np.flatnonzero(flags)]
            detail = problem or f"MPI rank(s) {bad} have a rank or world size that disagrees with MPI"
            raise ValueError(f"mpi:// rendezvous: {detail}")
        host = url.hostname or ""
        try:
            port = url.port or 0
        except ValueError:
            raise ValueError(f"mpi:// rendezvous: invalid port in {urllib.parse.urlunsplit(url)!r}") from None
        with rt.lock:
            local = world.Split_type(MPI.COMM_TYPE_SHARED)
            all_local = local.Get_size() == n
            local.Free()
        limit = timedelta(seconds=timeout)
        buf = bytearray(_ADDR_BYTES)
        store: Any = None
        if me == 0:
            bind = host or ("127.0.0.1" if all_local else "0.0.0.0")
            advertised = host or ("127.0.0.1" if all_local else _host_address())
            try:
                store = TCPStore(bind, port, n, is_master=True, timeout=limit, wait_for_workers=False)
                message = f"{advertised}:{store.port}"
            except Exception as exc:  # tell the other ranks instead of leaving them waiting
                message = f"!{type(exc).__name__}: {exc}"
                failure: BaseException = exc
            data = message.encode()[: _ADDR_BYTES - 1]
            buf[: len(data)] = data
        with rt.lock:
            world.Bcast([buf, MPI.BYTE], root=0)
        message = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if message.startswith("!"):
            if me == 0:
                raise failure
            raise DistBackendError(f"mpi:// rendezvous: rank 0 could not start the TCPStore: {message[1:]}")
        if me != 0:
            addr, _, port_text = message.rpartition(":")
            store = TCPStore(addr, int(port_text), n, is_master=False, timeout=limit, wait_for_workers=False)
    except MPI.Exception as exc:
        raise mpi_error("mpi:// rendezvous", exc) from exc
    if group_name:
        store = PrefixStore(f"job/{group_name}", store)
    return store, me, n
