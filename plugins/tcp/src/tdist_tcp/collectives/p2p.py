"""Point-to-point operations of :class:`~tdist_tcp.backend.TcpBackend`: ``send`` and ``recv``.

A send is one P2P frame (header, then the tensor's bytes as they are) on the peer's link 0:
a small one goes out in the calling thread when the send lane is idle (``isend`` returns
at once either way), a large one from the send lane's worker, so a send never waits
behind a collective. A receive is posted to the transport and completed by the I/O loop,
straight into the tensor (``src`` None: from whichever rank's matching frame comes
first); it needs no thread. Frames between a pair of ranks stay in order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from tdist.plugin import DistBackendError, DistBackendTimeoutError, Work

from .lanes import Lane, TcpWork
from .tensors import output as _output
from .tensors import source as _source
from ..net.transport import PostedRecv, Transport
from ..protocol.wire import OP_CODES, P2P, byte_view, dtype_code, pack_header

if TYPE_CHECKING:
    import torch

__all__ = ["PointToPoint"]

_INLINE_SEND = 64 << 10  # sends up to this size go out in the calling thread when nothing is queued


class PointToPoint:
    """``send`` and ``recv`` (a part of :class:`~tdist_tcp.backend.TcpBackend`)."""

    rank: int
    size: int
    _tr: Transport
    _send_lane: Lane
    _p2p_seq: list[int]
    _work_timeout: float
    _timeout_s: float

    def send(self, tensor: "torch.Tensor", dst: int, tag: int) -> Work:
        tr = self._tr
        work = TcpWork(f"tcp send from {tr.me} to {tr.label(dst)} (tag {tag})", self._work_timeout)
        if dst == self.rank or not 0 <= dst < self.size:
            work.set_exception(ValueError(f"tcp backend: send to rank {dst} from rank {self.rank}"))
            return work
        if tr.broken is not None:
            work.set_exception(tr.broken)
            return work
        src = _source(tensor)
        view = byte_view(src)
        self._p2p_seq[dst] += 1
        header = pack_header(
            P2P, OP_CODES["send"], 0, dtype_code(src.dtype), tag, self._p2p_seq[dst], len(view), tuple(tensor.shape)
        )

        def job() -> list:
            tr.send(dst, header, view)
            return [tensor]

        # a small frame fits the socket buffer: send it now (isend returns at once either
        # way); a large one goes to the send lane's worker, started at once
        if len(view) > _INLINE_SEND or not self._send_lane.try_inline(job, work):
            self._send_lane.submit(job, work, eager=True)
        return work

    def recv(self, tensor: "torch.Tensor", src: Optional[int], tag: int) -> Work:
        tr = self._tr
        where = "any rank" if src is None else tr.label(src)
        work = TcpWork(f"tcp recv on {tr.me} from {where} (tag {tag})", self._timeout_s)
        if src is not None and (src == self.rank or not 0 <= src < self.size):
            work.set_exception(ValueError(f"tcp backend: recv from rank {src} on rank {self.rank}"))
            return work
        flat, back = _output(tensor)

        def done(pr: PostedRecv) -> None:
            if pr.error is not None:
                work.set_exception(pr.error)
                return
            if back is not None:
                back.copy_(flat.view(back.shape))
            work.set_result([tensor], pr.source)

        try:
            pr = tr.post_p2p(src, tag, dtype_code(flat.dtype), byte_view(flat), done)
        except DistBackendError as exc:
            work.set_exception(exc)
            return work
        timeout = self._timeout_s

        def on_timeout(w: TcpWork) -> bool:
            if not tr.cancel_p2p(pr):
                return False
            w.set_exception(
                DistBackendTimeoutError(
                    f"tcp backend: {tr.me} timed out in recv from {where} (tag {tag}): nothing arrived "
                    f"(group timeout {timeout:g} s)"
                )
            )
            return True

        work._on_timeout = on_timeout
        return work
