"""The exceptions tdist raises.

Every error is a :class:`DistError`. Errors that come from waiting too long are
also :class:`TimeoutError`, so ``except TimeoutError`` catches them whatever
layer timed out; calls that do not fit the current state (before
``init_process_group``, after ``destroy_process_group``) are also the
``ValueError`` torch.distributed raises there.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendTimeoutError",
    "DistStoreTimeoutError",
    "DistStateError",
    "NotInitializedAssertion",
]


class DistError(RuntimeError):
    """Base class of every error raised by tdist."""


class DistBackendError(DistError):
    """A backend failed: a peer died, data did not match, or the group broke."""


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
