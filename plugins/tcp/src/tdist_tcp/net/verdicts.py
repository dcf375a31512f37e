"""What a rank says when an operation goes wrong: timeout verdicts (PROBE/STATE), mismatches,
aborts, and breaking the group.

A group breaks (:meth:`Verdicts.fail`) on the first error that leaves it unusable: every
pending and later operation raises it, and ABORT frames tell the peers (each rank sends
them once). A peer that is gone fails only what needs it, unless it crashed.

A collective that times out asks every peer how many collectives it has issued (a PROBE
frame, answered with a STATE frame by the peer's I/O loop, so a busy or blocked rank
still answers; a peer never connected is connected to first) and names the ranks that
had not reached it, or did not answer. Also the errors of mismatched frames and of a
peer's ABORT frame (a timeout's verdict is raised as such). :class:`Verdicts` is a part of
:class:`~tdist_tcp.net.transport.Transport`.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from tdist.plugin import DistBackendError, DistBackendTimeoutError

from .links import Peer, PostedRecv, clip_reason, send_control, timeout_error
from ..protocol.wire import ABORT, PROBE, STATE, describe, dtype_name, pack_header

if TYPE_CHECKING:
    from ..collectives.algorithms import Coll
    from .mesh import Mesh

__all__ = ["Verdicts"]


class Verdicts:
    """The transport's timeout verdicts and mismatch errors (a mixin of Transport)."""

    rank: int
    size: int
    timeout: float
    issued: int
    peers: list[Optional[Peer]]
    mesh: Optional["Mesh"]
    broken: Optional[DistBackendError]
    _lock: threading.Lock
    _probe_seq: int
    _probe_replies: dict[int, int]
    _probe_cv: threading.Condition
    _global: list[int]
    _p2p_posted: list[PostedRecv]
    _closing: bool
    _told_peers: bool
    _helpers: list[threading.Thread]
    _break_callbacks: list[Callable[[], None]]

    @property
    def me(self) -> str:
        raise NotImplementedError

    def label(self, rank: int) -> str:
        raise NotImplementedError

    def connect(self, peer: Peer, limit: Optional[float] = None, broken_too: bool = False) -> None:
        raise NotImplementedError

    def collective_timeout(
        self, c: "Coll", waited_for: int, detail: str = "", via: str = ""
    ) -> DistBackendTimeoutError:
        """The error of collective ``c`` that timed out on ``waited_for`` (``detail``: how),
        naming the ranks that did not arrive at it (asked with :meth:`probe`)."""
        missing, silent = self.probe(c.seq, min(2.0, max(0.5, self.timeout / 2)))
        what = describe(c.op, c.redop, c.seq, c.dtype, c.nbytes)
        head = f"tcp backend: {self.me} timed out after {self.timeout:g} s in {what}{via}"
        if missing:
            parts = []
            for q in missing:
                why = "no answer: stopped, hung or overloaded" if q in silent else "it has not started it"
                parts.append(f"{self.label(q)} ({why})")
            names = ", ".join(parts)
            verdict = f"{names} did not arrive" if len(missing) == 1 else f"ranks {names} did not arrive"
        else:  # everyone has started it: the one waited for is stuck behind something else
            verdict = f"every rank has started it; {self.label(waited_for)} did not send its part"
        detail = f" ({detail})" if detail else ""
        return timeout_error(f"{head}: {verdict}{detail}", missing or [waited_for])

    def probe(self, seq: int, wait: float) -> tuple[list[int], set[int]]:
        """Ask every reachable peer how many collectives it has issued; return (the ranks
        that have not issued collective ``seq``, those of them that did not answer within ``wait``)."""
        with self._lock:
            self._probe_seq += 1
            token = self._probe_seq
            self._probe_replies = {}
        frame = pack_header(PROBE, 0, 0, 0, 0, token, 0)
        asked = []
        for p in self.peers:
            if p is None or p.closed is not None:
                continue
            if not p.links:  # never connected: connect now (a dead or hung rank does not answer)
                try:
                    self.connect(p, min(1.0, wait))
                except Exception:  # noqa: BLE001 - it counts as silent
                    continue
            if send_control(p.links[0], frame, 0.5, self):
                asked.append(p)
        deadline = time.monotonic() + wait
        with self._probe_cv:
            while len(self._probe_replies) < len(asked) and self._probe_seq == token:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._probe_cv.wait(left)
            replies = dict(self._probe_replies) if self._probe_seq == token else {}
        silent = {p.rank for p in self.peers if p is not None and p.rank not in replies}
        missing = sorted(q for q in range(self.size) if q in silent or (q in replies and replies[q] < seq))
        return missing, silent

    def on_probe(self, peer: Peer, token: int) -> None:
        links = peer.links  # (none once handed over by a shrink)
        if links:
            send_control(links[0], pack_header(STATE, 0, 0, 0, self.issued, token, 0), 1.0, self)

    def on_state(self, peer: Peer, token: int, issued: int) -> None:
        with self._probe_cv:
            if token == self._probe_seq:
                self._probe_replies[peer.rank] = issued
                self._probe_cv.notify_all()

    def _mismatch(
        self, pr: PostedRecv, peer: Peer, op: int, redop: int, seq: int, dtype: int, nbytes: int, part: int
    ) -> DistBackendError:
        return DistBackendError(
            f"tcp backend: {self.me} expected {describe(pr.op, pr.redop, pr.seq, pr.dtype, pr.nbytes, part=pr.tag)} "
            f"from {peer.label} but got {describe(op, redop, seq, dtype, nbytes, part=part)} (the ranks called "
            "different collectives, or with different sizes, dtypes or reduce ops)"
        )

    def _p2p_mismatch(self, pr: PostedRecv, peer: Peer, dtype: int, nbytes: int, shape: tuple) -> DistBackendError:
        src = "any source" if pr.src is None else f"src={pr.src}"
        return DistBackendError(
            f"tcp backend: {self.me} recv({src}, tag={pr.tag}) expects {dtype_name(pr.dtype)} x {pr.nbytes} bytes "
            f"but {peer.label} sent {dtype_name(dtype)}{list(shape)} x {nbytes} bytes"
        )

    def abort_error(self, peer: Peer, payload: bytes) -> DistBackendError:
        """The error an ABORT frame from ``peer`` breaks this rank's group with: a
        :class:`DistBackendTimeoutError` naming the missing ranks if the abort is a timeout's;
        its ``failed_peer`` is the rank whose loss ``peer`` relays (so a survivor that hears
        of a loss from another survivor blames the lost rank, not the messenger), else ``peer``."""
        failed = None
        try:
            info = json.loads(payload.decode("utf-8", "replace"))
            reason = str(info["reason"])
            missing = [int(q) for q in info.get("missing", ()) if 0 <= int(q) < self.size]
            timed_out = bool(info.get("timeout"))
            failed = info.get("failed")
        except (ValueError, TypeError, KeyError, AttributeError):
            reason, missing, timed_out = payload.decode("utf-8", "replace"), [], False
        reason, missing = clip_reason(reason), sorted(set(missing))  # a peer's words, not a megabyte of them
        if timed_out:
            err: DistBackendError = timeout_error(
                f"tcp backend: {peer.label} aborted {self.me}'s group after a timeout: {reason}", missing
            )
        else:
            err = DistBackendError(f"tcp backend: {peer.label} aborted the group: {reason}")
        # the rank whose loss the peer relays (it learnt first), else the peer's own failure
        relayed = type(failed) is int and failed >= 0 and failed in self._global and failed != self._global[self.rank]
        err.failed_peer = failed if relayed else self._global[peer.rank]
        err.abort_reason = reason  # type: ignore[attr-defined]
        return err

    # ---------------------------------------------------------------- failure
    def add_break_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` whenever the group breaks or a peer goes away (e.g. to wake
        threads that wait on something other than a posted receive)."""
        self._break_callbacks.append(fn)

    def _notify_break(self) -> None:
        for fn in list(self._break_callbacks):
            try:
                fn()
            except Exception:
                pass

    def fail(self, err: DistBackendError, notify: bool = True) -> None:
        """Break the group: every pending and later operation raises the first error.
        With ``notify``, ABORT frames carrying ``err`` tell the peers (so they raise instead
        of waiting); each rank sends them once, also when an ABORT broke its group first
        and one of its own operations then fails (so a peer that the first rank could not
        reach still hears of it)."""
        with self._lock:
            first = self.broken is None
            if first:
                self.broken = err
                pending: list[Any] = list(self._p2p_posted)
                self._p2p_posted.clear()
                for peer in self.peers:
                    if peer is not None:
                        pending.extend(peer.take_posted())
            tell = notify and not self._closing and not self._told_peers
            if tell:
                self._told_peers = True
        if first:
            for pr in pending:
                pr.finish(err)
            self._notify_break()
        if tell:
            reason = getattr(err, "abort_reason", None) or str(err)  # relay the origin's words, not nested
            payload = json.dumps(
                {
                    "reason": reason[:4000],
                    "timeout": isinstance(err, DistBackendTimeoutError),
                    "missing": list(getattr(err, "missing_ranks", [])),
                    "failed": err.failed_peer,  # (global) the rank whose loss broke the group, if one did
                }
            ).encode()
            helper = threading.Thread(target=self._send_aborts, args=(payload,), name="tdist-tcp-abort", daemon=True)
            self._helpers.append(helper)
            helper.start()

    def _send_aborts(self, payload: bytes) -> None:
        frame = pack_header(ABORT, 0, 0, 0, 0, 0, len(payload)) + payload
        for peer in self.peers:
            if peer is not None and peer.closed is None and peer.links:
                send_control(peer.links[0], frame, 2.0, self)
        for peer in self.peers:  # then those never connected: they may wait for this rank too
            if peer is not None and peer.closed is None and not peer.links and self.mesh is not None:
                try:
                    self.connect(peer, 1.0, broken_too=True)
                except Exception:  # noqa: BLE001 - best effort: it times out by itself
                    continue
                send_control(peer.links[0], frame, 2.0, self)

    def _peer_gone(self, peer: Peer, err: DistBackendError, crashed: bool) -> None:
        with self._lock:
            if peer.closed is None:
                peer.closed = str(err)
                peer.failed = err.failed_peer
            pending: list[Any] = peer.take_posted()
            everyone_gone = all(p is None or p.closed is not None for p in self.peers)
            keep = []
            for pr in self._p2p_posted:
                if pr.src == peer.rank or (pr.src is None and everyone_gone):
                    pending.append(pr)
                else:
                    keep.append(pr)
            self._p2p_posted[:] = keep
        for pr in pending:
            pr.finish(err)
        self._notify_break()
        if crashed:
            self.fail(err)
