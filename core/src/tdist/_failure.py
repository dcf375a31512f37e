"""Rank failures as a fact every survivor agrees on.

When an operation on a group fails because of another rank (the backend marks the error
with :attr:`DistBackendError.failed_peer`, or it is the backend's own timeout), the rank
does not raise the backend's error as it is: it first agrees with the other members on
*which* ranks failed, through the group's store, and raises :class:`DistRankFailureError`
naming that set. Every survivor names the same set.

The agreement (:func:`_agree`, run once per group, by the first thread that needs it):

1. The rank publishes a claim: the group ranks it suspects (from the error: the failed
   peer, or the ranks a timeout names).
2. It collects the other members' claims. A rank that claims is alive. A rank that is
   suspected, or whose process is gone (or stopped) on this host, failed: each member
   published its host and process id when the group was built. The others are waited
   for, up to the failure window (``TDIST_FAILURE_WINDOW`` seconds, default 5, at most
   the group's timeout); then a silent rank whose process runs on this host is alive,
   not failed, and a silent rank on another host (whose liveness only its claim can
   show) failed.
3. The first rank to finish writes its verdict with ``compare_set``; every rank adopts
   the verdict that won. A rank the verdict names (it was too slow) learns that it was
   declared failed.

An empty verdict (every rank claimed: a mismatch, not a lost rank) raises the backend's
own error. ``ProcessGroup.abort()`` claims first, saying the rank leaves on purpose: the
agreement then ends at once and a rank whose operation failed because of the abort
raises the backend's error, not a rank failure. The verdict is kept: every later
operation on the group raises the same :class:`DistRankFailureError` before any
communication, until the program shrinks the group or destroys it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._errors import DistBackendError, DistBackendTimeoutError, DistStoreError, failed_peer

if TYPE_CHECKING:
    from ._groups import ProcessGroup
    from ._store.base import Store

__all__ = [
    "DistRankFailureError",
    "DistRankFailureTimeoutError",
    "FAILURE_WINDOW_ENV",
    "agree_now",
    "known_failure",
    "mark_aborting",
    "publish_process",
    "rank_failure",
]

#: Seconds a survivor waits for the claims of ranks nobody suspects (at most the group's timeout).
FAILURE_WINDOW_ENV = "TDIST_FAILURE_WINDOW"
_DEFAULT_WINDOW = 5.0
_POLL = 0.02  # seconds between looks at the claims


class DistRankFailureError(DistBackendError):
    """Ranks of a group failed; every survivor raises this error with the same set.

    ``failed_ranks``: the failed group ranks (sorted), as every survivor agreed;
    ``failed_global_ranks``: the same as global ranks; ``group_name``: the group's name;
    ``self_failed``: True on a rank that the survivors declared failed (it was too slow
    to answer): it must leave the group. ``failed_peer`` is the first failed global rank.
    Shrink the group without ``failed_ranks`` (:func:`tdist.shrink_group`) to go on.
    """

    def __init__(
        self,
        message: str,
        failed_ranks: Sequence[int] = (),
        failed_global_ranks: Sequence[int] = (),
        group_name: str = "",
        self_failed: bool = False,
    ) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(failed_ranks)
        self.failed_global_ranks: tuple[int, ...] = tuple(failed_global_ranks)
        self.group_name = group_name
        self.self_failed = self_failed
        self.failed_peer = self.failed_global_ranks[0] if self.failed_global_ranks else -1

    def __reduce__(self) -> Any:
        args = (str(self), self.failed_ranks, self.failed_global_ranks, self.group_name, self.self_failed)
        return (type(self), args)


class DistRankFailureTimeoutError(DistRankFailureError, DistBackendTimeoutError):
    """A :class:`DistRankFailureError` found by a timeout (the failed ranks made no
    progress within the group's timeout): also a ``TimeoutError``, as every tdist error
    that comes from waiting too long."""


def _window(pg: "ProcessGroup") -> float:
    try:
        window = float(os.environ.get(FAILURE_WINDOW_ENV, _DEFAULT_WINDOW))
    except ValueError:
        window = _DEFAULT_WINDOW
    return max(0.0, min(window, pg.timeout.total_seconds()))


# ----------------------------------------------------------------- process identity
def _identity() -> dict[str, Any]:
    """What tells whether another process is on this host: the same kernel (boot), pid
    namespace (its pid means something here) and network namespace (what reaches this
    process reaches it: containers, or simulated hosts, on one kernel are other hosts)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns, netns = os.stat("/proc/self/ns/pid").st_ino, os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return {"host": socket.gethostname(), "pid": os.getpid(), "space": None}
    return {"host": socket.gethostname(), "pid": os.getpid(), "space": f"{boot}:{pidns}:{netns}"}


_ME = _identity()


def publish_process(group_store: "Store", group_rank: int) -> None:
    """Record this process's identity for the group's agreement (one store write)."""
    group_store.set(f"proc/{group_rank}", json.dumps(_ME))


#: ``/proc/<pid>/stat`` states of a process that makes no progress: zombie, dead, stopped.
_NOT_RUNNING = ("Z", "X", "x", "T", "t")


def _pid_here(group_store: "Store", group_rank: int) -> Optional[int]:
    """The pid of ``group_rank``'s process when it runs on this host (same boot and pid
    namespace), else None (another host, or not published): only its claim can tell then."""
    try:
        if not group_store.check([f"proc/{group_rank}"]):
            return None
        them = json.loads(group_store.get(f"proc/{group_rank}"))
        same_space = _ME["space"] is not None and them.get("space") == _ME["space"]
        return int(them["pid"]) if same_space else None
    except (DistStoreError, ValueError, OSError, KeyError):
        return None


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists here and is neither dead nor stopped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in _NOT_RUNNING
    except (OSError, IndexError, ValueError):
        return False  # no such process


# ----------------------------------------------------------------- the agreement
def _suspects(pg: "ProcessGroup", exc: BaseException, operation: str) -> Optional[set[int]]:
    """The group ranks ``exc`` (an error of ``operation``) blames, an empty set when it
    blames an unknown rank, None when it is not a failure of another rank. A receive or
    send that timed out is not one (the peer may simply not have sent); a collective that
    timed out is (every member must take part)."""
    peer = failed_peer(exc)
    if peer is not None:
        if peer >= 0 and peer in pg.ranks:
            return {pg.ranks.index(peer)}
        return set()
    point_to_point = operation.lstrip("i").startswith(("send", "recv"))
    if isinstance(exc, DistBackendTimeoutError) and not point_to_point and not getattr(exc, "local_wait", False):
        missing = getattr(exc, "missing_ranks", None) or []
        return {r for r in missing if isinstance(r, int) and 0 <= r < pg.size and r != pg.rank}
    return None


class _Agreement:
    """One group's agreement: run once, by the first thread that needs it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: ``{"failed": [...], "aborting": [...]}`` (group ranks), once agreed
        self.verdict: Optional[dict[str, list[int]]] = None


_CREATE = threading.Lock()


def _agreement(pg: "ProcessGroup") -> _Agreement:
    with _CREATE:
        if pg.agreement is None:
            pg.agreement = _Agreement()
        return pg.agreement


def _claim(pg: "ProcessGroup", suspects: set[int], aborting: bool = False) -> None:
    pg.store.set(f"failure/claim/{pg.rank}", json.dumps({"suspects": sorted(suspects), "aborting": aborting}))


def mark_aborting(pg: "ProcessGroup") -> None:
    """Say, before this rank aborts ``pg``, that it is alive and leaving on purpose."""
    try:
        _claim(pg, set(), aborting=True)
    except (DistStoreError, OSError):
        pass  # the store is gone: the peers decide without this rank's word


def _agree(pg: "ProcessGroup", suspects: set[int]) -> dict[str, list[int]]:
    """The verdict every member adopts: ``failed`` group ranks and ``aborting`` ones (see
    the module docstring)."""
    store = pg.store
    _claim(pg, suspects)
    blamed = set(suspects)
    claimed, aborting = {pg.rank}, set()
    pids = {r: _pid_here(store, r) for r in range(pg.size) if r != pg.rank}  # read once
    started = time.monotonic()
    window = _window(pg)
    while True:
        if store.check(["failure/verdict"]):
            return dict(json.loads(store.get("failure/verdict")))
        gone = set()
        for r in range(pg.size):
            if r in claimed:
                continue
            if store.check([f"failure/claim/{r}"]):
                claim = json.loads(store.get(f"failure/claim/{r}"))
                claimed.add(r)
                blamed |= set(claim.get("suspects", []))
                if claim.get("aborting"):
                    aborting.add(r)
            elif pids[r] is not None and not _running(pids[r]):  # type: ignore[arg-type]
                gone.add(r)
        failed = (blamed | gone) - claimed
        waiting = [r for r in range(pg.size) if r not in claimed and r not in failed]
        if aborting or not waiting:
            break  # an aborted group fails at once; else every rank is accounted for
        if time.monotonic() - started >= window:  # alive here: not failed, only silent
            failed |= {r for r in waiting if pids[r] is None or not _running(pids[r])}  # type: ignore[arg-type]
            break
        time.sleep(_POLL)
    mine = json.dumps({"failed": sorted(failed), "aborting": sorted(aborting)})
    return dict(json.loads(store.compare_set("failure/verdict", "", mine)))


def rank_failure(pg: "ProcessGroup", exc: BaseException, operation: str) -> BaseException:
    """What to raise for ``exc``, the error of ``operation`` on ``pg``: a
    :class:`DistRankFailureError` with the agreed failed ranks when ``exc`` is (a
    consequence of) another rank's failure and the survivors agree some ranks failed;
    else ``exc`` itself."""
    if isinstance(exc, DistRankFailureError) or not isinstance(exc, DistBackendError):
        return exc
    state = _agreement(pg)
    if state.verdict is None:
        suspects = _suspects(pg, exc, operation)
        if suspects is None:
            return exc
        with state.lock:
            if state.verdict is None:
                try:
                    state.verdict = _agree(pg, suspects)
                except (DistStoreError, OSError, ValueError) as store_error:
                    exc.add_note(f"tdist: the failure agreement could not run: {store_error}")
                    return exc
    return _error(pg, state.verdict["failed"], exc) if state.verdict["failed"] else exc


def agree_now(pg: "ProcessGroup") -> tuple[int, ...]:
    """The agreed failed ranks of ``pg``, running the agreement (with no suspects of this
    rank's own) if it has not run yet: ULFM's ``MPI_Comm_agree`` for failures."""
    state = _agreement(pg)
    with state.lock:
        if state.verdict is None:
            state.verdict = _agree(pg, set())
    return tuple(state.verdict["failed"])


def known_failure(pg: "ProcessGroup") -> Optional[DistRankFailureError]:
    """The agreed failure of ``pg``, if one was agreed (a fresh error to raise), else None."""
    state = pg.agreement
    if state is None or state.verdict is None or not state.verdict["failed"]:
        return None
    return _error(pg, state.verdict["failed"], None)


def _error(pg: "ProcessGroup", verdict: list[int], cause: Optional[BaseException]) -> DistRankFailureError:
    failed_global = [pg.ranks[r] for r in verdict]
    self_failed = pg.rank in verdict
    if self_failed:
        head = f"this rank (group rank {pg.rank}) was declared failed by the other members"
    elif len(verdict) == 1:
        head = f"rank {verdict[0]} failed"
    else:
        head = f"ranks {verdict} failed"
    names = "" if failed_global == verdict else f" (global {failed_global})"
    what = f": {cause}" if cause is not None else ""
    message = (
        f"group {pg.name!r}: {head}{names}, as every surviving member agreed; shrink the group without "
        f"them (tdist.shrink_group) or destroy it{what}"
    )
    kind = DistRankFailureTimeoutError if isinstance(cause, TimeoutError) else DistRankFailureError
    error = kind(message, verdict, failed_global, pg.name, self_failed)
    error.__cause__ = cause
    return error
