"""tdist-template: a minimal, working third-party tdist plugin to copy.

It registers, through the entry-point group ``tdist``:

- the backend ``store`` (:mod:`tdist_template.backend`): every operation goes
  through the group's key-value store; slow but short, complete and correct;
- the init method ``indexed://host:port`` (:mod:`tdist_template.rendezvous`):
  the rank comes from a scheduler's index variable (Kubernetes Indexed Jobs).

Importing this package (or :mod:`tdist_template.plugin`) imports neither torch
nor the backend: the factory imports them when a process group is built.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "BACKEND_NAME", "SCHEME"]

#: The name users pass to ``init_process_group`` (and the entry point's name).
BACKEND_NAME = "store"
#: The URL scheme of the init method this plugin registers.
SCHEME = "indexed"
