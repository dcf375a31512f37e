"""Collectives through shared memory, for a group whose ranks all share one host.

When a group is created, rank 0 creates one anonymous segment (:mod:`tdist_tcp.shared.segment`:
a memory file that never has a name in ``/dev/shm``, authenticated with the group's
key) and offers it in its record of the group's setup (:mod:`tdist_tcp.net.roster`,
:func:`make_offer`); the other ranks map it and check it (:func:`take_offer`) and say
so in their records (:func:`open_shm` does the same through keys of its own, for one
host's ranks of a group that spans several). Once every rank has answered, rank 0
closes its descriptor: the memory then lives exactly as long as the mappings, which
:meth:`ShmEngine.close` removes at ``destroy_process_group`` and the kernel at exit,
so nothing is ever left behind. If any rank cannot map it (another host or pid
namespace, ``shm`` disabled by ``options["shm"]`` or ``$TDIST_TCP_SHM=0``, not Linux
on x86-64) the whole group keeps to its sockets. Point-to-point traffic always goes
through the sockets.

The modules of the engine:

- :mod:`tdist_tcp.shared.shmstep`: the segment's layout (per rank a control block and two
  buffers) and the step protocol (post, wait, descriptor checks, liveness, timeouts);
- :mod:`tdist_tcp.shared.shmwait`: the waiting policy (spin or sleep at once, from the ranks on
  the host against the CPUs they may use, and whether a CPU is free);
- this module: setting the segment up and the collective algorithms on it;
- :mod:`tdist_tcp.shared.kernels` the reductions, :mod:`tdist_tcp.shared.native` the optional C part,
  :mod:`tdist_tcp.shared.cma` large all_reduces through the peers' own memory.

Algorithms (``p`` ranks, per-rank buffer ``S`` bytes):

- all_reduce: up to ``shm_direct_bytes`` (512 KiB / p), every rank publishes its tensor and
  reduces all of them in rank order (one step, bitwise identical results); above,
  per round of ``S`` bytes, a rank publishes the slices its peers own, reduces its
  own slice from its tensor and their buffers into its buffer, and after a second
  step copies every reduced slice out (reduce-scatter then all-gather by reading);
  from 1 MiB, where the group may (:mod:`tdist_tcp.shared.cma`), the same in two steps
  whatever the size, each rank reading and writing its slice in its peers' own memory;
- reduce: the same, only the root copies out; broadcast, gather, all_gather,
  scatter, reduce_scatter, all_to_all: one step per round, each rank reading
  straight from the writer's buffer; barrier: one empty step. all_to_all compares the
  per-pair sizes (every rank publishes its row of the matrix) instead of a size in its
  descriptor.

Copies are ``memmove`` through ctypes and reductions numpy ufuncs (both release
the GIL and stay on one thread), with tdist.reduction's torch functions for the
dtypes numpy lacks (bfloat16, float8, complex32, ...); a two-step all_reduce and reduce_scatter reduce
their slice in one call to the C part's ``combine`` where it has the dtype and operator.

The small one-step collectives of a caller that waits (barrier, broadcast, all_reduce
and reduce up to 64 KiB) run in one call into the optional C part instead
(:mod:`tdist_tcp.shared.native`: :attr:`ShmEngine.fast`), which follows the same protocol
and shares the engine's counters; when its bounded spin runs out (or the policy says
not to spin), :meth:`ShmEngine.settle` waits here, in Python, as every step does. A
queued all_reduce or reduce small enough makes the same call (:meth:`ShmEngine.all_reduce`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import sys
import time
import warnings
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Optional, Sequence

import numpy as np
from tdist.plugin import (
    DistBackendError,
    DistBackendTimeoutError,
    ReduceOp,
    descriptor_shortage,
    flag,
)

from . import native, segment, shmwait
from .cma import CrossMemory

from ..net import tally
from .shmstep import ALIGN as _ALIGN
from .shmstep import CTRL, ShmSteps, set_pid
from .shmstep import layout as _layout
from ..protocol.wire import describe

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

    from ..collectives.algorithms import Coll
    from ..net.transport import Transport

__all__ = ["ShmEngine", "Offer", "make_offer", "take_offer", "open_shm", "shm_enabled", "SHM_ENV", "DEFAULT_SLOT_BYTES"]

SHM_ENV = "TDIST_TCP_SHM"
DEFAULT_SLOT_BYTES = 1 << 20
#: with more ranks on the host than CPUs (every step then costs a sleep and a wake): fewer rounds
DEFAULT_SLOT_BYTES_OVERSUBSCRIBED = 4 << 20
DEFAULT_DIRECT_BYTES = 512 << 10  # divided by the group size
DEFAULT_BLOCK_BYTES = 256 << 10
_ARRAY_CACHE_BYTES = 4096  # tensors up to this size keep their numpy view between collectives

_memmove = ctypes.memmove


def shm_enabled(options: Mapping[str, Any]) -> bool:
    """Whether this rank offers shared memory: ``options["shm"]``, else ``$TDIST_TCP_SHM``
    (default on), and only on Linux x86-64 with ``memfd_create`` and ``/proc``."""
    if not flag(SHM_ENV, True, options.get("shm")):
        return False
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


# numpy warns about floating-point overflow/invalid values in its default error state;
# torch never does, so the warnings numpy attributes to this module are not shown.
warnings.filterwarnings("ignore", category=RuntimeWarning, module=__name__.replace(".", r"\."))


# --------------------------------------------------------------------- the segment
def open_shm(
    store: Any,
    rank: int,
    size: int,
    timeout: float,
    options: Mapping[str, Any],
    transport: "Transport",
    nonce: bytes,
    key: bytes,
    members: Optional[Sequence[int]] = None,
) -> Optional["ShmEngine"]:
    """Set up (or decline, on every rank alike) the shared segment of ``members`` through the store.

    ``members``: the group ranks sharing the segment (one host's, for the hierarchical
    collectives), ``rank`` and ``size`` then being this rank's index among them and their
    number; None: the whole group (a group of one host too large for the offer in
    :mod:`tdist_tcp.net.roster`). Keys live under the group's connection nonce (and the first
    member), so a re-created group never reads a previous incarnation's. Member 0 offers
    a segment (:func:`make_offer`); every other member maps it (:func:`take_offer`) and
    answers ``ok`` or not; member 0 waits for every answer, holding its descriptor until
    then, and publishes the verdict, which the others wait for (:mod:`tdist_tcp.net.tally`):
    the segment is used only if every member mapped it. Each member thus reads two keys
    and member 0 all answers.
    """
    deadline = time.monotonic() + timeout
    ranks = list(members) if members is not None else list(range(size))
    prefix = f"tcp/shm/{nonce.hex()}/" if members is None else f"tcp/shm/{nonce.hex()}/{ranks[0]}/"
    keys = [prefix + f"ok/{r}" for r in range(1, size)]  # the members' answers (tdist_tcp.net.tally)

    def no_answer(missing: list[int]) -> DistBackendTimeoutError:
        return DistBackendTimeoutError(
            f"tcp backend: rank {ranks[rank]} timed out after {timeout:g} s setting up shared memory: "
            f"ranks {missing} did not answer"
        )

    offer: Optional[Offer] = None
    mm: Optional[mmap.mmap] = None
    slot = direct = 0
    try:
        if rank == 0:
            offer = make_offer(size, options, nonce, key, ranks[0])
            store.set(prefix + "name", offer.text if offer is not None else "")
            mm = offer.mm if offer is not None else None
            slot, direct = (offer.slot, offer.direct) if offer is not None else (0, 0)
            verdict = tally.count(store, keys, ranks[1:], prefix + "verdict", deadline, offer is not None, no_answer)
        else:
            text = store.get(prefix + "name", timeout=max(0.01, deadline - time.monotonic())).decode()
            mm, slot, direct = take_offer(text, rank, size, options, nonce, key, ranks[rank])
            store.set(prefix + f"ok/{rank}", "1" if mm is not None else "0")
            verdict = tally.hear(store, keys, ranks[1:], prefix + "verdict", deadline, ranks[0], no_answer)
    except BaseException:
        if mm is not None:
            mm.close()
        raise
    finally:
        if offer is not None:
            segment.close_fd(offer.fd)  # everyone has mapped it (or given up): the mappings hold the memory
    if not verdict or mm is None:
        if mm is not None:
            mm.close()
        return None
    return ShmEngine(mm, rank, size, slot, transport, options, direct, members)


class Offer(NamedTuple):
    """Member 0's new segment: ``text`` tells the others where it is, its buffer size and
    one-step threshold (``locator|slot|direct``); member 0 holds its descriptor ``fd``
    until every member answered, then closes it (:func:`tdist_tcp.shared.segment.close_fd`)."""

    text: str
    fd: int
    mm: mmap.mmap
    slot: int
    direct: int


def make_offer(size: int, options: Mapping[str, Any], nonce: bytes, key: bytes, label: int = 0) -> Optional[Offer]:
    """Member 0's segment for ``size`` members (None when this rank does not offer shared
    memory, or has no descriptor left: ``label`` is its rank in the warning). Member 0's
    buffer size and one-step threshold are everybody's; its default buffer is bigger when
    the members outnumber the CPUs it may use (:func:`tdist_tcp.shared.shmwait.oversubscribed`)."""
    if not shm_enabled(options):
        return None
    default_slot = DEFAULT_SLOT_BYTES
    if shmwait.oversubscribed(size, shmwait.usable_cpus()):
        default_slot = DEFAULT_SLOT_BYTES_OVERSUBSCRIBED
    slot = max(_ALIGN * size * 64, int(options.get("shm_slot_bytes", default_slot)))
    slot = (slot + 4095) // 4096 * 4096
    direct = min(int(options.get("shm_direct_bytes", DEFAULT_DIRECT_BYTES // size)), slot)
    try:
        name, fd, mm = segment.create(_layout(size, slot)[2], size, slot, nonce, key)
    except OSError as exc:
        _say_no_descriptors(label, exc)
        return None
    set_pid(mm, size, slot, 0)
    return Offer(f"{segment.locator(name, fd)}|{slot}|{direct}", fd, mm, slot, direct)


def take_offer(
    text: str, rank: int, size: int, options: Mapping[str, Any], nonce: bytes, key: bytes, label: int = 0
) -> tuple[Optional[mmap.mmap], int, int]:
    """Member ``rank`` (not 0) maps the segment an :class:`Offer`'s ``text`` describes:
    (the mapping, None if it cannot or does not offer shared memory itself; the buffer
    size; the one-step threshold)."""
    where, _, sizes = text.partition("|")
    their_slot, _, their_direct = sizes.partition("|")
    try:
        slot, direct = int(their_slot), int(their_direct)
    except ValueError:
        return None, 0, 0
    mm = None
    if where and shm_enabled(options):
        try:
            mm = segment.attach(where, _layout(size, slot)[2], size, slot, nonce, key)
        except OSError as exc:  # out of file descriptors
            _say_no_descriptors(label, exc)
    if mm is not None:
        set_pid(mm, size, slot, rank)
    return mm, slot, direct


def _say_no_descriptors(rank: int, exc: OSError) -> None:
    """Warn that the shared segment is declined for want of file descriptors (EMFILE, ENFILE)."""
    why = descriptor_shortage(exc)
    if why is not None:
        warnings.warn(
            f"tcp backend: rank {rank} cannot map the group's shared memory: {why}; collectives of this group "
            "on this host go over sockets",
            stacklevel=3,
        )


# ------------------------------------------------------------------------- engine
class ShmEngine(ShmSteps):
    """One group's collectives over its shared segment (one collective at a time)."""

    def __init__(
        self,
        mm: mmap.mmap,
        rank: int,
        size: int,
        slot: int,
        transport: "Transport",
        options: Mapping[str, Any],
        direct_bytes: Optional[int] = None,
        ranks: Optional[Sequence[int]] = None,
        slots: Optional[Sequence[int]] = None,
        places: Optional[int] = None,
    ) -> None:
        """``direct_bytes`` (member 0's, the same everywhere): the largest one-step all_reduce;
        ``ranks``: the group ranks of the members (None: the whole group); ``slots`` and
        ``places``: see :class:`~tdist_tcp.shared.shmstep.ShmSteps`."""
        super().__init__(mm, rank, size, slot, transport, options, ranks, slots, places)
        # the one-step all_reduce reads p times the data: worth it while that stays small
        if direct_bytes is None:
            direct_bytes = int(options.get("shm_direct_bytes", DEFAULT_DIRECT_BYTES // size))
        self.direct_bytes = min(direct_bytes, slot)  # must be the same on every rank
        self.block_bytes = max(4096, int(options.get("shm_block_bytes", DEFAULT_BLOCK_BYTES)))
        #: the largest broadcast / reduction the C steps take (the one-step algorithms only)
        self.quick_bytes = min(native.QUICK_BYTES, slot)
        self.quick_reduce_bytes = min(native.QUICK_BYTES, self.direct_bytes)
        #: large all_reduces through the peers' own memory, where the group can (see tdist_tcp.shared.cma)
        self.cma = CrossMemory(self, [self._ctrl_off + place * CTRL for place in self.slots], options)

    def successor(
        self,
        keep: Sequence[int],
        transport: "Transport",
        options: Mapping[str, Any],
        epoch: int,
        deadline: float,
        ranks: Optional[Sequence[int]] = None,
    ) -> "ShmEngine":
        """This segment for the members ``keep`` (indices here, increasing, this one among
        them) of the group ``shrink_group`` makes (``transport`` its; ``ranks``: their group
        ranks there, None: the whole group): each keeps its control block and buffers, and
        the new epoch starts once all of them came (:meth:`fence`). This engine lets go of
        the mapping then (never unmaps it). The caller makes sure none of this group's
        collectives runs or will run on it."""
        slots = [self.slots[m] for m in keep]
        engine = ShmEngine(
            self.mm,
            keep.index(self.r),
            len(keep),
            self.S,
            transport,
            options,
            self.direct_bytes,
            ranks,
            slots,
            self.places,
        )
        try:
            engine.fence(epoch, deadline)
        except BaseException:
            engine.close(unmap=False)
            raise
        self.close(unmap=False)
        return engine

    # -------------------------------------------------------------- collectives
    def barrier(self, c: "Coll") -> None:
        self._step(c, self._put_desc(c, 0))

    def all_reduce(self, c: "Coll", flat: "torch.Tensor", op: "Reduction", root: Optional[int] = None) -> None:
        """``flat`` := the reduction over ranks (``root`` given: only there, as ``reduce``)."""
        p, r = self.p, self.r
        nb = flat.nbytes
        K = self.kernel(flat.dtype, op)
        avg = op.op is ReduceOp.AVG
        codes = K.codes
        if codes is not None and nb <= self.quick_reduce_bytes and self.fast is not None and self._whole_group:
            # one C call, as a blocking caller's quick path makes it (here for a queued one; the
            # C part takes a descriptor's slot from seq: not for one host's part of a group)
            where = -1 if root is None else root
            outcome = self.fast.run(native.REDUCE, c.seq, c.op, c.redop, c.dtype, flat.data_ptr(), nb, where, *codes)
            if outcome:
                self.settle(outcome, c)
            return
        if nb <= self.direct_bytes:
            b = self._next_buffer()
            desc: Optional[tuple] = self._put_desc(c, nb, root or 0)
            uf = K.ufunc
            if uf is not None:  # numpy all the way (the common case, and the fast one)
                arr = self._array(flat) if nb <= _ARRAY_CACHE_BYTES else flat.numpy()
                views = self._views.get((b, nb, K.npdt)) or self.views(b, nb, K.npdt)
                np.copyto(views[r], arr)
                self._step(c, desc)
                if root is None or root == r:  # every rank: the same operands in the same order
                    if p == 2 and not avg:  # the usual case, without the generic helper's calls
                        try:
                            uf(views[0], views[1], out=arr)
                        except FloatingPointError:
                            K.reduce(arr, views)
                        return
                    K.reduce(arr, views)
                    if avg:
                        self._finalize(flat, op)
                return
            n = flat.numel()
            if nb:
                _memmove(self.base + self.off(r, b), flat.data_ptr(), nb)
            self._step(c, desc)
            if nb and (root is None or root == r):
                K.reduce(flat, [K.shm(self.off(q, b), n) for q in range(p)])
                if avg:
                    self._finalize(flat, op)
            return
        cma = self.cma if root is None and self.cma.wants(nb, K) else None
        if cma is not None and cma.probed:  # (see tdist_tcp.shared.cma)
            cma.publish(flat)
            self._step(c, self._put_desc(c, nb, 0))
            if cma.agreed():
                cma.reduce(flat, K)
                self._step(c)
                return
        es = flat.element_size()
        n = flat.numel()
        ptr = flat.data_ptr()
        chunk = self.S // es
        block = max(1, self.block_bytes // es)
        keep = root is None or root == r
        combine = self.combine
        desc = () if cma is not None and cma.probed else None  # (): checked at the step above
        for a in range(0, n, chunk):
            m = min(chunk, n - a)
            b = self._next_buffer()
            if desc is None:
                desc = self._put_desc(c, nb, root or 0)
                first = desc
            else:
                first = None
            mine = self.off(r, b)
            lo, hi = m * r // p, m * (r + 1) // p
            at = ptr + a * es
            if lo:  # my peers' slices of this chunk: they reduce them
                _memmove(self.base + mine, at, lo * es)
            if hi < m:
                _memmove(self.base + mine + hi * es, at + hi * es, (m - hi) * es)
            self._step(c, first)
            # my slice: my data (from the tensor) op the peers' (in rank order, for determinism),
            # in cache-sized blocks, each copied to my tensor while it is still in the cache
            if codes is not None:  # the same, in one call to the C part
                ins = [at + lo * es if q == r else self.base + self.off(q, b) + lo * es for q in range(p)]
                combine(*codes, hi - lo, self.base + mine + lo * es, at + lo * es if keep else 0, *ins)
            else:
                for s0 in range(lo, hi, block):
                    s1 = min(s0 + block, hi)
                    ins = [
                        K.ten(flat, a + s0, a + s1) if q == r else K.shm(self.off(q, b) + s0 * es, s1 - s0)
                        for q in range(p)
                    ]
                    K.reduce(K.shm(mine + s0 * es, s1 - s0), ins)
                    if avg:
                        self._finalize(self.t8()[mine + s0 * es : mine + s1 * es].view(flat.dtype), op)
                    if keep:
                        _memmove(at + s0 * es, self.base + mine + s0 * es, (s1 - s0) * es)
            self._step(c)
            if keep:
                for q in self._peers:
                    qlo, qhi = m * q // p, m * (q + 1) // p
                    if qhi > qlo:
                        _memmove(at + qlo * es, self.base + self.off(q, b) + qlo * es, (qhi - qlo) * es)
        if cma is not None:
            cma.probe()

    def _finalize(self, t: "torch.Tensor", op: "Reduction") -> None:
        from tdist.plugin import finalize_

        from ..collectives.algorithms import serially

        serially(lambda piece: finalize_(piece, op, self.p), t)

    def broadcast(self, c: "Coll", flat: "torch.Tensor", src: int) -> None:
        nb = flat.numel() * flat.element_size()
        desc = self._put_desc(c, nb, src)
        ptr = flat.data_ptr()
        S, r = self.S, self.r
        a = 0
        while True:
            m = min(S, nb - a)
            b = self._next_buffer()
            if r == src and m:
                _memmove(self.base + self.off(src, b), ptr + a, m)
            self._step(c, desc if a == 0 else None)
            if r != src and m:
                _memmove(ptr + a, self.base + self.off(src, b), m)
            a += m
            if a >= nb:
                return

    def gather_blocks(
        self, c: "Coll", src: "torch.Tensor", outs: Optional[Sequence["torch.Tensor"]], root: Optional[int]
    ) -> None:
        """all_gather (``root`` None) or gather: ``outs[q]`` receives rank q's ``src``."""
        nb = src.numel() * src.element_size()
        desc = self._put_desc(c, nb, root or 0)
        S, r = self.S, self.r
        sptr = src.data_ptr()
        reader = root is None or root == r
        if reader and outs is not None and nb:
            _memmove(outs[r].data_ptr(), sptr, nb)
        a = 0
        while True:
            m = min(S, nb - a)
            b = self._next_buffer()
            if m:
                _memmove(self.base + self.off(r, b), sptr + a, m)
            self._step(c, desc if a == 0 else None)
            if reader and outs is not None and m:
                for q in self._peers:
                    _memmove(outs[q].data_ptr() + a, self.base + self.off(q, b), m)
            a += m
            if a >= nb:
                return

    def _block(self) -> int:
        return max(_ALIGN, (self.S // self.p) // _ALIGN * _ALIGN)

    def scatter(self, c: "Coll", dst: "torch.Tensor", ins: Optional[Sequence["torch.Tensor"]], src: int) -> None:
        nb = dst.numel() * dst.element_size()
        desc = self._put_desc(c, nb, src)
        r = self.r
        blk = self._block()
        if r == src and ins is not None and nb:
            _memmove(dst.data_ptr(), ins[r].data_ptr(), nb)
        a = 0
        while True:
            m = min(blk, nb - a)
            b = self._next_buffer()
            base = self.base + self.off(src, b)
            if r == src and ins is not None and m:
                for q in self._peers:
                    _memmove(base + q * blk, ins[q].data_ptr() + a, m)
            self._step(c, desc if a == 0 else None)
            if r != src and m:
                _memmove(dst.data_ptr() + a, base + r * blk, m)
            a += m
            if a >= nb:
                return

    def reduce_scatter(self, c: "Coll", out: "torch.Tensor", ins: Sequence["torch.Tensor"], op: "Reduction") -> None:
        """Rank r's ``out`` := reduction over ranks of their ``ins[r]`` (``ins`` are flat
        and contiguous; PREMUL_SUM is applied here, to copies, never to ``ins``)."""
        from tdist.plugin import prescale_

        from ..collectives.algorithms import serially

        r = self.r
        es = out.element_size()
        n = out.numel()
        nb = n * es
        desc = self._put_desc(c, nb)
        K = self.kernel(out.dtype, op)
        premul = op.op is ReduceOp.PREMUL_SUM
        avg = op.op is ReduceOp.AVG
        blk_elems = self._block() // es
        blk = blk_elems * es
        combine = self.combine
        codes = K.codes
        own: Any = None
        if premul and n:
            own = ins[r].clone()
            serially(lambda piece: prescale_(piece, op), own)
        a = 0
        while True:
            m = min(blk_elems, n - a)
            b = self._next_buffer()
            mine = self.off(r, b)
            if m:
                for d in self._peers:
                    _memmove(self.base + mine + d * blk, ins[d].data_ptr() + a * es, m * es)
                    if premul:
                        t = self.t8()[mine + d * blk : mine + d * blk + m * es].view(out.dtype)
                        serially(lambda piece: prescale_(piece, op), t)
            self._step(c, desc if a == 0 else None)
            if m:  # own contribution first: ``out`` may be a view of it (in-place reduce_scatter)
                src_own = own if own is not None else ins[r]
                if codes is not None:  # in the C part, through the part of my buffer nobody reads
                    peers = [self.base + self.off(q, b) + r * blk for q in self._peers]
                    at = a * es
                    combine(*codes, m, self.base + mine + r * blk, out.data_ptr() + at, src_own.data_ptr() + at, *peers)
                else:
                    parts = [K.ten(src_own, a, a + m)] + [K.shm(self.off(q, b) + r * blk, m) for q in self._peers]
                    K.reduce(K.ten(out, a, a + m), parts)
            a += m
            if a >= n:
                break
        if avg and n and codes is None:  # the C part has divided already
            self._finalize(out, op)

    def all_to_all(self, c: "Coll", outs: Sequence["torch.Tensor"], ins: Sequence["torch.Tensor"]) -> None:
        """``outs[q]`` of rank r := rank q's ``ins[r]``. Sizes may differ per pair: every rank
        publishes what it sends to and expects from each rank, and every rank checks the
        whole matrix (so all of them raise on a disagreement, not just its victims)."""
        r, p = self.r, self.p
        in_nb = [t.numel() * t.element_size() for t in ins]
        out_nb = [t.numel() * t.element_size() for t in outs]
        desc = self._put_desc(c, 0)  # sizes differ per pair: checked from the tables below
        blk = self._block()
        table = struct.Struct(f"<{2 * p}Q")
        head = (table.size + _ALIGN - 1) // _ALIGN * _ALIGN
        first_blk = max(0, (self.S - head) // p // _ALIGN * _ALIGN)
        b = self._next_buffer()
        mine = self.off(r, b)
        table.pack_into(self.mm, mine, *in_nb, *out_nb)
        for d in self._peers:
            m = min(first_blk, in_nb[d])
            if m:
                _memmove(self.base + mine + head + d * first_blk, ins[d].data_ptr(), m)
        self._step(c, desc)
        tables = [table.unpack_from(self.mm, self.off(q, b)) for q in range(p)]
        for q in range(p):  # q sends tables[q][d] bytes to d, which expects tables[d][p + q]
            for d in range(p):
                if tables[q][d] != tables[d][p + q]:
                    raise DistBackendError(
                        f"tcp backend: {self.tr.me} in {describe(c.op, c.redop, c.seq, c.dtype, 0)}: "
                        f"{self.tr.label(self.ranks[q])} sends {tables[q][d]} bytes to "
                        f"{self.tr.label(self.ranks[d])}, which expects "
                        f"{tables[d][p + q]} (the ranks called all_to_all with different split sizes)"
                    )
        longest = max(max(t[:p]) for t in tables)
        if out_nb[r]:
            _memmove(outs[r].data_ptr(), ins[r].data_ptr(), out_nb[r])
        for q in self._peers:
            m = min(first_blk, out_nb[q])
            if m:
                _memmove(outs[q].data_ptr(), self.base + self.off(q, b) + head + r * first_blk, m)
        a = first_blk
        while a < longest:
            b = self._next_buffer()
            mine = self.off(r, b)
            for d in self._peers:
                m = min(blk, in_nb[d] - a)
                if m > 0:
                    _memmove(self.base + mine + d * blk, ins[d].data_ptr() + a, m)
            self._step(c)
            for q in self._peers:
                m = min(blk, out_nb[q] - a)
                if m > 0:
                    _memmove(outs[q].data_ptr() + a, self.base + self.off(q, b) + r * blk, m)
            a += blk
