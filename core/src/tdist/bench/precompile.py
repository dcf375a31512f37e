"""Byte-compile tdist's sources before a benchmark starts its workers.

A ``pip install`` of tdist's wheels writes every module's ``.pyc``; an editable install
(``pip install -e``, ``make venv``) does not, and with ``PYTHONDONTWRITEBYTECODE=1`` no
process ever writes them, so every worker would compile tdist's sources again at import
(about 0.1-0.2 s of CPU each) while torch's modules come precompiled. The benchmark
measures the installed case: :func:`precompile` compiles what is stale first.
"""

from __future__ import annotations

import compileall
import importlib.util
import os

__all__ = ["PACKAGES", "precompile"]

#: The top-level packages of this repository's distributions.
PACKAGES = ("tdist", "tdist_autoload", "tdist_tcp", "tdist_gloo", "tdist_mpi", "tdist_nccl", "tdist_debug")


def precompile(packages: tuple[str, ...] = PACKAGES) -> str:
    """Compile the ``.pyc`` of every installed package of ``packages`` whose bytecode is
    missing or stale (``compileall``, as pip does); a line that says what was done."""
    done: list[str] = []
    failed: list[str] = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        for where in spec.submodule_search_locations:
            ok = os.access(where, os.W_OK) and compileall.compile_dir(where, quiet=2, workers=1)
            (done if ok else failed).append(name)
    line = f"byte-compiled the sources of {', '.join(done) or 'nothing'} (as pip install does)"
    if failed:
        line += f"; could not for {', '.join(failed)} (their workers may compile at import)"
    return line
