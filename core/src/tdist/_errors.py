"""The exceptions tdist raises.

Every error is a :class:`DistError`. Errors that come from waiting too long are
also :class:`TimeoutError`, so ``except TimeoutError`` catches them whatever
layer timed out; calls that do not fit the current state (before
``init_process_group``, after ``destroy_process_group``) are also the
``ValueError`` torch.distributed raises there.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendTimeoutError",
    "DistStoreTimeoutError",
    "DistStateError",
    "NotInitializedAssertion",
    "backend_error",
    "failed_peer",
]


class DistError(RuntimeError):
    """Base class of every error raised by tdist."""


class DistBackendError(DistError):
    """A backend failed: a peer died, data did not match, or the group broke.

    ``failed_peer``: set by the backend when this error is the consequence of another
    rank's failure (the peer died, shut its group down, aborted it or was interrupted):
    that rank's global rank, or ``-1`` when the backend cannot tell which. None: this rank's
    own failure, a timeout, or not known. (``tdistrun`` uses it to name the rank that failed
    first; :func:`failed_peer` finds it in an exception's causes.)
    """

    failed_peer: Optional[int] = None


class DistStoreError(DistError):
    """A key-value store operation failed."""


class DistNetworkError(DistError):
    """A network connection could not be made or was refused."""


class DistBackendTimeoutError(DistBackendError, TimeoutError):
    """A backend operation did not complete within its timeout."""


class DistStoreTimeoutError(DistStoreError, TimeoutError):
    """A store operation (get, wait, rendezvous) did not complete within its timeout."""


class DistStateError(DistError, ValueError):
    """A call that does not fit the current state: before ``init_process_group`` or
    after ``destroy_process_group``, ``init_process_group`` twice, or on a destroyed
    group. Also a ``ValueError``, as torch.distributed raises in these cases."""


class NotInitializedAssertion(DistStateError, AssertionError):
    """``destroy_process_group()`` with nothing initialized: torch.distributed raises
    ``AssertionError`` there, so this is one too (and a :class:`DistStateError`)."""


#: Words in a library's error message that mean it timed out.
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded")


def backend_error(backend: str, operation: str, exc: BaseException, detail: Optional[str] = None) -> BaseException:
    """The tdist error for what a backend's library raised during ``operation``.

    tdist errors and non-``Exception`` s (``KeyboardInterrupt``) come back unchanged. A
    timeout (a ``TimeoutError``, or a message saying so) becomes
    :class:`DistBackendTimeoutError`, anything else :class:`DistBackendError`, with the
    message ``"<operation>: backend '<backend>' failed: <detail>"`` (``detail``: the
    library's message by default) and ``exc`` as its ``__cause__``.
    """
    if isinstance(exc, DistError) or not isinstance(exc, Exception):
        return exc
    text = detail or str(exc).strip() or type(exc).__name__
    timed_out = isinstance(exc, TimeoutError) or any(word in text.lower() for word in _TIMEOUT_WORDS)
    cls = DistBackendTimeoutError if timed_out else DistBackendError
    error = cls(f"{operation}: backend {backend!r} failed: {text}")
    error.__cause__ = exc
    return error


def failed_peer(exc: Optional[BaseException]) -> Optional[int]:
    """Whether ``exc`` is the consequence of another rank's failure: the
    :attr:`DistBackendError.failed_peer` of the first such error in ``exc``, its causes or
    contexts (``-1``: a peer, not known which), else None."""
    seen: set[int] = set()
    stack = [exc]
    while stack:
        error = stack.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        peer = getattr(error, "failed_peer", None) if isinstance(error, DistBackendError) else None
        if isinstance(peer, int):
            return peer
        stack.extend((error.__context__, error.__cause__))  # the cause is looked at first
    return None
