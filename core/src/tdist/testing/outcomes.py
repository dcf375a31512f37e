"""What a world's call came back with: a :class:`RankFailure` per rank that did not
return normally, the order to report them in, and the harness's exceptions."""

from __future__ import annotations

import contextlib
import pickle
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

__all__ = [
    "RankFailure",
    "WorldError",
    "WorldRunError",
    "WorldStartError",
    "WorldTimeoutError",
    "failures_first",
    "indent",
    "reply_outcome",
    "NOT_THIS_CALL",
]


class WorldError(RuntimeError):
    """The harness itself failed (a world could not start, or is dead)."""


class WorldStartError(WorldError):
    """Workers could not be started, did not connect, or failed ``init_process_group``."""


class WorldRunError(AssertionError):
    """A body failed on at least one rank; the message holds every failing rank's traceback."""

    def __init__(self, message: str, outcomes: Sequence[Any] = ()) -> None:
        super().__init__(message)
        self.outcomes = list(outcomes)


class WorldTimeoutError(WorldRunError):
    """Some ranks did not answer within the body's timeout; the world was killed."""


@dataclass
class RankFailure:
    """What happened on a rank that did not return normally.

    ``kind`` is ``"error"`` (the body raised), ``"died"`` (the process exited or
    its connection closed), ``"timeout"`` (no answer in time; the world was killed) or
    ``"stopped"`` (killed without waiting for it, because another rank's body raised:
    see ``fail_fast`` in :meth:`World.try_run`).
    For errors, ``type_name`` is the exception class name, ``mro`` the
    ``module.qualname`` of each class in its MRO, ``exception`` the exception
    itself when it could be pickled back (else None).
    """

    rank: int
    kind: str
    type_name: str = ""
    message: str = ""
    traceback: str = ""
    mro: tuple[str, ...] = ()
    exception: Optional[BaseException] = None
    elapsed: float = 0.0
    log_tail: str = ""

    def is_a(self, *types: Union[str, type]) -> bool:
        """True if the error is an instance of any of ``types`` (classes or names;
        a bare name matches any module, a dotted name must match exactly)."""
        if self.kind != "error":
            return False
        short = {entry.rsplit(".", 1)[-1] for entry in self.mro}
        for t in types:
            if isinstance(t, type):
                if self.exception is not None and isinstance(self.exception, t):
                    return True
                name = f"{t.__module__}.{t.__qualname__}"
                if name in self.mro:
                    return True
                if t.__module__ == "builtins" and t.__qualname__ in short:
                    return True
            elif "." in t:
                if t in self.mro:
                    return True
            elif t in short:
                return True
        return False

    @property
    def headline(self) -> str:
        if self.kind == "error":
            first = self.message.strip().splitlines()[0] if self.message.strip() else ""
            return f"{self.type_name}: {first}"
        return f"{self.kind}: {self.message}"

    def __str__(self) -> str:
        text = f"--- rank {self.rank}: {self.headline}"
        if self.kind == "error" and self.traceback:
            text += "\n" + self.traceback.rstrip()
        elif self.kind == "error" and self.message:
            text += "\n" + self.message
        if self.log_tail:
            text += f"\n    (tail of rank {self.rank}'s output)\n" + indent(self.log_tail.rstrip(), "    | ")
        return text


def failures_first(outcomes: Sequence[Any]) -> list[RankFailure]:
    """The failures among ``outcomes``, the most telling first: ranks whose body raised
    (assertions first, earliest first), then the ranks that died, timed out or were
    stopped (usually only waiting for the first)."""
    return sorted(
        (o for o in outcomes if isinstance(o, RankFailure)),
        key=lambda f: (f.kind != "error", not f.is_a(AssertionError), f.elapsed),
    )


def indent(text: str, prefix: str) -> str:
    """``text`` with ``prefix`` before each line."""
    return "\n".join(prefix + line for line in text.splitlines())


#: What :func:`reply_outcome` returns for a reply to another (an earlier, abandoned) call.
NOT_THIS_CALL: Any = object()


def reply_outcome(rank: int, msg: tuple, call_id: int, sent_at: float) -> Any:
    """Rank ``rank``'s outcome of call ``call_id`` (sent at ``sent_at``, monotonic) from
    one of its worker's messages: ``("ok", id, value)`` is the value, ``("err", id,
    info, elapsed)`` an ``"error"`` :class:`RankFailure` (with the exception itself where
    it unpickles), ``("eof", why, exit_code)`` a ``"died"`` one; a reply to another call
    (or any other message) is :data:`NOT_THIS_CALL`."""
    kind = msg[0]
    if kind == "eof":
        return RankFailure(
            rank,
            "died",
            "WorkerDied",
            f"worker process exited or closed its connection ({msg[1]}; exit code {msg[2]})",
            elapsed=time.monotonic() - sent_at,
        )
    if kind not in ("ok", "err") or msg[1] != call_id:
        return NOT_THIS_CALL
    if kind == "ok":
        return msg[2]
    info = msg[2]
    exc = None
    if info.get("pickled"):
        with contextlib.suppress(Exception):
            exc = pickle.loads(info["pickled"])
    return RankFailure(rank, "error", info["type"], info["message"], info["traceback"], tuple(info["mro"]), exc, msg[3])
