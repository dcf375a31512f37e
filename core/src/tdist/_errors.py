"""The exceptions tdist raises.

Every error is a :class:`DistError`. Errors that come from waiting too long are
also :class:`TimeoutError`, so ``except TimeoutError`` catches them whatever
layer timed out.
"""

from __future__ import annotations

__all__ = [
    "DistError",
    "DistBackendError",
    "DistStoreError",
    "DistNetworkError",
    "DistBackendTimeoutError",
    "DistStoreTimeoutError",
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
