"""tdist-tcp: the ``tcp`` backend of tdist.

Every point-to-point and collective operation on CPU tensors of every dtype, over
TCP connections between the ranks of a group, in Python (torch does the arithmetic).
Importing this package is cheap: torch and the backend load when a group is created.

The modules, layer by layer (none imports in a circle: ``tests/test_import_graph.py``):

- **wire and auth** -- :mod:`.wire` (frame format, codes), :mod:`.auth` (keys, the
  mutually authenticated handshake), :mod:`.tls` (optional TLS between hosts);
- **connections and the I/O loop** -- :mod:`.ioloop` (one thread reads every socket of
  the process), :mod:`.links` (a peer's links, the frame reader), :mod:`.connect` and
  :mod:`.acceptor` (the two sides of a handshake), :mod:`.mesh` (listeners, addresses,
  connections made when first needed), :mod:`.verdicts` (timeouts, mismatches, aborts),
  :mod:`.transport` (frames over a group's links: posted receives, stashes, failure);
- **a group's setup through its store** -- :mod:`.roster` (one record per rank),
  :mod:`.tally` (yes/no agreements), :mod:`.topology` (which ranks share a host);
- **shared memory** -- :mod:`.segment` (create, find, authenticate the segment),
  :mod:`.shmstep` (its step protocol), :mod:`.shmwait` (spin or sleep), :mod:`.futex`,
  :mod:`.kernels` (reductions), :mod:`.native` (the optional C part), :mod:`.shm` (the
  one-host collectives);
- **algorithms** -- :mod:`.tensors` (flat, scaled inputs), :mod:`.algorithms`
  (ring/tree/doubling over sockets), :mod:`.hierarchy` (shared memory within a host,
  sockets between hosts), :mod:`.p2p` (send/recv), :mod:`.lanes` (where operations run);
- **the backend** -- :mod:`.factory` (builds a group's), :mod:`.backend` (``TcpBackend``), :mod:`.regroup` and
  :mod:`.handover` (``shrink_group`` on the old group's connections and segment),
  :mod:`.plugin` (the hook implementations, entry point ``tcp``).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "BACKEND_NAME"]

BACKEND_NAME = "tcp"
