"""The ``secret`` the core hands every backend factory, for the backend's own authentication.

A job's shared secret is its store token: the ``token=`` of the :class:`TCPStore` the
group's store writes through to, else ``$TDIST_STORE_TOKEN`` (for stores without one:
``file://``, a torch store). Backends never receive the token itself but a key derived
from it per backend name, so that nothing a backend computes with its key can stand
in for a proof in the store's own handshake (or in another backend's).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import os
from typing import Any, Callable, Optional

from ._store.tcp_store import TOKEN_ENV

__all__ = ["backend_secret", "secret_argument"]

_LABEL = b"tdist backend secret v1\0"


def _store_token(store: Any) -> Optional[bytes]:
    """The token of the first store in ``store``'s chain of wrappers that has one
    (a TCPStore: b"" when it authenticates nothing), else None."""
    seen: set[int] = set()
    current = store
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        token = getattr(current, "_token", None)
        if isinstance(token, bytes):
            return token
        current = getattr(current, "underlying_store", None)
    return None


def backend_secret(store: Any, backend: str) -> bytes:
    """The key backend ``backend`` authenticates its connections with (32 bytes), or
    b"" when the job has no token (the backend then authenticates nothing)."""
    token = _store_token(store)
    if token is None:
        token = os.environ.get(TOKEN_ENV, "").encode()
    if not token:
        return b""
    return hmac.new(token, _LABEL + backend.encode(), hashlib.sha256).digest()


def _accepts_secret(factory: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "secret" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def secret_argument(factory: Callable[..., Any], store: Any, backend: str) -> dict[str, bytes]:
    """``{"secret": ...}`` for a factory that takes it (a ``secret`` parameter or ``**kwargs``),
    else ``{}`` (factories written before the argument existed keep working)."""
    return {"secret": backend_secret(store, backend)} if _accepts_secret(factory) else {}
