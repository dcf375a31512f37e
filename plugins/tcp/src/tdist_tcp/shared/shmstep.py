"""The step protocol of a group's shared segment: control blocks, counters, descriptors,
buffers, posting a step and waiting for the peers to post it.

The segment (:mod:`tdist_tcp.shared.segment` maps it; :func:`layout` places its parts) holds,
per rank, a control block of :data:`CTRL` bytes (a step counter, a "sleeping" flag, its
pid, the descriptors of its current collectives; from byte 128 :mod:`tdist_tcp.shared.cma`'s
words) and two data buffers of ``slot``
bytes. A collective is a sequence of *steps*: a rank writes into its own buffer, bumps
its counter, waits until every peer's counter has reached the same value, then reads
what it needs from its peers' buffers. Consecutive rounds alternate between the two
buffers, so a rank never overwrites data a peer may still be reading (a peer that has
posted step k has finished reading round k - 1). A waiter spins or sleeps in
``futex(2)`` on the peer's counter as :mod:`tdist_tcp.shared.shmwait` decides; a poster wakes
sleepers only when one has raised its flag.

Every collective's first step publishes its descriptor (sequence number, operation,
reduce op, dtype, size, root) and every rank compares its peers' with its own
(:meth:`ShmSteps._check`); a dead peer is seen by its socket (its reader thread breaks
the transport, which wakes the waiters here); a peer that destroyed its group, the
group timeout and a broken group raise as on the socket path.

A group made by ``shrink_group`` keeps its predecessor's segment (:meth:`ShmSteps.successor`):
member q keeps the control block and buffers of its *slot* (its place in the segment, the
rank it had there), the lost ranks' slots are never read again, and :meth:`ShmSteps.fence`
starts the new epoch: each member, once nothing of the old group runs on it any more,
publishes its last counter and the epoch in its control block and waits until every
member has; then each sets its counter to the same base, half the counter space beyond
the old counters (so a rank still waiting in an old step, one excluded while alive, never
takes a new step for its own), says so and waits until every member has (so no member
takes another's old counter for a new step).

The memory ordering relied upon (a counter's store seen after the data stores before
it) is x86's, hence the x86-64 restriction. The C part (:mod:`tdist_tcp.shared.native`,
:attr:`ShmSteps.fast`) follows this protocol exactly and shares the counters.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np
from tdist.plugin import DistBackendError, flag

from . import native, segment, shmwait
from .futex import futex_wait, futex_wake
from .kernels import Kernel
from ..protocol.wire import describe

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

    from ..collectives.algorithms import Coll
    from ..net.transport import Transport

__all__ = ["ShmSteps", "layout", "set_pid", "CTRL", "DESC", "DESC_AT", "DESC_STRIDE", "ALIGN"]

CTRL = 256  # control bytes per rank
_CTR, _FLAG, _PID = 0, 1, 2  # uint32 words of a control block
#: (words 4-15: the descriptors) a fence's: the counter before it, its epoch, and the epoch once counting from its base
_LAST, _EPOCH, _BASED = 16, 17, 18
DESC = struct.Struct("<QQIBBBx")  # seq, nbytes, root, op, redop, dtype
DESC_AT = 16  # two descriptors (by collective parity) from here: in the counter's cache line
DESC_STRIDE = DESC.size
ALIGN = 64
_MASK = 0xFFFFFFFF
_HALF = 0x80000000


def layout(size: int, slot: int) -> tuple[int, int, int]:
    """(control offset, data offset, total bytes) of a segment for ``size`` ranks."""
    return segment.layout(size, slot, CTRL)


def set_pid(mm: mmap.mmap, size: int, slot: int, rank: int) -> None:
    """Publish this rank's pid (ranks that are threads of one process never spin)."""
    struct.pack_into("<I", mm, layout(size, slot)[0] + rank * CTRL + 4 * _PID, os.getpid() & _MASK)


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` (of this pid namespace) has exited (a zombie too)."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[:1]
    except OSError:
        return True
    return state in (["Z"], ["X"])


class _Counters:
    """The engine's step and round counters, without the C part."""

    __slots__ = ("k", "rounds")

    def __init__(self) -> None:
        self.k = 0
        self.rounds = 0


class ShmSteps:
    """One rank's view of a group's segment and the step protocol over it (one collective
    at a time); :class:`tdist_tcp.shared.shm.ShmEngine` runs the collectives on it."""

    def __init__(
        self,
        mm: mmap.mmap,
        rank: int,
        size: int,
        slot: int,
        transport: "Transport",
        options: Mapping[str, Any],
        ranks: Optional[Sequence[int]] = None,
        slots: Optional[Sequence[int]] = None,
        places: Optional[int] = None,
    ) -> None:
        """``slots``: each member's place in a segment made for ``places`` ranks (a group
        made by ``shrink_group``); None: member q is at place q of ``size``."""
        self.mm = mm
        self.r, self.p = rank, size
        #: the group rank of each member (``rank``, ``size`` and the peers here count members);
        #: ``ranks`` None: the whole group
        self.ranks = list(ranks) if ranks is not None else list(range(size))
        #: each member's place in the segment (the control block and buffers it uses)
        self.slots = list(slots) if slots is not None else list(range(size))
        self.places = places if places is not None else size
        self.S = slot
        self.tr = transport
        ctrl, data, _total = layout(self.places, slot)
        self._ctrl_off, self._data_off = ctrl, data
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        self.u8 = np.frombuffer(mm, dtype=np.uint8)
        self._t8: Any = None
        words = CTRL // 4
        at = [place * words for place in self.slots]  # each member's first control word
        self.ctl = (ctypes.c_uint32 * (self.places * words)).from_buffer(mm, ctrl)
        self._me_ctr = at[rank] + _CTR
        self._me_flag = at[rank] + _FLAG
        self._my_addr = self.base + ctrl + self.slots[rank] * CTRL
        self._peers = [q for q in range(size) if q != rank]
        self._peer_ctr = [(q, at[q] + _CTR, self.base + ctrl + self.slots[q] * CTRL) for q in self._peers]
        self._peer_flags = [at[q] + _FLAG for q in self._peers]
        mine = ctrl + self.slots[rank] * CTRL + DESC_AT
        self._my_desc = [mine, mine + DESC_STRIDE]
        # A rank may post a collective's descriptor while a slower peer still checks the
        # previous one, never the one before (that peer has stepped since): two slots, by
        # collective parity. Every collective of the group steps here when the segment is the
        # whole group's (the C part relies on seq & 1 then); a host's segment of a hierarchical
        # group sees only some collectives, so it counts its own.
        self._whole_group = ranks is None
        self._last_seq, self._parity = -1, 0
        self._kernels: dict = {}
        self._last_kernel: tuple = (None, None, None)
        self._views: dict = {}
        self._arrays: dict = {}
        #: how this rank waits for its peers (see tdist_tcp.shared.shmwait)
        self.policy = self._wait_policy(options.get("shm_spin_us"))
        self._runq = shmwait.run_queue()
        self._yield = flag("TDIST_TCP_SHM_YIELD", True)  # sched_yield now and then while spinning
        self.closed = False
        #: the C part (see tdist_tcp.shared.native): ``fast.run`` runs a one-step collective in one call
        #: (then :meth:`settle` unless it returned DONE); None: everything in Python
        self.fast: Any = None
        ext = native.native_module(options)
        if ext is not None:
            pol = self.policy
            args = (self.base, ctrl, data, slot, rank, size, int(pol.spin * 1e9), self._yield, pol.adaptive)
            try:
                self.fast = ext.Fast(*args, slots=None if slots is None else self.slots)
            except TypeError:  # a C part built before slots existed: the Python steps, for a shrunken group
                self.fast = ext.Fast(*args) if slots is None else None
        #: the C part's ``combine(etype, eop, n, out, also, *ins)``, a reduction in one pass over
        #: its inputs (see :attr:`Kernel.codes`); None: numpy's ufuncs
        self.combine: Any = getattr(ext, "combine", None)
        #: ``k``: steps posted, ``rounds``: rounds begun (buffer parity); the C part's own when
        #: there is one, since its collectives advance them too
        self.n: Any = self.fast if self.fast is not None else _Counters()
        transport.add_break_callback(self.wake)

    # ---------------------------------------------------------------- helpers
    def t8(self) -> Any:
        if self._t8 is None:
            import torch

            self._t8 = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self._t8

    def kernel(self, dtype: "torch.dtype", op: "Reduction") -> Kernel:
        last_dtype, last_member, k = self._last_kernel
        member = op.op
        if dtype is not last_dtype or member is not last_member:
            key = (dtype, id(member))  # enum members are singletons (and slow to hash)
            k = self._kernels.get(key)
            if k is None:
                k = self._kernels[key] = Kernel(self, dtype, op)
            self._last_kernel = (dtype, member, k)
        k.op = op  # the torch fallback's combine_ needs the call's own Reduction
        return k

    def views(self, b: int, nbytes: int, npdt: Any) -> list:
        """numpy views of the first ``nbytes`` of every rank's buffer ``b`` (cached)."""
        key = (b, nbytes, npdt)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 256:
                self._views.clear()
            v = self._views[key] = [self.u8[o : o + nbytes].view(npdt) for o in (self.off(q, b) for q in range(self.p))]
        return v

    def _array(self, flat: "torch.Tensor") -> Any:
        """``flat.numpy()`` for a small tensor, remembered by (address, elements, dtype):
        building the view costs more than a small collective's reduction. A remembered
        view is used only for a tensor at the same address with the same elements and
        dtype, so it always addresses that tensor's memory."""
        key = (flat.data_ptr(), flat.numel(), flat.dtype)
        arr = self._arrays.get(key)
        if arr is None:
            if len(self._arrays) >= 16:
                self._arrays.clear()
            arr = self._arrays[key] = flat.numpy()
        return arr

    def off(self, q: int, b: int) -> int:
        return self._data_off + (2 * self.slots[q] + b) * self.S

    def _next_buffer(self) -> int:
        n = self.n
        b = n.rounds & 1
        n.rounds += 1
        return b

    def _wait_policy(self, spin_us: Any) -> shmwait.WaitPolicy:
        """The waiting policy of this segment: its members' pids are all published by now
        (every member set its own before answering ``ok``)."""
        every = self.member_pids()
        pids = [every[q] for q in self._peers]
        me = os.getpid() & _MASK
        return shmwait.decide(
            self.p,
            shmwait.usable_cpus([pid for pid in pids if pid and pid != me]),
            None if spin_us is None else float(spin_us),
            same_process=any(pid == me for pid in pids),
        )

    def member_pids(self) -> list[int]:
        """Each member's pid as it published it (every member did before the segment was
        accepted)."""
        words = CTRL // 4
        return [int(self.ctl[place * words + _PID]) for place in self.slots]

    def wake(self) -> None:
        """Wake every waiter of this segment (the transport broke or a peer left)."""
        if self.mm.closed or self.closed:
            return
        for _q, _i, addr in self._peer_ctr:
            futex_wake(addr)
        futex_wake(self._my_addr)

    def close(self, unmap: bool = True) -> None:
        """Unmap the segment and close its descriptor (``unmap`` False: only let go of it,
        handed to a successor). The caller makes sure no collective runs on it (the backend
        waits for the one in progress, woken by the broken transport); a view of it still
        referenced elsewhere leaves it to the garbage collector. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.wake()
        self.fast = None  # it addresses the mapping
        self._views, self._arrays, self._kernels, self._last_kernel = {}, {}, {}, (None, None, None)
        self._t8 = self.u8 = self.ctl = None  # type: ignore[assignment]  # closed: nothing mapped any more
        self._peer_ctr, self._peer_flags = [], []
        if not unmap:
            return
        try:
            self.mm.close()
        except BufferError:
            pass

    # ------------------------------------------------------------------ fencing
    def fence(self, epoch: int, deadline: float) -> None:
        """Start ``epoch`` (``shrink_group``; see the module) on a new view of a segment:
        publish this member's last counter and the epoch, wait until every member has
        (nothing of the old group then runs on the segment on any of them: each publishes
        only once its own old collective is over), and count on from the common base. A
        member that does not come before ``deadline``, or whose process is gone, raises."""
        ctl, words, epoch = self.ctl, CTRL // 4, epoch & _MASK
        mine = self.slots[self.r] * words
        ctl[mine + _LAST] = ctl[mine + _CTR]
        ctl[mine + _EPOCH] = epoch  # (after _LAST: x86 keeps the stores' order)
        self._await_all(_EPOCH, epoch, deadline)
        lasts = [int(ctl[self.slots[q] * words + _LAST]) for q in range(self.p)]
        top = lasts[0] + max(((v - lasts[0] + _HALF) & _MASK) - _HALF for v in lasts)  # (counters wrap)
        base = (top + 2 + _HALF) & _MASK  # beyond every old step a rank may still wait for (<= top + 1)
        ctl[mine + _CTR] = base
        ctl[mine + _BASED] = epoch
        self._await_all(_BASED, epoch, deadline)
        self.n.k, self.n.rounds = base, 0

    def _await_all(self, word: int, value: int, deadline: float) -> None:
        """Wait until control word ``word`` of every member holds ``value`` (see :meth:`fence`)."""
        ctl, words = self.ctl, CTRL // 4
        pause = 0.0002
        while True:
            missing = [q for q in self._peers if ctl[self.slots[q] * words + word] != value]
            if not missing:
                return
            gone = [q for q in missing if _process_gone(int(ctl[self.slots[q] * words + _PID]))]
            if gone or time.monotonic() >= deadline:
                names = ", ".join(self.tr.label(self.ranks[q]) for q in (gone or missing))
                why = "exited" if gone else "did not come within the group's timeout"
                raise DistBackendError(
                    f"tcp backend: {self.tr.me} cannot start the shrunken group's shared memory: {names} {why}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    # ----------------------------------------------------------------- stepping
    def _slot(self, seq: int) -> int:
        """The descriptor slot of collective ``seq`` (see ``_whole_group``)."""
        if self._whole_group:
            return seq & 1
        if seq != self._last_seq:
            self._last_seq, self._parity = seq, self._parity ^ 1
        return self._parity

    def _put_desc(self, c: "Coll", nbytes: int, root: int = 0) -> tuple:
        desc = (c.seq, nbytes, root, c.op, c.redop, c.dtype)
        at = self._my_desc[self._slot(c.seq)]
        # one copy (not pack_into, which zeroes the bytes first): a collective's later phases
        # post the same descriptor again while a peer may still be checking the first
        self.mm[at : at + DESC_STRIDE] = DESC.pack(*desc)
        return desc

    def _step(self, c: "Coll", desc: Optional[tuple] = None) -> None:
        """Post the next step, wait for every peer to post it, check descriptors on a first step."""
        ctl = self.ctl
        n = self.n
        k = n.k = (n.k + 1) & _MASK
        ctl[self._me_ctr] = k
        for fi in self._peer_flags:
            if ctl[fi]:
                futex_wake(self._my_addr)
                break
        for q, ci, addr in self._peer_ctr:
            if (ctl[ci] - k) & _MASK >= _HALF:
                self._wait(c, q, ci, addr, k)
        if desc is not None:
            self._check(c, desc)

    def _wait(self, c: "Coll", q: int, ci: int, addr: int, k: int, spin: bool = True) -> None:
        """Wait until peer ``q``'s counter (word ``ci``, at ``addr``) reaches ``k``: spin as the
        policy allows (``spin`` False: the C part has spun already), then sleep in futex."""
        ctl = self.ctl
        pol = self.policy
        if pol.spin and spin:
            if self._spin(ci, k, pol):
                return
        elif pol.yield_first:  # a runnable peer may be waiting for this CPU: let it post first
            os.sched_yield()
            if (ctl[ci] - k) & _MASK < _HALF:
                return
        ctl[self._me_flag] = 1
        try:
            pause = 0.0005
            while True:
                v = ctl[ci]
                if (v - k) & _MASK < _HALF:
                    return
                self._check_alive(c, q, k)
                left = c.deadline - time.monotonic()
                futex_wait(addr, v, min(pause, max(left, 0.0)))
                pause = min(pause * 2, 0.05)
        finally:
            ctl[self._me_flag] = 0

    def _spin(self, ci: int, k: int, pol: shmwait.WaitPolicy) -> bool:
        """Spin until word ``ci`` reaches ``k`` (True) or the policy says sleep (False): at most
        ``pol.spin`` seconds, and (``pol.adaptive``) only while a CPU is free."""
        ctl = self.ctl
        clock = time.perf_counter
        start = clock()
        end = start + pol.spin
        check = start if pol.adaptive else end  # the first check after the first 32 reads
        every = shmwait.CHECK_US * 1e-6
        n = 0
        while True:
            if (ctl[ci] - k) & _MASK < _HALF:
                return True
            n += 1
            if not n & 31:
                t = clock()
                if t > end:
                    return False
                if t >= check:
                    if self._runq.busy():
                        return False
                    check = t + every
                if self._yield:
                    os.sched_yield()

    def _check_alive(self, c: "Coll", q: int, k: int) -> None:
        tr = self.tr
        if tr.broken is not None:
            raise tr.broken
        peer = tr.peers[self.ranks[q]]
        if peer is not None and peer.closed is not None:
            raise tr.peer_error(peer)
        if self.closed:
            raise DistBackendError(f"tcp backend: {tr.me}'s process group was destroyed")
        if time.monotonic() >= c.deadline:
            raise tr.collective_timeout(c, self.ranks[q], via=" (shared memory)")

    def _check(self, c: "Coll", desc: tuple) -> None:
        parity = self._slot(c.seq) * DESC_STRIDE
        for q in self._peers:
            theirs = DESC.unpack_from(self.mm, self._ctrl_off + self.slots[q] * CTRL + DESC_AT + parity)
            if theirs == desc:
                continue
            seq, nbytes, root, op, redop, dtype = theirs
            what = describe(c.op, c.redop, c.seq, c.dtype, desc[1])
            got = describe(op, redop, seq, dtype, nbytes)
            if root != desc[2]:
                what += f" (root {desc[2]})"
                got += f" (root {root})"
            raise DistBackendError(
                f"tcp backend: {self.tr.me} expected {what} from {self.tr.label(self.ranks[q])} but got {got} (the ranks "
                "called different collectives, or with different sizes, dtypes, roots or reduce ops)"
            )

    # ------------------------------------------- one-step collectives in one C call
    def settle(self, outcome: int, c: "Coll") -> None:
        """Finish a quick collective that returned WAIT (wait for the peers as :meth:`_step`
        does, then complete it) or MISMATCH (raise, naming the peer that differs)."""
        fast = self.fast
        try:
            if outcome == native.WAIT:
                k = self.n.k
                for q, ci, addr in self._peer_ctr:
                    if (self.ctl[ci] - k) & _MASK >= _HALF:
                        self._wait(c, q, ci, addr, k, spin=False)  # the C call has spun
                outcome = fast.finish()
            if outcome == native.MISMATCH:
                self._check(c, DESC.unpack_from(self.mm, self._my_desc[self._slot(c.seq)]))
        finally:
            if fast is not None:
                fast.abandon()  # nothing pending any more, whatever happened
