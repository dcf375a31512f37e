"""``TcpBackend``: every tdist operation on CPU tensors over the tcp transport.

Collectives are queued on one FIFO lane per group and normally run in the thread
that waits for them (see :mod:`tdist_tcp.collectives.lanes`); a caller that waits for a small
collective over shared memory skips the lane's queue and runs it with one call into
the C part (:meth:`TcpBackend._quick`); sends have their own lane and receives need no
thread of their own (the process's I/O loop completes them), so point-to-point traffic
(:mod:`tdist_tcp.collectives.p2p`) never queues behind collectives. :mod:`tdist_tcp.factory` builds
the backend; ``shrink_group`` makes a group's successor from it (:mod:`tdist_tcp.regroup`).

Options (``pg_options`` of ``init_process_group`` or ``new_group``; the same on every
rank): ``host`` (address to listen on and publish; else ``$TDIST_TCP_HOST``), ``ifname``
(take the address of this interface; else ``$TDIST_TCP_IFNAME``), ``port`` (default: any
free port), ``socket_buffer`` (SO_SNDBUF/SO_RCVBUF bytes, default 4 MiB), ``streams``
(TCP connections per pair of ranks, default 1; else ``$TDIST_TCP_STREAMS``), ``connect``
(connections made at setup: ``ring``, ``lazy`` or ``all``; see :mod:`tdist_tcp.net.mesh`),
``unix`` (same-host peers over a Unix-domain socket, default True; ``$TDIST_TCP_UNIX=0``
disables), ``shm`` (collectives through shared memory when the whole group is on this
host, default True; ``$TDIST_TCP_SHM=0`` disables; :mod:`tdist_tcp.shared.shm`, whose ``shm_*``
options the plugin's README lists), ``native`` (small shared-memory collectives in one
call into the C part, default True where built; see :mod:`tdist_tcp.shared.native`) and the
tunables of :data:`DEFAULTS`. The factory's ``secret`` (from the job's token) authenticates every
connection and the shared segment (:mod:`tdist_tcp.protocol.auth`); without one, nothing is.
"""

from __future__ import annotations

import atexit
import threading
import time
from threading import get_ident
import traceback
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from tdist.plugin import (
    Backend,
    DistBackendError,
    ReduceOp,
    Work,
    check_reduction,
    seconds,
)

from .collectives import algorithms as algo
from .shared import native
from . import regroup
from .collectives.hierarchy import Hierarchy
from .collectives.lanes import Lane, TcpWork
from .collectives.p2p import PointToPoint
from .shared.shm import ShmEngine
from .collectives.tensors import concat as _concat
from .collectives.tensors import finalize as _finalize
from .collectives.tensors import inplace as _inplace
from .collectives.tensors import output as _output
from .collectives.tensors import prescale as _prescale
from .collectives.tensors import source as _source
from .shared.topology import Layout
from .net.transport import Transport
from .protocol.wire import OP_CODES, byte_view, dtype_code, redop_code

if TYPE_CHECKING:
    import torch
    from tdist.plugin import Reduction

__all__ = ["TcpBackend", "DEFAULTS"]

#: Tunables (``options`` of ``init_process_group``/``new_group`` override them).
DEFAULTS = {
    "ring_threshold": 64 << 10,  # all_reduce/broadcast above this many bytes: ring / chain
    "segment_bytes": 512 << 10,  # pipelining unit of rings, chains and trees
    "grace": 0.002,  # seconds a queued collective waits for its caller before the worker runs it
    "linger": 1.0,  # seconds shutdown waits for the peers' goodbyes
}

#: What an operation run by :meth:`TcpBackend.run_blocking` in the calling thread returns: it is done.
_RAN = Work.completed("tcp operation run in the calling thread")
_live: "weakref.WeakSet[TcpBackend]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:  # say goodbye to the peers even if the program never destroyed its groups
    for backend in list(_live):
        try:
            backend.shutdown()
        except Exception:
            pass


class TcpBackend(PointToPoint, Backend):
    """One process group's tcp backend (built by :func:`create_backend`)."""

    name = "tcp"

    def __init__(
        self,
        rank: int,
        size: int,
        timeout: timedelta,
        transport: Transport,
        options: Mapping[str, Any],
        shm: Optional[ShmEngine] = None,
        authenticated: bool = False,
        layout: Optional[Layout] = None,
        host_shm: Optional[ShmEngine] = None,
    ) -> None:
        """``shm``: the whole group's segment (all ranks on one host); ``layout`` (several
        hosts): the hierarchical collectives over it, ``host_shm`` this host's segment."""
        super().__init__(rank, size, timeout)
        self._shm = shm
        self._authenticated = authenticated
        self._options = dict(options)
        opts = {**DEFAULTS, **{k: v for k, v in options.items() if k in DEFAULTS}}
        self._tr = transport
        self._me = transport.me
        self._timeout_s = float(seconds(timeout))  # type: ignore[arg-type]
        self._work_timeout = self._timeout_s + 5.0  # the operation's own, more precise, timeout fires first
        self._ring_threshold = int(opts["ring_threshold"])
        self._segment_bytes = max(1, int(opts["segment_bytes"]))
        self._hier: Optional[Hierarchy] = None
        if layout is not None:
            self._hier = Hierarchy(layout, rank, host_shm, self._ring_threshold, self._segment_bytes)
        self._linger = float(opts["linger"])
        grace = float(opts["grace"])
        self._coll_lane = Lane(f"tdist-tcp-coll-r{rank}", grace, self._timeout_s)
        self._send_lane = Lane(f"tdist-tcp-send-r{rank}", grace, self._timeout_s)
        self._seq = 0
        self._codes: dict[Any, tuple[int, int, int, int]] = {}  # see _codes_of
        self._scratch = algo.Scratch()
        self._p2p_seq = [0] * size
        self._shut = False
        self._retired = False  # shrink_group took its connections and segment (see regroup)
        self._shut_lock = threading.Lock()
        self._in_collective = False  # a collective job runs (shutdown waits before unmapping)
        # the thread inside run_blocking, whose collectives run at once in that thread
        # (only that thread ever writes its own id here, so another never takes it for its own)
        self._blocking: Optional[int] = None
        _live.add(self)

    # --------------------------------------------------------------- helpers
    def _seg_elems(self, element_size: int) -> int:
        return max(1, self._segment_bytes // max(1, element_size))

    def _submit(
        self, name: str, dtype: Any, redop: Optional["Reduction"], body: Callable[[algo.Coll], Any], nbytes: int = 0
    ) -> Work:
        """Queue one collective on the collective lane (``nbytes``: this rank's tensor, for messages)."""
        tr = self._tr
        if tr.broken is not None:
            if self._blocking == get_ident():
                raise tr.broken
            work = TcpWork(f"tcp {name} on {self._me}", self._work_timeout)
            work.set_exception(tr.broken)
            return work
        self._seq += 1
        seq = tr.issued = self._seq
        opcode = OP_CODES[name]
        rcode, dcode, _etype, _eop = self._codes_of(redop, dtype)
        timeout = self._timeout_s
        scratch = self._scratch

        def job() -> Any:
            c = algo.Coll(tr, opcode, rcode, seq, dcode, time.monotonic() + timeout, scratch, nbytes)
            self._in_collective = True  # (then _shut: see shutdown, which sets them in the other order)
            try:
                if self._shut or self._retired:
                    raise self._gone()
                return body(c)
            except BaseException as exc:
                error = self._failed(name, exc)
                if error is exc:
                    raise
                raise error  # noqa: B904  (it sets the cause itself)
            finally:
                self._in_collective = False

        if self._blocking == get_ident() and self._coll_lane.run_now(job):
            return _RAN
        work = TcpWork(f"tcp {name} on {self._me}", self._work_timeout)
        self._coll_lane.submit(job, work)
        return work

    def _gone(self) -> DistBackendError:
        what = "shrunk (use the group shrink_group returned)" if self._retired else "destroyed"
        return DistBackendError(f"tcp backend: {self._tr.me}'s process group was {what}")

    def _codes_of(self, redop: Optional["Reduction"], dtype: Any) -> tuple[int, int, int, int]:
        """The wire codes of (reduce op, dtype), and :mod:`tdist_tcp.shared.native`'s element type and
        operator codes (0: not reduced in C), remembered per pair."""
        key = dtype if redop is None else (id(redop.op), dtype)  # (members are singletons, slow to hash)
        codes = self._codes.get(key)
        if codes is None:
            etype = native.element_type(dtype) if dtype is not None else 0
            eop = native.operator(redop, etype) if redop is not None else 0
            codes = (redop_code(redop), dtype_code(dtype) if dtype is not None else 0, etype, eop)
            if len(self._codes) < 1024:
                self._codes[key] = codes
        return codes

    def _failed(self, name: str, exc: BaseException) -> BaseException:
        """What a collective that raised ``exc`` on this rank raises; the transport fails
        (with a :class:`DistBackendError`), so that no peer waits for this rank in vain.

        An interrupt (``KeyboardInterrupt``, any non-``Exception``) stays what it is on this
        rank: it is returned unchanged, and the group breaks with an error saying this rank
        was interrupted (its collective is half done: the group cannot go on)."""
        self._forget_frames(exc)
        if isinstance(exc, DistBackendError):
            err = exc
        elif not isinstance(exc, Exception):
            err = DistBackendError(
                f"tcp backend: {name} on {self._me} was interrupted ({type(exc).__name__}); its group is broken"
            )
            err.__cause__ = exc
        else:  # a local failure mid-collective must not leave the peers waiting
            err = DistBackendError(f"tcp backend: {name} failed on {self._me}: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
        self._tr.fail(err)
        return err if isinstance(exc, Exception) else exc

    def _quick(
        self,
        name: str,
        kind: int,
        rcode: int = 0,
        dcode: int = 0,
        address: int = 0,
        nbytes: int = 0,
        root: int = 0,
        etype: int = 0,
        eop: int = 0,
    ) -> bool:
        """Run a one-step shared-memory collective in the calling thread with one call into
        the C part (``kind`` and the rest: ``ShmEngine.fast.run``'s arguments, ``rcode`` and
        ``dcode`` the wire codes): no Work, no closures, no Coll unless it must wait. Only for
        a caller inside :meth:`run_blocking` with ``self._shm.fast`` set. False, having done
        nothing, when earlier collectives are queued (FIFO order holds)."""
        tr = self._tr
        if tr.broken is not None:
            raise tr.broken
        lane = self._coll_lane
        if not lane.claim():
            return False
        try:
            self._seq += 1
            seq = tr.issued = self._seq
            opcode = OP_CODES[name]
            self._in_collective = True  # (then _shut: see shutdown, which sets them in the other order)
            if self._shut or self._retired:
                raise self._gone()
            shm: ShmEngine = self._shm  # type: ignore[assignment]
            outcome = shm.fast.run(kind, seq, opcode, rcode, dcode, address, nbytes, root, etype, eop)
            if outcome:
                deadline = time.monotonic() + self._timeout_s
                shm.settle(outcome, algo.Coll(tr, opcode, rcode, seq, dcode, deadline, self._scratch, nbytes))
        except BaseException as exc:
            error = self._failed(name, exc)
            if error is exc:
                raise
            raise error  # noqa: B904  (it sets the cause itself)
        finally:
            self._in_collective = False
            lane.release()
        return True

    def _quick_reduce(self, name: str, tensor: "torch.Tensor", op: "Reduction", root: int) -> bool:
        """all_reduce (``root`` -1) or reduce through :meth:`_quick`, when the C part can do it."""
        shm = self._shm
        if shm is None or shm.fast is None or self._blocking != get_ident():
            return False
        nbytes = tensor.nbytes
        if nbytes > shm.quick_reduce_bytes or not tensor.is_contiguous() or tensor.is_neg():
            return False
        rcode, dcode, etype, eop = self._codes_of(op, tensor.dtype)
        return bool(eop) and self._quick(name, native.REDUCE, rcode, dcode, tensor.data_ptr(), nbytes, root, etype, eop)

    def run_blocking(self, call: Callable[[Backend], Work], timeout: Optional[float]) -> None:
        """A collective for a caller that waits runs in the calling thread, with no Work
        and no lane hand-off, when the lane is idle; otherwise (earlier collectives still
        queued, or a wait shorter than the group's timeout) it takes the queued path."""
        if timeout is not None and timeout < self._timeout_s:
            super().run_blocking(call, timeout)
            return
        self._blocking = get_ident()
        try:
            work = call(self)
        finally:
            self._blocking = None
        if work is not _RAN:
            work.wait(timeout)

    def _forget_frames(self, exc: BaseException) -> None:
        """Clear the locals of a failed collective's finished frames: they may hold views of
        the shared segment, which could then not be unmapped at destroy."""
        if self.uses_shm:
            traceback.clear_frames(exc.__traceback__)

    # ------------------------------------------------------------- collectives
    def broadcast(self, tensor: "torch.Tensor", src: int) -> Work:
        shm = self._shm
        if shm is not None and shm.fast is not None and self._blocking == get_ident():
            nbytes = tensor.nbytes  # one C call if it can (see _quick); a conjugate view only if complex
            _rcode, dcode, etype, _eop = self._codes_of(None, tensor.dtype)
            if (
                nbytes <= shm.quick_bytes
                and tensor.is_contiguous()
                and not tensor.is_neg()
                and (etype or not tensor.is_conj())
                and self._quick("broadcast", native.BROADCAST, 0, dcode, tensor.data_ptr(), nbytes, src)
            ):
                return _RAN

        def body(c: algo.Coll) -> list:
            flat, back = _inplace(tensor)
            if self._shm is not None:
                self._shm.broadcast(c, flat, src)
            elif self._hier is not None:
                self._hier.broadcast(c, flat, src)
            elif self.size > 1:
                algo.broadcast(c, byte_view(flat), src, self._ring_threshold, self._segment_bytes)
            if back is not None and self.rank != src:
                back.copy_(flat.view(back.shape))
            return [tensor]

        return self._submit("broadcast", tensor.dtype, None, body, tensor.nbytes)

    def all_reduce(self, tensor: "torch.Tensor", op: "Reduction") -> Work:
        check_reduction(op, tensor.dtype, "tcp all_reduce")
        if self._quick_reduce("all_reduce", tensor, op, -1):
            return _RAN

        def body(c: algo.Coll) -> list:
            flat, back = _inplace(tensor)
            if op.op is ReduceOp.PREMUL_SUM:
                _prescale(flat, op)
            if self._shm is not None:
                self._shm.all_reduce(c, flat, op)  # finalizes AVG itself
            elif self._hier is not None:
                self._hier.all_reduce(c, flat, op)
                _finalize(flat, op, self.size)
            else:
                if self.size > 1:
                    algo.all_reduce(c, flat, op, self._ring_threshold, self._segment_bytes)
                _finalize(flat, op, self.size)
            if back is not None:
                back.copy_(flat.view(back.shape))
            return [tensor]

        return self._submit("all_reduce", tensor.dtype, op, body, tensor.nbytes)

    def reduce(self, tensor: "torch.Tensor", dst: int, op: "Reduction") -> Work:
        check_reduction(op, tensor.dtype, "tcp reduce")
        if self._quick_reduce("reduce", tensor, op, dst):
            return _RAN

        def body(c: algo.Coll) -> list:
            flat, back = _inplace(tensor)
            _prescale(flat, op)
            if self._shm is not None:
                self._shm.all_reduce(c, flat, op, root=dst)  # finalizes AVG itself
            elif self._hier is not None:
                self._hier.reduce(c, flat, dst, op)
            elif self.size > 1:
                algo.reduce_tree(c, flat, dst, op, self._seg_elems(flat.element_size()))
            if self.rank == dst:
                if self._shm is None:
                    _finalize(flat, op, self.size)
                if back is not None:
                    back.copy_(flat.view(back.shape))
            return [tensor]

        return self._submit("reduce", tensor.dtype, op, body, tensor.nbytes)

    def _gather_ring(self, c: algo.Coll, blocks: list, tensor: "torch.Tensor") -> None:
        if self._shm is not None:
            self._shm.gather_blocks(c, _source(tensor), blocks, None)
            return
        if self._hier is not None and self._hier.all_gather(c, blocks, _source(tensor)):
            return
        algo.copy_serial(blocks[self.rank], _source(tensor))
        if self.size > 1:
            algo.ring(c, blocks, self.size - 1, 0, None, self._seg_elems(tensor.element_size()))

    def all_gather(self, outputs: Sequence["torch.Tensor"], tensor: "torch.Tensor") -> Work:
        def body(c: algo.Coll) -> list:
            staged = [_output(o) for o in outputs]
            self._gather_ring(c, [flat for flat, _ in staged], tensor)
            for flat, back in staged:
                if back is not None:
                    back.copy_(flat.view(back.shape))
            return list(outputs)

        return self._submit("all_gather", tensor.dtype, None, body, tensor.nbytes)

    def all_gather_into_tensor(self, output: "torch.Tensor", tensor: "torch.Tensor") -> Work:
        def body(c: algo.Coll) -> list:
            flat, back = _output(output)
            n = tensor.numel()
            self._gather_ring(c, [flat[i * n : (i + 1) * n] for i in range(self.size)], tensor)
            if back is not None:
                back.copy_(flat.view(back.shape))
            return [output]

        return self._submit("all_gather_into_tensor", tensor.dtype, None, body, tensor.nbytes)

    def gather(self, tensor: "torch.Tensor", outputs: Optional[Sequence["torch.Tensor"]], dst: int) -> Work:
        def body(c: algo.Coll) -> list:
            src = _source(tensor)
            if self.rank != dst:
                if self._shm is not None:
                    self._shm.gather_blocks(c, src, None, dst)
                else:
                    algo.gather(c, byte_view(src), None, dst)
                return []
            staged = [_output(o) for o in outputs]  # type: ignore[union-attr]
            if self._shm is not None:
                self._shm.gather_blocks(c, src, [flat for flat, _ in staged], dst)
            else:
                algo.copy_serial(staged[dst][0], src)
            if self.size > 1 and self._shm is None:
                algo.gather(c, byte_view(src), [byte_view(flat) for flat, _ in staged], dst)
            for flat, back in staged:
                if back is not None:
                    back.copy_(flat.view(back.shape))
            return list(outputs)  # type: ignore[arg-type]

        return self._submit("gather", tensor.dtype, None, body, tensor.nbytes)

    def scatter(self, tensor: "torch.Tensor", inputs: Optional[Sequence["torch.Tensor"]], src: int) -> Work:
        def body(c: algo.Coll) -> list:
            flat, back = _output(tensor)
            if self._shm is not None:
                sources = [_source(t) for t in inputs] if self.rank == src else None  # type: ignore[union-attr]
                self._shm.scatter(c, flat, sources, src)
                if back is not None:
                    back.copy_(flat.view(back.shape))
                return [tensor]
            in_views = None
            if self.rank == src:
                sources = [_source(t) for t in inputs]  # type: ignore[union-attr]
                algo.copy_serial(flat, sources[src])
                in_views = [byte_view(s) for s in sources]
            if self.size > 1:
                algo.scatter(c, byte_view(flat), in_views, src)
            if back is not None:
                back.copy_(flat.view(back.shape))
            return [tensor]

        return self._submit("scatter", tensor.dtype, None, body, tensor.nbytes)

    def _reduce_scatter(
        self, c: algo.Coll, output: "torch.Tensor", work: "torch.Tensor", sizes: list, op: "Reduction"
    ) -> None:
        _prescale(work, op)
        chunks = list(work.split(sizes))
        algo.reduce_scatter_ring(c, chunks, op, self._seg_elems(work.element_size()))
        result = chunks[self.rank]
        _finalize(result, op, self.size)
        out, back = _output(output)
        algo.copy_serial(out, result)
        if back is not None:
            back.copy_(out.view(back.shape))

    def _local_reduce_scatter(self, c: algo.Coll, output: "torch.Tensor", inputs: list, op: "Reduction") -> bool:
        """The reduce_scatter through shared memory (one host) or the hierarchy (several);
        False (nothing done) where neither serves it."""
        if self._shm is not None:
            out, back = _output(output)
            self._shm.reduce_scatter(c, out, inputs, op)
        elif self._hier is not None and all(t.numel() == output.numel() for t in inputs):
            result = self._hier.reduce_scatter(c, output, inputs, op)
            if result is None:
                return False
            _finalize(result, op, self.size)
            out, back = _output(output)
            algo.copy_serial(out, result)
        else:
            return False
        if back is not None:
            back.copy_(out.view(back.shape))
        return True

    def reduce_scatter(self, output: "torch.Tensor", inputs: Sequence["torch.Tensor"], op: "Reduction") -> Work:
        check_reduction(op, output.dtype, "tcp reduce_scatter")

        def body(c: algo.Coll) -> list:
            if self._local_reduce_scatter(c, output, [_source(t) for t in inputs], op):
                return [output]
            work = _concat(c, [_source(t) for t in inputs])  # the inputs must stay untouched
            self._reduce_scatter(c, output, work, [t.numel() for t in inputs], op)
            return [output]

        return self._submit("reduce_scatter", output.dtype, op, body, output.nbytes)

    def reduce_scatter_tensor(self, output: "torch.Tensor", tensor: "torch.Tensor", op: "Reduction") -> Work:
        check_reduction(op, output.dtype, "tcp reduce_scatter_tensor")

        def body(c: algo.Coll) -> list:
            if self._local_reduce_scatter(c, output, list(_source(tensor).chunk(self.size)), op):
                return [output]
            work = _concat(c, [_source(tensor)])
            self._reduce_scatter(c, output, work, [output.numel()] * self.size, op)
            return [output]

        return self._submit("reduce_scatter_tensor", output.dtype, op, body, output.nbytes)

    def all_to_all(self, outputs: Sequence["torch.Tensor"], inputs: Sequence["torch.Tensor"]) -> Work:
        def body(c: algo.Coll) -> list:
            sources = [_source(t) for t in inputs]
            staged = [_output(o) for o in outputs]
            if self._shm is not None:
                self._shm.all_to_all(c, [flat for flat, _ in staged], sources)
            else:
                algo.copy_serial(staged[self.rank][0], sources[self.rank])
            if self.size > 1 and self._shm is None:
                algo.all_to_all(c, [byte_view(flat) for flat, _ in staged], [byte_view(s) for s in sources])
            for flat, back in staged:
                if back is not None:
                    back.copy_(flat.view(back.shape))
            return list(outputs)

        dtype = inputs[0].dtype if inputs else None
        return self._submit("all_to_all", dtype, None, body, sum(t.nbytes for t in inputs))

    def barrier(self) -> Work:
        shm = self._shm
        if (
            shm is not None
            and shm.fast is not None
            and self._blocking == get_ident()
            and self._quick("barrier", native.BARRIER)
        ):
            return _RAN

        def body(c: algo.Coll) -> list:
            if self._shm is not None:
                self._shm.barrier(c)
            elif self.size > 1:
                algo.barrier(c)
            return []

        return self._submit("barrier", None, None, body)

    # ---------------------------------------------------------------- closing
    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout_s = float(seconds(timeout))  # type: ignore[arg-type]
        self._work_timeout = self._timeout_s + 5.0
        self._tr.timeout = self._timeout_s
        self._coll_lane.inline_limit = self._send_lane.inline_limit = self._timeout_s

    def shutdown(self) -> None:
        """Say goodbye to the peers, close the sockets and stop every thread. Idempotent."""
        with self._shut_lock:
            if self._shut:
                return
            self._shut = True
        self._tr.close(self._linger)  # wakes a collective waiting on the segment: it fails
        engines = [e for e in (self._shm, self._hier.shm if self._hier else None) if e is not None]
        if engines:
            deadline = time.monotonic() + 5.0
            while self._in_collective and time.monotonic() < deadline:
                time.sleep(0.001)
            if not self._in_collective:  # else it is stuck in a computation: the GC unmaps later
                for engine in engines:
                    engine.close()
        self._scratch.clear()
        error = DistBackendError(f"tcp backend: {self._tr.me}'s process group was destroyed")
        self._coll_lane.close(error)
        self._send_lane.close(error)
        _live.discard(self)

    def abort(self) -> None:
        """Fail this rank's pending operations and its peers' (the transport tells every
        peer, also those never connected), then release everything as :meth:`shutdown`."""
        if not self._shut:
            regroup.forbid_reuse(self._tr)  # a later shrink_group cannot take what is released here
            self._tr.abort()
        self.shutdown()

    def shrink(
        self,
        survivors: Sequence[int],
        *,
        store: Any,
        global_ranks: Sequence[int],
        options: dict[str, Any],
        abort: bool,
    ) -> Optional[Backend]:
        """``shrink_group``: the survivors' group on this group's connections and segment
        (:func:`tdist_tcp.regroup.shrink`; it fails this group's pending operations first,
        with or without ``abort``), or None where those cannot be reused."""
        made = regroup.shrink(self, survivors, store, global_ranks, options)
        if made is None:
            return None
        return TcpBackend(
            made.rank,
            made.size,
            self.timeout,
            made.transport,
            options,
            made.engine,
            self.authenticated,
            layout=made.layout,
            host_shm=made.host_engine,
        )

    def threads(self) -> list[threading.Thread]:
        """The threads this backend started that are still alive (for leak checks)."""
        threads = self._tr.threads() + [self._coll_lane.thread(), self._send_lane.thread()]
        return [t for t in threads if t is not None and t.is_alive()]

    def __repr__(self) -> str:
        state = "shut down" if self._shut else ("broken" if self._tr.broken else "ok")
        via = " shm" if self._shm is not None else (" hierarchical" if self._hier is not None else "")
        auth = " authenticated" if self._authenticated else ""
        return f"<TcpBackend rank {self.rank}/{self.size}{via}{auth} {state}>"

    @property
    def uses_shm(self) -> bool:
        """Whether this group's collectives go through shared memory (all of them, or within
        each host of a hierarchical group)."""
        return self._shm is not None or (self._hier is not None and self._hier.shm is not None)

    @property
    def hosts(self) -> Optional[list[list[int]]]:
        """The group's ranks by host when its collectives are hierarchical, else None."""
        return [list(m) for m in self._hier.layout.hosts] if self._hier is not None else None

    @property
    def authenticated(self) -> bool:
        """Whether this group's connections (and segment) were proved with the job's secret."""
        return self._authenticated
