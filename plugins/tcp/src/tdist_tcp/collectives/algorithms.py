"""Collective algorithms over a :class:`Coll` (one collective's view of the transport).

Tensors here are flat, contiguous 1-D tensors; payloads are uint8 memoryviews of
them. Every algorithm posts its receives before it sends (so frames land straight
in their destination) and spreads the work over all ranks:

- all_reduce: recursive doubling (with the usual fold of the ranks beyond the largest
  power of two) for small tensors; for large ones a segmented, pipelined ring
  reduce-scatter followed by a ring all-gather. Every element is reduced in one fixed
  operand order, so all ranks end bitwise identical;
- broadcast: binomial tree (small) or a segmented pipelined chain (large);
- reduce: binomial tree towards the root, segments reduced as they arrive;
- ranks that would only send (broadcast and scatter roots, reduce and gather senders)
  wait for an empty acknowledgement from each receiver, so a rank never completes a
  collective its peers disagreed on (they detect the mismatch and abort the group);
- all_gather / reduce_scatter: the same pipelined ring;
- all_to_all: pairwise exchange (step i: send to r+i, receive from r-i);
- gather / scatter: direct to / from the root; barrier: dissemination with empty frames.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from tdist.plugin import combine_

from ..net.transport import FrameTimeout, PostedRecv, Transport
from ..protocol.wire import COLL, OP_ACK, PART_FOLD, PART_UNFOLD, byte_view, pack_header

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

__all__ = [
    "Coll",
    "SubColl",
    "Scratch",
    "segments",
    "all_reduce",
    "all_reduce_small",
    "all_reduce_ring",
    "ring",
    "reduce_scatter_ring",
    "broadcast",
    "broadcast_tree",
    "broadcast_chain",
    "reduce_tree",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
]

_EMPTY = memoryview(b"")
_FOLD, _UNFOLD = PART_FOLD, PART_UNFOLD

#: Element-wise torch ops on more elements than this fan out to torch's intra-op
#: thread pool, which on a machine shared by several ranks is many times slower
#: than one thread; the backend applies them piecewise instead.
GRAIN = 32768


def serially(fn: Callable[..., Any], *tensors: "torch.Tensor") -> None:
    """``fn(*tensors)`` applied to aligned pieces of at most :data:`GRAIN` elements."""
    n = tensors[0].numel()
    if n <= GRAIN:
        fn(*tensors)
        return
    for a in range(0, n, GRAIN):
        fn(*[t[a : a + GRAIN] for t in tensors])


def combine_serial(acc: "torch.Tensor", other: "torch.Tensor", op: "Reduction") -> None:
    """:func:`tdist.reduction.combine_` without torch's thread pool."""
    n = acc.numel()
    if n <= GRAIN:
        combine_(acc, other, op)
        return
    for a in range(0, n, GRAIN):
        combine_(acc[a : a + GRAIN], other[a : a + GRAIN], op)


def copy_serial(dst: "torch.Tensor", src: "torch.Tensor") -> None:
    serially(_copy, dst, src)


def _copy(dst: "torch.Tensor", src: "torch.Tensor") -> None:
    dst.copy_(src)


class Scratch:
    """Reusable work buffers of one group, by slot name (its collectives run one at a
    time). Reuse spares a large allocation's page faults on every call; buffers above
    ``keep_bytes`` are allocated afresh and not kept."""

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self._bufs: dict[str, Any] = {}
        self.keep_bytes = keep_bytes

    def get(self, slot: str, numel: int, dtype: "torch.dtype") -> "torch.Tensor":
        import torch

        nbytes = numel * dtype.itemsize
        if nbytes > self.keep_bytes:
            return torch.empty(numel, dtype=dtype)
        buf = self._bufs.get(slot)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[slot] = torch.empty(max(nbytes, 64), dtype=torch.uint8)
        return buf[:nbytes].view(dtype)

    def clear(self) -> None:
        self._bufs.clear()


class Coll:
    """One collective: its operation, reduce op and dtype codes, sequence number, size
    (bytes of this rank's tensor, for messages), deadline and the group's scratch buffers."""

    __slots__ = ("tr", "rank", "size", "op", "redop", "seq", "dtype", "nbytes", "deadline", "scratch")

    def __init__(
        self,
        tr: Transport,
        op: int,
        redop: int,
        seq: int,
        dtype: int,
        deadline: float,
        scratch: Optional[Scratch] = None,
        nbytes: int = 0,
    ) -> None:
        self.tr = tr
        self.rank = tr.rank
        self.size = tr.size
        self.op = op
        self.redop = redop
        self.seq = seq
        self.dtype = dtype
        self.nbytes = nbytes
        self.deadline = deadline
        self.scratch = scratch if scratch is not None else Scratch(0)

    def irecv(self, src: int, dest: memoryview, part: int = 0) -> PostedRecv:
        """Post the receive of frame ``part`` (step << 32 | segment) of this collective from ``src``."""
        return self.tr.post_coll(src, dest, self.op, self.redop, self.seq, self.dtype, part)

    def wait(self, pr: PostedRecv) -> None:
        try:
            self.tr.wait_coll(pr, self.deadline)
        except FrameTimeout as exc:
            raise self._timeout(exc) from None

    def _timeout(self, exc: FrameTimeout) -> Exception:
        return self.tr.collective_timeout(self, exc.peer, f"waiting for {exc.frame} from {self.tr.label(exc.peer)}")

    def send(self, dst: int, payload: memoryview, part: int = 0) -> None:
        self.tr.send(
            dst, pack_header(COLL, self.op, self.redop, self.dtype, part, self.seq, len(payload)), payload, self, part
        )

    def irecv_ack(self, src: int) -> PostedRecv:
        return self.tr.post_coll(src, _EMPTY, OP_ACK, 0, self.seq, 0)

    def ack(self, dst: int) -> None:
        self.tr.send(dst, pack_header(COLL, OP_ACK, 0, 0, 0, self.seq, 0), _EMPTY, self)

    def sendrecv(self, peer: int, payload: memoryview, dest: memoryview, part: int = 0) -> None:
        pr = self.irecv(peer, dest, part)
        self.send(peer, payload, part)
        self.wait(pr)


class SubColl(Coll):
    """The same collective seen by a subset of the group's ranks (``ranks``, in the order
    that numbers them here): ``rank`` and ``size`` count members, and every peer named
    to :meth:`irecv`, :meth:`send`, :meth:`irecv_ack` and :meth:`ack` is a member index.
    Frames keep the collective's header, so subsets of one collective must not reuse a
    (peer pair, part) — the hierarchical collectives run one socket phase per pair."""

    __slots__ = ("ranks",)

    def __init__(self, c: Coll, ranks: Sequence[int]) -> None:
        super().__init__(c.tr, c.op, c.redop, c.seq, c.dtype, c.deadline, c.scratch, c.nbytes)
        self.ranks = ranks
        self.rank = ranks.index(c.rank)
        self.size = len(ranks)

    def irecv(self, src: int, dest: memoryview, part: int = 0) -> PostedRecv:
        return super().irecv(self.ranks[src], dest, part)

    def send(self, dst: int, payload: memoryview, part: int = 0) -> None:
        super().send(self.ranks[dst], payload, part)

    def irecv_ack(self, src: int) -> PostedRecv:
        return super().irecv_ack(self.ranks[src])

    def ack(self, dst: int) -> None:
        super().ack(self.ranks[dst])


def segments(n: int, seg: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into pieces of at most ``seg`` (none when n == 0)."""
    return [(a, min(a + seg, n)) for a in range(0, n, max(1, seg))]


# ----------------------------------------------------------------- all_reduce
def all_reduce_small(c: Coll, flat: "torch.Tensor", op: "Reduction") -> None:
    """Recursive doubling; ranks >= the largest power of two fold into a partner first."""
    p, r = c.size, c.rank
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    view = byte_view(flat)
    if r >= pof2:  # extra rank: hand the data over, get the result back
        partner = r - pof2
        pr = c.irecv(partner, view, _UNFOLD)  # the result cannot arrive before our data left
        c.send(partner, view, _FOLD)
        c.wait(pr)
        return
    other = c.scratch.get("small", flat.numel(), flat.dtype)
    acc, acc_view = flat, view
    other_view = byte_view(other)
    if r < rem:
        c.wait(c.irecv(r + pof2, other_view, _FOLD))
        combine_serial(acc, other, op)
    mask = 1
    while mask < pof2:
        partner = r ^ mask
        c.sendrecv(partner, acc_view, other_view, mask)
        if r < partner:  # always <lower rank's block> op <higher rank's block>
            combine_serial(acc, other, op)
        else:
            combine_serial(other, acc, op)
            acc, other, acc_view, other_view = other, acc, other_view, acc_view
        mask <<= 1
    if acc is not flat:
        copy_serial(flat, acc)
    if r < rem:
        c.send(r + pof2, view, _UNFOLD)


def ring(
    c: Coll, chunks: Sequence["torch.Tensor"], nsteps: int, nreduce: int, op: Optional["Reduction"], seg: int
) -> None:
    """The segmented ring. At step s rank r sends chunk (r - s) % p to its right and
    receives chunk (r - s - 1) % p from its left; the first ``nreduce`` steps combine
    what arrives into the local chunk (reduce-scatter), later ones receive in place
    (all-gather). What arrives at step s is what leaves at step s + 1, so each segment
    is forwarded as soon as it is done (the ring is pipelined across steps).
    """
    p, r = c.size, c.rank
    left, right = (r - 1) % p, (r + 1) % p
    es = chunks[0].element_size()
    views = [byte_view(ch) for ch in chunks]
    segs = [segments(ch.numel(), seg) for ch in chunks]
    tmps: list = []
    tviews: list = []
    if nreduce:
        longest = max(ch.numel() for ch in chunks)
        tmps = [c.scratch.get(f"ring{k}", longest, chunks[0].dtype) for k in range(min(2, nreduce))]
        tviews = [byte_view(t) for t in tmps]

    def post(s: int) -> list[PostedRecv]:
        ci = (r - s - 1) % p
        view = tviews[s % 2] if s < nreduce else views[ci]
        return [c.irecv(left, view[a * es : b * es], (s << 32) | k) for k, (a, b) in enumerate(segs[ci])]

    posted = {0: post(0)}
    if nsteps > 1:
        posted[1] = post(1)
    mine = r % p
    for k, (a, b) in enumerate(segs[mine]):
        c.send(right, views[mine][a * es : b * es], k)
    for s in range(nsteps):
        ci = (r - s - 1) % p
        prs = posted.pop(s)
        chunk, view = chunks[ci], views[ci]
        reducing = s < nreduce
        tmp = tmps[s % 2] if reducing else None
        forward = s + 1 < nsteps
        for k, (a, b) in enumerate(segs[ci]):
            c.wait(prs[k])
            if reducing:
                combine_serial(chunk[a:b], tmp[a:b], op)  # type: ignore[index,arg-type]
            if forward:
                c.send(right, view[a * es : b * es], ((s + 1) << 32) | k)
        if s + 2 < nsteps:
            posted[s + 2] = post(s + 2)


def reduce_scatter_ring(c: Coll, chunks: Sequence["torch.Tensor"], op: "Reduction", seg: int) -> None:
    """Ring reduce-scatter: rank r's ``chunks[r]`` := the reduction of every rank's ``chunks[r]``
    (the ring's order rotated so that each rank ends up holding its own chunk)."""
    p = c.size
    if p > 1:
        ring(c, [chunks[(i - 1) % p] for i in range(p)], p - 1, p - 1, op, seg)


def all_reduce_ring(c: Coll, flat: "torch.Tensor", op: "Reduction", seg: int) -> None:
    """Ring reduce-scatter then ring all-gather (2 (p - 1) pipelined steps)."""
    p, n = c.size, flat.numel()
    bounds = [(i * n) // p for i in range(p + 1)]
    chunks = [flat[bounds[i] : bounds[i + 1]] for i in range(p)]
    ring(c, chunks, 2 * (p - 1), p - 1, op, seg)


def all_reduce(c: Coll, flat: "torch.Tensor", op: "Reduction", small_bytes: int, seg_bytes: int) -> None:
    """:func:`all_reduce_small` up to ``small_bytes`` (or for fewer elements than ranks),
    else :func:`all_reduce_ring` pipelined in segments of ``seg_bytes``."""
    es = flat.element_size()
    if flat.numel() * es <= small_bytes or flat.numel() < c.size:
        all_reduce_small(c, flat, op)
    else:
        all_reduce_ring(c, flat, op, max(1, seg_bytes // es))


# ------------------------------------------------------------ rooted trees
def broadcast_tree(c: Coll, view: memoryview, root: int) -> None:
    """Binomial tree: receive from the parent (and acknowledge), send to the children
    (largest subtree first), wait for their acknowledgements."""
    p, r = c.size, c.rank
    vr = (r - root) % p
    mask = 1
    while mask < p:
        if vr & mask:
            parent = (vr - mask + root) % p
            c.wait(c.irecv(parent, view))
            c.ack(parent)
            break
        mask <<= 1
    mask >>= 1
    children = []
    while mask > 0:
        if vr + mask < p:
            children.append((vr + mask + root) % p)
        mask >>= 1
    acks = [c.irecv_ack(child) for child in children]
    for child in children:
        c.send(child, view)
    for pr in acks:
        c.wait(pr)


def broadcast_chain(c: Coll, view: memoryview, root: int, seg_bytes: int) -> None:
    """Pipelined chain root -> root+1 -> ...: each segment is forwarded as it arrives;
    each rank acknowledges the whole message to its predecessor."""
    p, r = c.size, c.rank
    vr = (r - root) % p
    nxt = (r + 1) % p if vr + 1 < p else None
    prev = (r - 1) % p
    segs = segments(len(view), seg_bytes)
    prs = [c.irecv(prev, view[a:b], k) for k, (a, b) in enumerate(segs)] if vr else []
    ack = c.irecv_ack(nxt) if nxt is not None else None
    for k, (a, b) in enumerate(segs):
        if vr:
            c.wait(prs[k])
        if nxt is not None:
            c.send(nxt, view[a:b], k)
    if vr:
        c.ack(prev)
    if ack is not None:
        c.wait(ack)


def broadcast(c: Coll, view: memoryview, root: int, small_bytes: int, seg_bytes: int) -> None:
    """:func:`broadcast_tree` up to ``small_bytes`` (or on 2 ranks), else :func:`broadcast_chain`."""
    if len(view) > small_bytes and c.size > 2:
        broadcast_chain(c, view, root, seg_bytes)
    else:
        broadcast_tree(c, view, root)


def reduce_tree(c: Coll, flat: "torch.Tensor", root: int, op: "Reduction", seg: int) -> None:
    """Binomial tree towards ``root``; each child's segments are combined as they arrive
    (and acknowledged), then the partial result goes to the parent."""
    p, r = c.size, c.rank
    vr = (r - root) % p
    es = flat.element_size()
    view = byte_view(flat)
    segs = segments(flat.numel(), seg)
    tmp = tview = None
    mask = 1
    while mask < p:
        if vr & mask:
            parent = (vr - mask + root) % p
            ack = c.irecv_ack(parent)
            for k, (a, b) in enumerate(segs):
                c.send(parent, view[a * es : b * es], k)
            c.wait(ack)
            return
        child = vr | mask
        if child < p:
            if tmp is None:
                tmp = c.scratch.get("tree", flat.numel(), flat.dtype)
                tview = byte_view(tmp)
            src = (child + root) % p
            prs = [c.irecv(src, tview[a * es : b * es], k) for k, (a, b) in enumerate(segs)]  # type: ignore[index]
            for k, (a, b) in enumerate(segs):
                c.wait(prs[k])
                combine_serial(flat[a:b], tmp[a:b], op)
            c.ack(src)
        mask <<= 1


# ------------------------------------------------------------------- others
def all_to_all(c: Coll, out_views: Sequence[memoryview], in_views: Sequence[memoryview]) -> None:
    """Pairwise exchange; rank r's own piece is copied by the caller."""
    p, r = c.size, c.rank
    prs = {(r - i) % p: c.irecv((r - i) % p, out_views[(r - i) % p]) for i in range(1, p)}
    for i in range(1, p):
        dst = (r + i) % p
        c.send(dst, in_views[dst])
    for i in range(1, p):
        c.wait(prs[(r - i) % p])


def gather(c: Coll, view: memoryview, out_views: Optional[Sequence[memoryview]], root: int) -> None:
    """Direct to the root, which acknowledges each piece."""
    p, r = c.size, c.rank
    if r != root:
        ack = c.irecv_ack(root)
        c.send(root, view)
        c.wait(ack)
        return
    prs = {i: c.irecv(i, out_views[i]) for i in range(p) if i != root}  # type: ignore[index]
    for i, pr in prs.items():
        c.wait(pr)
        c.ack(i)


def scatter(c: Coll, view: memoryview, in_views: Optional[Sequence[memoryview]], root: int) -> None:
    """Direct from the root; every receiver acknowledges its piece."""
    p, r = c.size, c.rank
    if r != root:
        c.wait(c.irecv(root, view))
        c.ack(root)
        return
    dsts = [(root + i) % p for i in range(1, p)]
    acks = [c.irecv_ack(dst) for dst in dsts]
    for dst in dsts:
        c.send(dst, in_views[dst])  # type: ignore[index]
    for pr in acks:
        c.wait(pr)


def barrier(c: Coll) -> None:
    """Dissemination barrier: round k sends to r + 2^k and waits for r - 2^k."""
    p, r = c.size, c.rank
    k = 1
    while k < p:
        pr = c.irecv((r - k) % p, _EMPTY, k)
        c.send((r + k) % p, _EMPTY, k)
        c.wait(pr)
        k <<= 1
