"""``BrokenBackend``: the tcp backend behind a wrapper that breaks what ``TDIST_BROKEN`` names.

Every operation is issued on the wrapped tcp backend; the caller gets a :class:`_Outer`
Work that adopts the tcp Work's outcome, bent by the violation (see
:data:`tdist_broken.VIOLATIONS`). With no violation the wrapper is faithful: the kit
passes, so each failure the kit reports under a violation is that violation's.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
from tdist.plugin import Backend, DistBackendError, DistBackendTimeoutError, Reduction, Work
from tdist_tcp.plugin import create_tcp_backend

from . import violation

_REDUCTIONS = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")
#: Seconds a lazy send waits before it reads the caller's buffer.
LAZY_SEND = 1.0


class _Outer(Work):
    """The Work the caller sees: completes with ``finish(inner)`` once the tcp Work is done
    (``finish`` returns False to leave it pending). ``early``: ``is_completed()`` is True
    at once; ``in_wait``: it completes only inside ``wait()``."""

    def __init__(self, op: str, inner: Work, finish: Callable[["_Outer", Work], bool], mode: str) -> None:
        super().__init__(op)
        self._inner, self._finish_with = inner, finish
        self._early = mode == "early_is_completed"
        self._in_wait = mode == "completes_only_in_wait"
        self._lock = threading.Lock()
        self._adopted = False
        if not self._in_wait:
            inner.add_done_callback(self._adopt)

    def _adopt(self, inner: Work) -> None:
        with self._lock:
            if self._adopted:
                return
            try:
                self._adopted = self._finish_with(self, inner)
            except Exception as exc:  # a bug in the wrapper must not hang the kit
                self.set_exception(exc)
                self._adopted = True

    def _poll(self) -> bool:
        return self._early or self._adopted

    def _block(self, timeout: Optional[float]) -> bool:
        if not self._in_wait:
            return super()._block(timeout)
        try:
            self._inner.wait(timeout)
        except Exception:
            pass  # its outcome is adopted below
        if not self._inner.is_completed():
            return False
        self._adopt(self._inner)
        return True


def _remap(exc: BaseException, mode: str, op: str) -> BaseException:
    if isinstance(exc, DistBackendTimeoutError):
        if mode == "timeout_as_runtime_error":
            return RuntimeError(f"{op} timed out")
        if mode == "timeout_names_nobody":
            return DistBackendTimeoutError(f"{op}: timed out")
    return exc


class BrokenBackend(Backend):
    """The tcp backend, broken the way ``TDIST_BROKEN`` says."""

    name = "broken"

    def __init__(self, **kwargs: Any) -> None:
        self.inner = create_tcp_backend(**kwargs)
        super().__init__(self.inner.rank, self.inner.size, self.inner.timeout)
        self.mode = violation()
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Work]] = []  # single_threaded: (thread id, Work)
        self._sends: Optional[queue.Queue] = None  # lazy_send: what the sender thread sends
        self._any_sources = 0  # any_source_by_rotation: any-source receives so far

    # ------------------------------------------------------------ the wrapper
    def _issue(
        self, op: str, issue: Callable[[], Work], tensors: Sequence[torch.Tensor] = (), src: Optional[int] = None
    ) -> Work:
        mode = self.mode
        if mode == "refuses_uint8" and op in _REDUCTIONS and any(t.dtype == torch.uint8 for t in tensors):
            raise TypeError(f"broken: {op} on uint8 is not supported")
        if mode == "single_threaded":
            self._refuse_other_threads(op)
        inner = issue()
        if mode == "single_threaded":
            with self._lock:
                self._pending.append((threading.get_ident(), inner))
        if mode == "blocks_async":
            inner.wait()
        return _Outer(op, inner, lambda outer, done: self._finish(op, outer, done, tensors, src), mode)

    def _finish(self, op: str, outer: Work, inner: Work, tensors: Sequence[torch.Tensor], src: Optional[int]) -> bool:
        mode, exc = self.mode, inner.exception()
        if exc is not None:
            if mode == "pending_survive_destroy" and op == "recv":
                return False  # the group (here or at the peer) was destroyed: never completes
            if mode == "recv_accepts_anything" and op == "recv":
                outer.set_result((), 0 if src is None else src)
                return True
            outer.set_exception(_remap(exc, mode, op))
            return True
        if mode == "not_bit_identical" and op == "all_reduce" and self.rank == self.size - 1:
            for t in tensors:
                if t.is_floating_point():
                    t.mul_(1 + 2**-20)
        source = inner.source_rank() if op == "recv" and mode != "no_source_rank" else -1
        outer.set_result(inner.result(), source)
        return True

    def _refuse_other_threads(self, op: str) -> None:
        me = threading.get_ident()
        with self._lock:
            self._pending = [(who, w) for who, w in self._pending if not w.is_completed()]
            busy = sorted({who for who, _ in self._pending if who != me})
        if busy:
            raise DistBackendError(f"broken: {op} issued while thread(s) {busy} have operations pending")

    def run_blocking(self, call: Callable[[Backend], Work], timeout: Optional[float]) -> None:
        try:
            super().run_blocking(call, timeout)
        except DistBackendTimeoutError as exc:
            raise _remap(exc, self.mode, "operation") from None

    # --------------------------------------------------------- point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if self.mode == "lazy_send":
            self._send_later(tensor, dst, tag)
            return Work.completed("send")
        return self._issue("send", lambda: self.inner.send(tensor, dst, tag), (tensor,))

    def _send_later(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        with self._lock:
            if self._sends is None:
                self._sends = queue.Queue()
                threading.Thread(target=self._sender, args=(self._sends,), daemon=True).start()
        self._sends.put((tensor, dst, tag))

    def _sender(self, sends: queue.Queue) -> None:
        while True:
            tensor, dst, tag = sends.get()
            time.sleep(LAZY_SEND)
            self.inner.send(tensor, dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Work:
        if src is None and self.mode == "any_source_by_rotation":
            peers = [q for q in reversed(range(self.size)) if q != self.rank]
            src, self._any_sources = peers[self._any_sources % len(peers)], self._any_sources + 1
        return self._issue("recv", lambda: self.inner.recv(tensor, src, tag), (tensor,), src)

    # ------------------------------------------------------------ collectives
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self._issue("broadcast", lambda: self.inner.broadcast(tensor, src), (tensor,))

    def all_reduce(self, tensor: torch.Tensor, op: Reduction) -> Work:
        return self._issue("all_reduce", lambda: self.inner.all_reduce(tensor, op), (tensor,))

    def reduce(self, tensor: torch.Tensor, dst: int, op: Reduction) -> Work:
        return self._issue("reduce", lambda: self.inner.reduce(tensor, dst, op), (tensor,))

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        return self._issue("all_gather", lambda: self.inner.all_gather(outputs, tensor), (tensor,))

    def gather(self, tensor: torch.Tensor, outputs: Optional[Sequence[torch.Tensor]], dst: int) -> Work:
        return self._issue("gather", lambda: self.inner.gather(tensor, outputs, dst), (tensor,))

    def scatter(self, tensor: torch.Tensor, inputs: Optional[Sequence[torch.Tensor]], src: int) -> Work:
        return self._issue("scatter", lambda: self.inner.scatter(tensor, inputs, src), (tensor,))

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: Reduction) -> Work:
        return self._issue("reduce_scatter", lambda: self.inner.reduce_scatter(output, inputs, op), (output,))

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        return self._issue("all_to_all", lambda: self.inner.all_to_all(outputs, inputs))

    def barrier(self) -> Work:
        return self._issue("barrier", self.inner.barrier)

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        return self._issue("all_gather_into_tensor", lambda: self.inner.all_gather_into_tensor(output, tensor))

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, op: Reduction) -> Work:
        issue = lambda: self.inner.reduce_scatter_tensor(output, tensor, op)  # noqa: E731
        return self._issue("reduce_scatter_tensor", issue, (output,))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        issue = lambda: self.inner.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes)  # noqa: E731
        return self._issue("all_to_all_single", issue)

    def shutdown(self) -> None:
        self.inner.shutdown()
