"""tdist-tcp: the ``tcp`` backend of tdist.

Every point-to-point and collective operation on CPU tensors of every dtype, over
TCP connections between the ranks of a group, in Python (torch does the arithmetic).
Importing this package is cheap: torch and the backend load when a group is created.

Modules: :mod:`.plugin` (the hook implementations), :mod:`.wire` (frame format),
:mod:`.auth` (keys and the mutually authenticated handshake), :mod:`.mesh` (connection
setup), :mod:`.transport` (reader threads, matching, timeouts), :mod:`.lanes` (where
operations run), :mod:`.algorithms` (ring/tree/doubling), :mod:`.segment` (the shared
segment: create, find, authenticate), :mod:`.shm` (collectives through shared memory when
the whole group is on one host; :mod:`.futex` to sleep and wake there, :mod:`.kernels` to
reduce), :mod:`.backend` (``TcpBackend``).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "BACKEND_NAME"]

BACKEND_NAME = "tcp"
