"""tdist-nccl: the ``nccl`` backend of tdist.

NCCL collectives and point-to-point on CUDA torch tensors, called through
``cupy.cuda.nccl`` on torch's current CUDA stream. Importing this package is
cheap: neither torch nor CuPy is imported until a process group is built (or,
for torch, until availability is checked).

Modules: :mod:`.plugin` (hook implementations), :mod:`.comm` (unique id,
communicators), :mod:`.dtypes` (torch -> NCCL types and operators),
:mod:`.cuda` (streams and events), :mod:`.work` (``NcclWork``),
:mod:`.backend` (``NcclBackend``), :mod:`.multigpu` (the ``*_multigpu`` collectives).
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from tdist.plugin import OPERATIONS as _ALL

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "INSTALL_HINT", "OPERATIONS", "__version__", "unavailable_reason"]

BACKEND_NAME = "nccl"
INSTALL_HINT = "pip install tdist-nccl[cuda12] (or tdist-nccl[cuda13] for CUDA 13)"

#: What the backend serves: CUDA tensors only, every operation but recv from any source
#: (NCCL matches a receive to one named peer), so the core refuses ``recv(src=None)``.
OPERATIONS: dict[str, frozenset[str]] = {"cuda": frozenset(_ALL)}


def unavailable_reason() -> Optional[str]:
    """None when the backend can run here, else why not. Cheap: finds CuPy without
    importing it, and asks torch for a device without creating a CUDA context."""
    try:
        found = importlib.util.find_spec("cupy") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"cupy is not installed: {INSTALL_HINT}"
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return f"torch cannot be imported: {exc}"
    if getattr(torch.version, "cuda", None) is None and getattr(torch.version, "hip", None) is None:
        return "this torch build has no CUDA support (torch.version.cuda is None): install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA device visible (torch.cuda.is_available() is False)"
    return None
