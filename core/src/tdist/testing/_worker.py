"""A worker of a :class:`~tdist.testing.World`: ``python -m tdist.testing._worker``.

It connects back to the controller, says which rank it is, then runs the
``module:qualname`` functions it is sent and replies with their result or
error, until told to exit. It exits at once if the controller goes away.
The control channel uses pickle, only after a mutual handshake that proves both
ends know the world's token (see :mod:`tdist.testing._protocol`).
"""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any, Optional

from ._common import (
    BACKEND_ENV,
    CONTROLLER_ENV,
    SYS_PATH_ENV,
    TOKEN_ENV,
    WORLD_SIZE_ENV,
    dist_module,
    dist_module_name,
    resolve_ref,
)
from ._protocol import AuthenticationFailed, join_controller, recv_msg, send_msg

__all__ = ["init_process_group", "health_check", "describe_exception", "main"]

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _first_env(names: tuple[str, ...]) -> Optional[str]:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return value
    return None


def _setup_rank_env() -> int:
    """Make RANK / WORLD_SIZE right for this process (mpirun gives one env to all)."""
    if "RANK" not in os.environ or os.environ.get("TDIST_TESTING_LAUNCHER") == "mpi":
        mpi_rank = _first_env(_MPI_RANK_VARS)
        if mpi_rank is not None:
            os.environ["RANK"] = mpi_rank
            os.environ["LOCAL_RANK"] = mpi_rank
        mpi_size = _first_env(_MPI_SIZE_VARS)
        if mpi_size is not None:
            os.environ["WORLD_SIZE"] = mpi_size
    return int(os.environ.get("RANK", "0"))


# ------------------------------------------------------------------ functions run by the controller
def init_process_group(
    *,
    backend: str,
    init_method: Optional[str] = "env://",
    timeout: float = 30.0,
    world_size: Optional[int] = None,
    rank: Optional[int] = None,
    **kwargs: Any,
) -> dict:
    """Initialise the module under test in this worker (the World's init step)."""
    dist = dist_module()
    if rank is None:
        rank = int(os.environ["RANK"])
    if world_size is None:
        world_size = int(os.environ.get(WORLD_SIZE_ENV) or os.environ["WORLD_SIZE"])
    dist.init_process_group(
        backend,
        init_method=init_method,
        timeout=timedelta(seconds=timeout),
        world_size=world_size,
        rank=rank,
        **kwargs,
    )
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "pid": os.getpid()}


def health_check() -> bool:
    """A barrier and a checked all_reduce: is the world still usable after a failure?"""
    import torch

    dist = dist_module()
    if not dist.is_initialized():
        return True
    dist.barrier()
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    n = dist.get_world_size()
    expected = n * (n + 1) / 2
    if not bool((t == expected).all()):
        raise AssertionError(f"health check all_reduce gave {t.tolist()}, expected {expected}")
    return True


def describe_exception(exc: BaseException, tb: Any = None) -> dict:
    """What the controller learns about an exception raised by a body (``tb``: the
    traceback to show, default the exception's own)."""
    mro = []
    for cls in type(exc).__mro__:
        mro.append(f"{cls.__module__}.{cls.__qualname__}")
    pickled: Optional[bytes]
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # only an exception that survives the round trip is sent whole
    except Exception:
        pickled = None
    return {
        "type": type(exc).__qualname__,
        "mro": mro,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(type(exc), exc, tb if tb is not None else exc.__traceback__)),
        "pickled": pickled,
    }


# ------------------------------------------------------------------------------------ main loop
def _extend_sys_path() -> None:
    raw = os.environ.get(SYS_PATH_ENV)
    if not raw:
        return
    try:
        entries = json.loads(raw)
    except ValueError:
        return
    for entry in entries:
        if entry not in sys.path:
            sys.path.append(entry)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _serve(sock: socket.socket, inbox: "queue.Queue[Any]") -> None:
    while True:
        msg = inbox.get()
        kind = msg[0]
        if kind == "exit":
            return
        if kind != "call":
            continue
        _, call_id, ref, kwargs = msg
        started = time.perf_counter()
        try:
            result = resolve_ref(ref)(**kwargs)
            reply: tuple = ("ok", call_id, result, time.perf_counter() - started)
            try:
                payload_ok = pickle.dumps(reply)
                del payload_ok
            except Exception as exc:
                reply = (
                    "err",
                    call_id,
                    {
                        "type": "UnpicklableResult",
                        "mro": ["tdist.testing.UnpicklableResult"],
                        "message": f"{ref} returned {type(result).__name__}, which cannot be pickled: {exc}",
                        "traceback": "",
                        "pickled": None,
                    },
                    time.perf_counter() - started,
                )
        except BaseException as exc:  # report everything, including SystemExit/KeyboardInterrupt
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None  # hide this frame
            reply = ("err", call_id, describe_exception(exc, tb), time.perf_counter() - started)
        _flush()
        send_msg(sock, reply)


def _read_forever(sock: socket.socket, inbox: "queue.Queue[Any]") -> None:
    try:
        while True:
            inbox.put(recv_msg(sock))
    except BaseException:
        # The controller is gone (or killed us): never outlive it.
        _flush()
        os._exit(17)


def _shutdown_and_exit() -> None:
    timer = threading.Timer(5.0, lambda: os._exit(0))
    timer.daemon = True
    timer.start()
    try:
        dist = sys.modules.get(dist_module_name())
        if dist is not None and getattr(dist, "is_initialized", lambda: False)():
            dist.destroy_process_group()
    except BaseException:
        pass
    _flush()
    os._exit(0)


def main() -> None:
    rank = _setup_rank_env()
    _extend_sys_path()
    faulthandler.enable(all_threads=True)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    host, _, port = os.environ[CONTROLLER_ENV].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        join_controller(sock, os.environ.get(TOKEN_ENV, "").encode())
    except (OSError, AuthenticationFailed) as exc:
        print(f"tdist.testing worker: refusing the controller at {host}:{port}: {exc}", file=sys.stderr)
        _flush()
        os._exit(18)
    send_msg(sock, ("hello", {"rank": rank, "pid": os.getpid(), "backend": os.environ.get(BACKEND_ENV, "")}))
    inbox: "queue.Queue[Any]" = queue.Queue()
    reader = threading.Thread(target=_read_forever, args=(sock, inbox), name="tdist-testing-control", daemon=True)
    reader.start()
    try:
        _serve(sock, inbox)
    finally:
        _shutdown_and_exit()


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    # Run the importable copy of this module so "tdist.testing._worker:fn" refs share its state.
    from tdist.testing import _worker as _importable

    _importable.main()
