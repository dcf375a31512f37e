"""``flag``: the one parser of boolean settings (environment variables, ``pg_options``)."""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["flag", "TRUE_WORDS", "FALSE_WORDS"]

TRUE_WORDS = frozenset({"1", "true", "yes", "on", "y"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", "n"})


def flag(name: str, default: bool = False, value: Optional[Any] = None) -> bool:
    """The boolean setting ``value`` (e.g. a ``pg_options`` entry) when not None, else the
    environment variable ``name``; unset or empty: ``default``. A bool passes as is;
    1/true/yes/on/y and 0/false/no/off/n (any case) are read; anything else is a
    :class:`ValueError` naming ``name``, never a silent guess."""
    if value is None:
        value = os.environ.get(name, "")
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if not word:
        return default
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"{name}={value!r}: expected 1/true/yes/on or 0/false/no/off")
