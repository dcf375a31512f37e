"""Large all_reduces that read and write the peers' own memory (cross-memory attach).

The segment's all_reduce (:meth:`tdist_tcp.shared.shm.ShmEngine.all_reduce`) copies what the
peers need into the segment and the result out of it, round by round of the buffer's
size. Where the kernel lets the ranks of a host read each other's memory
(``process_vm_readv``/``process_vm_writev``: the same user, no ptrace restriction or
seccomp filter in the way), a large all_reduce instead takes two steps whatever its size:
every rank publishes its tensor's address and posts a step; then each reduces its own
slice, tile by tile, from its peers' tensors (read into cache-sized tiles) and its own,
and writes the result into its own tensor and straight into every peer's (the C part's
``cma_combine``, without the GIL); a second step says that every slice is everywhere.
Slice q of every tensor is read and written by member q alone, so nothing races. It moves
about 2 times the tensor's bytes per rank through memory instead of about 4.5, and takes
2 steps instead of 2 per buffer-sized round.

Whether the group may use it is agreed once, the same on every member, without a step of
its own: each member publishes in its control block a random nonce and its address of the
segment when its engine is made; at the end of the first large all_reduce (done the usual
way: every peer's engine is made by then) each member reads every peer's nonce through
the peer's pid and its published address (:func:`cma_probe`: the right process, and
permitted) and publishes its verdict; at the first step of the second one, every verdict
is in, and every member reads the same verdicts: all yes, or the segment's way for good.
A member without the C part, or with ``cma`` off (``$TDIST_TCP_CMA=0``), says no.

The control block's bytes 128-156 (:data:`tdist_tcp.shared.shmstep.CTRL` per member) hold
these words: the nonce, the segment's address, the tensor's address, the verdict. The
engine posts the steps; this module publishes, agrees and moves the data.
"""

from __future__ import annotations

import os
import struct
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from tdist.plugin import flag

from . import native

if TYPE_CHECKING:
    import torch

    from .kernels import Kernel
    from .shmstep import ShmSteps

__all__ = ["CrossMemory", "CMA_ENV", "MIN_BYTES"]

CMA_ENV = "TDIST_TCP_CMA"
#: all_reduces at least this large (and beyond the one-step size) go this way
MIN_BYTES = 1 << 20
_NONCE, _BASE, _ADDR, _VERDICT = 128, 136, 144, 152  # byte offsets in a member's control block
_U64, _U32 = struct.Struct("<Q"), struct.Struct("<I")
_UNKNOWN, _NO, _YES = 0, 1, 2
_NEW, _PROBED, _ON, _OFF = "new", "probed", "on", "off"


class CrossMemory:
    """One member's part in its segment's cross-memory all_reduces (see the module). The
    engine's all_reduce, for a :meth:`wants` one: :meth:`publish`, a step with the
    descriptor, :meth:`agreed` (else the segment's way, the descriptor checked), :meth:`reduce`,
    a step; after a first one that went the segment's way, :meth:`probe`."""

    def __init__(self, eng: "ShmSteps", blocks: Sequence[int], options: Mapping[str, Any]) -> None:
        """``blocks``: each member's control block (its offset in the segment)."""
        ext = native.native_module(options)
        self.eng = eng
        self._ext: Any = ext if flag(CMA_ENV, True, options.get("cma")) and hasattr(ext, "cma_combine") else None
        self._blocks = list(blocks)
        self._mine = self._blocks[eng.r]
        self.state = _NEW
        self._pids: list[int] = []
        mm = eng.mm
        _U32.pack_into(mm, self._mine + _VERDICT, _UNKNOWN)
        _U64.pack_into(mm, self._mine + _NONCE, int.from_bytes(os.urandom(8), "little"))
        _U64.pack_into(mm, self._mine + _BASE, eng.base)

    def wants(self, nbytes: int, kernel: "Kernel") -> bool:
        """Whether an all_reduce of ``nbytes`` (above the one-step size) is this module's to
        try: the same answer on every member (nothing local decides it)."""
        return self.state != _OFF and nbytes >= MIN_BYTES and kernel.c_codes is not None

    @property
    def probed(self) -> bool:
        """Whether this member has said its verdict: from then on a wanted all_reduce starts
        with :meth:`publish` and its step (the same on every member)."""
        return self.state != _NEW

    def publish(self, flat: "torch.Tensor") -> None:
        """Say where this member's tensor is (before the step that starts the all_reduce)."""
        _U64.pack_into(self.eng.mm, self._mine + _ADDR, flat.data_ptr())

    def agreed(self) -> bool:
        """Whether the group goes this way (after that step; the first time, every member's
        verdict is read: the same on every member)."""
        if self.state == _PROBED:
            mm = self.eng.mm
            yes = all(_U32.unpack_from(mm, at + _VERDICT)[0] == _YES for at in self._blocks)
            self.state = _ON if yes else _OFF
        return self.state == _ON

    def reduce(self, flat: "torch.Tensor", kernel: "Kernel") -> None:
        """Reduce this member's slice from every member's ``flat`` and write it into all of
        them; raises, naming the peer, when one cannot be reached."""
        eng = self.eng
        p, r, n, es = eng.p, eng.r, flat.numel(), flat.element_size()
        lo, hi = n * r // p, n * (r + 1) // p
        addrs = [_U64.unpack_from(eng.mm, at + _ADDR)[0] + lo * es for at in self._blocks]
        etype, eop = kernel.c_codes  # type: ignore[misc]
        failed = self._ext.cma_combine(etype, eop, hi - lo, r, flat.data_ptr() + lo * es, *self._pids, *addrs)
        if failed is not None:  # (the peer's process is gone, or no longer lets this one in)
            q, errno = failed
            tr = eng.tr
            raise tr.gone_error(
                f"tcp backend: {tr.me} could not reach {tr.label(eng.ranks[q])}'s memory during an all_reduce "
                f"({os.strerror(errno)}); that rank probably died",
                tr.peers[eng.ranks[q]],
            )

    def probe(self) -> None:
        """After the first large all_reduce (every peer's engine is made by then): say
        whether this member can read every peer's memory (see the module)."""
        if self.state != _NEW:
            return
        mm = self.eng.mm
        self._pids = self.eng.member_pids()
        ok = self._ext is not None and all(
            self._ext.cma_probe(
                self._pids[q], _U64.unpack_from(mm, at + _BASE)[0] + at + _NONCE, self.eng.base + at + _NONCE, 8
            )
            == 0
            for q, at in enumerate(self._blocks)
            if q != self.eng.r
        )
        _U32.pack_into(mm, self._mine + _VERDICT, _YES if ok else _NO)
        self.state = _PROBED
