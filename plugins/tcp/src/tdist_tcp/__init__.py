"""tdist-tcp: the ``tcp`` backend of tdist.

Every point-to-point and collective operation on CPU tensors of every dtype, over
TCP connections between the ranks of a group, in Python (torch does the arithmetic).
Importing this package is cheap: torch and the backend load when a group is created.

The package, layer by layer (one subpackage each; none imports in a circle, which
``tests/test_import_graph.py`` checks):

- :mod:`.protocol` -- **wire and auth**: :mod:`~.protocol.wire` (frame format, codes),
  :mod:`~.protocol.auth` (keys, the mutually authenticated handshake),
  :mod:`~.protocol.tls` (optional TLS between hosts);
- :mod:`.net` -- **connections and the I/O loop**: :mod:`~.net.ioloop` (one thread
  reads every socket of the process), :mod:`~.net.links` (a peer's links, the frame
  reader), :mod:`~.net.connect` and :mod:`~.net.acceptor` (the two sides of a
  handshake), :mod:`~.net.mesh` (listeners, addresses, connections made when first
  needed), :mod:`~.net.roster` and :mod:`~.net.tally` (a group's setup through its
  store), :mod:`~.net.transport` (frames over a group's links: posted receives,
  stashes, failure), :mod:`~.net.verdicts` (timeouts, mismatches, aborts),
  :mod:`~.net.handover` (links handed to a shrunken group);
- :mod:`.shared` -- **shared memory**: :mod:`~.shared.topology` (which ranks share a
  host), :mod:`~.shared.segment` (create, find, authenticate the segment),
  :mod:`~.shared.shmstep` (its step protocol), :mod:`~.shared.shmwait` (spin or
  sleep), :mod:`~.shared.futex`, :mod:`~.shared.kernels` (reductions),
  :mod:`~.shared.native` (the optional C part, ``_shmfast``), :mod:`~.shared.cma` (large
  all_reduces in the peers' own memory), :mod:`~.shared.shm` (the one-host collectives);
- :mod:`.collectives` -- **algorithms**: :mod:`~.collectives.tensors` (flat, scaled
  inputs), :mod:`~.collectives.algorithms` (ring/tree/doubling over sockets),
  :mod:`~.collectives.hierarchy` (shared memory within a host, sockets between hosts),
  :mod:`~.collectives.p2p` (send/recv), :mod:`~.collectives.lanes` (where operations run);
- **the backend**, at the top: :mod:`.factory` (builds a group's), :mod:`.backend`
  (``TcpBackend``), :mod:`.regroup` (``shrink_group`` on the old group's connections and
  segment), :mod:`.plugin` (the hook implementations, entry point ``tcp``).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__", "BACKEND_NAME"]

BACKEND_NAME = "tcp"
