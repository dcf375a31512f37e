"""Collectives of a group that spans several hosts: shared memory within a host, sockets
between hosts (the group's :class:`~tdist_tcp.shared.topology.Layout` says which is which).

With ``L`` ranks on each of ``H`` hosts (a *uniform* layout), local rank ``l`` of every
host forms *column* ``l`` with its counterparts on the other hosts, and the data is cut
so that every column carries its share between hosts at once: every local rank uses the
host's link, and each host sends (and receives) the least a ring allows.

- all_reduce, large: reduce-scatter within the host (local rank ``l`` gets the host's
  sum of slice ``l``), all_reduce of slice ``l`` in column ``l`` (pipelined ring),
  all-gather within the host. Small: all_reduce within the host, then every column
  all_reduces the whole tensor (recursive doubling): two latencies, no third step;
- reduce_scatter: reduce-scatter within the host (local rank ``l`` gets, for every host
  ``j``, the host's sum of the block of host ``j``'s rank ``l``), then a ring
  reduce-scatter in the column;
- all_gather: ring all-gather in the column, then all-gather within the host;
- broadcast / reduce (any layout): one rank per host (the root on the root's host, the
  lowest rank elsewhere) broadcasts / reduces between hosts (tree or pipelined chain),
  the host's ranks get it / contribute through shared memory;
- all_reduce of a non-uniform layout: reduce to the lowest rank of each host, all_reduce
  among those, broadcast within each host.

Every element is reduced in one order that does not depend on the rank, so all ranks end
bitwise identical. What is not here (all_gather and reduce_scatter of a non-uniform
layout, and the other collectives) runs the flat socket algorithms. Each collective's
shared-memory phases post one and the same descriptor (so a fast rank's next phase never
changes what a slow one is still checking), and each pair of ranks exchanges frames in
one socket phase only (:class:`~tdist_tcp.collectives.algorithms.SubColl`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from tdist.plugin import ReduceOp, Reduction

from . import algorithms as algo
from ..shared.topology import Layout
from ..protocol.wire import byte_view

if TYPE_CHECKING:
    import torch

    from ..shared.shm import ShmEngine

__all__ = ["Hierarchy", "summing"]

_SUM = Reduction(ReduceOp.SUM)


def summing(op: Reduction) -> Reduction:
    """The operator the phases apply to prescaled contributions: AVG and PREMUL_SUM sum
    (the caller prescales once, and divides an AVG by the group size once)."""
    return _SUM if op.op is ReduceOp.AVG or op.op is ReduceOp.PREMUL_SUM else op


class Hierarchy:
    """One rank's view of the group's hosts and the collectives built on them.

    ``engine``: the shared segment of this rank's host (None when it is alone there);
    ``small_bytes``: up to this size the socket phases use the latency-bound algorithms;
    ``seg_bytes``: their pipelining unit.
    """

    def __init__(
        self,
        layout: Layout,
        rank: int,
        engine: Optional["ShmEngine"],
        small_bytes: int,
        seg_bytes: int,
    ) -> None:
        self.layout = layout
        self.rank = rank
        self.host = layout.host_of(rank)
        self.local = layout.hosts[self.host]
        self.l = self.local.index(rank)
        self.shm = engine
        self.small_bytes = small_bytes
        self.seg_bytes = seg_bytes
        self.uniform = layout.uniform
        #: my counterparts on every host (uniform layouts only), host 0's first
        self.column = [m[self.l] for m in layout.hosts] if self.uniform else []

    def __repr__(self) -> str:
        return f"<Hierarchy hosts {[list(m) for m in self.layout.hosts]}>"

    # ------------------------------------------------------------------ helpers
    def _rep(self, host: int, root: int) -> int:
        """Host ``host``'s rank in the exchange between hosts of a collective rooted at ``root``."""
        members = self.layout.hosts[host]
        return root if root in members else members[0]

    def _reps(self, root: int) -> list[int]:
        return [self._rep(h, root) for h in range(len(self.layout.hosts))]

    def _seg_elems(self, t: "torch.Tensor") -> int:
        return max(1, self.seg_bytes // t.element_size())

    def _between_hosts_all_reduce(
        self, c: algo.Coll, ranks: Sequence[int], flat: "torch.Tensor", op: Reduction
    ) -> None:
        algo.all_reduce(algo.SubColl(c, ranks), flat, op, self.small_bytes, self.seg_bytes)

    # -------------------------------------------------------------- collectives
    def all_reduce(self, c: algo.Coll, flat: "torch.Tensor", op: Reduction) -> None:
        """``flat`` := the reduction over the group (PREMUL_SUM prescaled by the caller,
        AVG left for the caller to divide)."""
        op = summing(op)
        shm, L = self.shm, len(self.local)
        if not self.uniform:
            if shm is not None:
                shm.all_reduce(c, flat, op, root=0)
            if self.l == 0:
                self._between_hosts_all_reduce(c, self.layout.leaders(), flat, op)
            if shm is not None:
                shm.broadcast(c, flat, 0)
            return
        n = flat.numel()
        if n * flat.element_size() <= self.small_bytes or n < L * len(self.column):
            shm.all_reduce(c, flat, op)  # type: ignore[union-attr]  # uniform and worth it: L > 1
            self._between_hosts_all_reduce(c, self.column, flat, op)
            return
        m = -(-n // L)  # slice elements (the last slice padded)
        whole = flat if n == m * L else c.scratch.get("hier", m * L, flat.dtype)
        if whole is not flat:
            algo.copy_serial(whole[:n], flat)
            whole[n:].zero_()
        slices = list(whole.view(L, m))
        mine = slices[self.l]
        shm.reduce_scatter(c, mine, slices, op)  # type: ignore[union-attr]
        self._between_hosts_all_reduce(c, self.column, mine, op)
        shm.gather_blocks(c, mine, slices, None)  # type: ignore[union-attr]
        if whole is not flat:
            algo.copy_serial(flat, whole[:n])

    def broadcast(self, c: algo.Coll, flat: "torch.Tensor", src: int) -> None:
        reps = self._reps(src)
        if self.rank in reps:
            sub = algo.SubColl(c, reps)
            algo.broadcast(sub, byte_view(flat), self.layout.host_of(src), self.small_bytes, self.seg_bytes)
        if self.shm is not None:
            self.shm.broadcast(c, flat, self.local.index(self._rep(self.host, src)))

    def reduce(self, c: algo.Coll, flat: "torch.Tensor", dst: int, op: Reduction) -> None:
        """``flat`` of ``dst`` := the reduction (prescaled by the caller; AVG left to divide)."""
        op = summing(op)
        rep = self._rep(self.host, dst)
        if self.shm is not None:
            self.shm.all_reduce(c, flat, op, root=self.local.index(rep))
        if self.rank == rep:
            sub = algo.SubColl(c, self._reps(dst))
            algo.reduce_tree(sub, flat, self.layout.host_of(dst), op, self._seg_elems(flat))

    def all_gather(self, c: algo.Coll, blocks: Sequence["torch.Tensor"], src: "torch.Tensor") -> bool:
        """``blocks[q]`` := rank q's ``src`` (flat, equal sizes); False (nothing done) for a
        layout this does not serve."""
        if not self.uniform:
            return False
        hosts = self.layout.hosts
        mine = [blocks[m[self.l]] for m in hosts]  # my column's blocks, by host
        algo.copy_serial(mine[self.host], src)
        sub = algo.SubColl(c, self.column)
        algo.ring(sub, mine, sub.size - 1, 0, None, self._seg_elems(src))
        for members in hosts:  # host j's blocks, every local rank holding its column's
            self.shm.gather_blocks(c, blocks[members[self.l]], [blocks[q] for q in members], None)  # type: ignore[union-attr]
        return True

    def reduce_scatter(
        self, c: algo.Coll, out: "torch.Tensor", ins: Sequence["torch.Tensor"], op: Reduction
    ) -> Optional["torch.Tensor"]:
        """The reduction over the group of every rank's ``ins[rank]`` (flat, equal sizes;
        the caller divides an AVG): a tensor to copy into the output, or None (nothing done)
        for a layout this does not serve. ``ins`` stay untouched."""
        if not self.uniform:
            return None
        hosts = self.layout.hosts
        m = out.numel()
        rows = list(c.scratch.get("hier", m * len(hosts), out.dtype).view(len(hosts), m))
        local_op = _SUM if op.op is ReduceOp.AVG else op  # PREMUL_SUM: prescaled there, once
        for j, members in enumerate(hosts):
            self.shm.reduce_scatter(c, rows[j], [ins[q] for q in members], local_op)  # type: ignore[union-attr]
        algo.reduce_scatter_ring(algo.SubColl(c, self.column), rows, summing(op), self._seg_elems(out))
        return rows[self.host]
