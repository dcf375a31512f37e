"""``python -m tdist.bench``: collective benchmarks (in the spirit of nccl-tests).

Measures time per call and bus bandwidth of all_reduce, broadcast, all_gather,
reduce_scatter and all_to_all from 4 B to 64 MiB on 2 and 4 ranks of this host, for
tdist's tcp backend side by side with torch.distributed's own gloo (in the same
worker processes, on another port) and, when mpi4py and ``mpirun`` are installed,
raw mpi4py (the workers are then started by ``mpirun``). Backends are measured in
turn, sample by sample, so that they share the machine's load; medians are reported.

Modules: :mod:`.workers` (the per-rank program), :mod:`.runner` (starting workers),
:mod:`.report` (bus bandwidth, table, CSV/JSON), :mod:`.plot` (PNG),
:mod:`.overhead` (``--core-overhead``). Nothing here is imported by ``import tdist``.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: "list[str] | None" = None) -> int:
    from .__main__ import main as _main

    return _main(argv)
