"""The ``store`` backend: every operation goes through the group's key-value store.

Slow (every byte goes through one store server) but short and complete. It is
meant to be read and copied; a real backend keeps the same outline and moves the
bytes some faster way.

**Collectives.** A group's ranks issue its collectives in the same order, so a
counter numbers them the same way on every rank (``seq``). For collective
``seq`` rank r writes its data under ``c/<seq>/d/<r>`` (data every rank may read)
or ``c/<seq>/d/<r>/<dst>`` (data for rank dst only), then a *header*
``c/<seq>/h/<r>``: a JSON object naming the call (operation, dtype, size, root,
operator) and the keys it wrote. The header is written last, so once every
header is there every piece of data is too. Each rank waits for all headers and
checks that they name the same call: ranks that disagree (different operations,
sizes, dtypes, roots) all raise :class:`tdist.DistBackendError` instead of
exchanging wrong data. Each rank then reads what it needs and adds 1 to
``c/<seq>/done``; the rank that brings the count to the group size deletes the
collective's keys.

**Point-to-point.** The n-th message from rank s to rank d with tag t is the key
``p/<s>/<d>/<t>/<n>`` (a JSON line describing the tensor, then its bytes). A send
writes it at once. A receive from s takes the next n of (s, t); a receive from
any source takes the first sender whose next message is there. Receives are
matched in the order they were posted; the receiver deletes the key.

**Threads.** Collectives run one at a time, in order, on a worker thread, so
``async_op=True`` returns at once. Receives are matched by a second thread. A
store may serve one request at a time per process (TCPStore does), so this
backend never blocks inside the store: it polls with ``check`` and sleeps.

**Timeouts and errors.** Every wait gives up after the group's timeout with
:class:`tdist.DistBackendTimeoutError` naming the ranks it was waiting for; any
other failure (the store's included) becomes :class:`tdist.DistBackendError`.
A dead peer is noticed only at the timeout: the store has no liveness signal
(the spec declares the ``peer_failure`` capability unsupported).
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
from tdist import Backend, DistBackendError, DistBackendTimeoutError, DistError, Reduction, Store, Work
from tdist.plugin import combine_, finalize_, prescaled

from . import BACKEND_NAME

__all__ = ["StoreBackend", "create_backend", "to_bytes", "from_bytes", "CHUNK_BYTES"]

#: Largest value written under one key; bigger payloads are split (TCPStore takes 64 MiB at most).
CHUNK_BYTES = 16 << 20
#: Polling: the first sleep and the longest one (seconds).
POLL_MIN, POLL_MAX = 0.0001, 0.004


# --------------------------------------------------------------------- tensors <-> bytes
def to_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``tensor`` (any dtype: they travel as uint8, never pickled)."""
    if tensor.numel() == 0:
        return b""
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def from_bytes(data: bytes, like: torch.Tensor, what: str) -> torch.Tensor:
    """A tensor shaped and typed like ``like`` holding ``data``; raises when the size differs."""
    expected = like.numel() * like.element_size()
    if len(data) != expected:
        raise DistBackendError(
            f"{what}: received {len(data)} bytes for a tensor of {like.numel()} x {like.dtype} "
            f"({expected} bytes): the ranks disagree on the sizes"
        )
    if not data:
        return torch.empty(like.shape, dtype=like.dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(like.dtype).view(like.shape)


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')} x{tensor.numel()}"


def _as_backend_error(exc: BaseException, what: str) -> BaseException:
    """What a failed operation raises: tdist errors from this backend as they are,
    anything else (a store failure, a torch error) as a DistBackendError."""
    if isinstance(exc, DistBackendError) or not isinstance(exc, Exception):
        return exc
    error = DistBackendError(f"{what}: backend {BACKEND_NAME!r} failed: {type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


@dataclass(eq=False)  # compared by identity: a generated __eq__ would compare the tensors
class _Recv:
    """A posted receive waiting for its message."""

    tensor: torch.Tensor
    src: Optional[int]
    tag: int
    work: Work
    deadline: float


class _Round:
    """One collective seen from one rank: publish, wait for every header, read, clean up."""

    def __init__(self, backend: "StoreBackend", seq: int, op: str, sig: str) -> None:
        self.b = backend
        self.base = f"c/{seq}"
        self.op = f"{op} (collective #{seq})"
        self.sig = sig
        self.headers: Optional[list[dict]] = None

    def publish(self, shared: Optional[bytes] = None, private: Optional[dict[int, bytes]] = None, **extra: Any) -> None:
        """Write this rank's data (``shared`` for everyone, ``private[dst]`` for one rank),
        then its header; wait for every rank's header and check they describe one call."""
        b = self.b
        written: list[str] = []
        if shared is not None:
            written += b._put(f"{self.base}/d/{b.rank}", shared)
        for dst, data in (private or {}).items():
            written += b._put(f"{self.base}/d/{b.rank}/{dst}", data)
        mine = {"sig": self.sig, "keys": written, **extra}
        b.store.set(f"{self.base}/h/{b.rank}", json.dumps(mine))
        others = [r for r in range(b.size) if r != b.rank]
        b._wait([f"{self.base}/h/{r}" for r in others], others, self.op)
        headers = {r: json.loads(b.store.get(f"{self.base}/h/{r}")) for r in others}
        headers[b.rank] = mine
        self.headers = [headers[r] for r in range(b.size)]
        if any(h["sig"] != self.sig for h in self.headers):
            issued = "; ".join(f"rank {r}: {h['sig']}" for r, h in enumerate(self.headers))
            raise DistBackendError(f"{self.op}: the ranks issued different collectives ({issued})")

    def shared(self, src: int) -> bytes:
        return self.b._take(f"{self.base}/d/{src}")

    def private(self, src: int) -> bytes:
        return self.b._take(f"{self.base}/d/{src}/{self.b.rank}")

    def close(self) -> None:
        """Count this rank out; the last rank out deletes the collective's keys."""
        if self.headers is None:  # never got every header (timeout): nothing safe to delete
            return
        store = self.b.store
        if store.add(f"{self.base}/done", 1) == self.b.size:
            for r, header in enumerate(self.headers):
                for key in header["keys"]:
                    store.delete_key(key)
                store.delete_key(f"{self.base}/h/{r}")
            store.delete_key(f"{self.base}/done")


class StoreBackend(Backend):
    """The backend of one process group, exchanging everything through ``store``."""

    name = BACKEND_NAME

    def __init__(self, store: Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size, timeout)
        self.store = store
        self._lock = threading.Condition()
        self._closed = False
        self._seq = 0  # collectives issued so far (the same count on every rank)
        self._sent: dict[tuple[int, int], int] = {}  # (dst, tag) -> messages sent
        self._received: dict[tuple[int, int], int] = {}  # (src, tag) -> messages received
        self._pending: list[_Recv] = []  # posted receives, in posting order
        self._jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._collector = self._collectives_thread()  # the one thread that runs collectives, in order
        self._completing: Optional[threading.Thread] = None  # the collector, while it runs done-callbacks
        self._threads = [
            self._collector,
            threading.Thread(target=self._run_receives, name=f"tdist-store-receives-r{rank}", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _collectives_thread(self) -> threading.Thread:
        return threading.Thread(target=self._run_collectives, name=f"tdist-store-collectives-r{self.rank}", daemon=True)

    # ------------------------------------------------------------------ store helpers
    def _put(self, key: str, data: bytes) -> list[str]:
        """Write ``data`` under ``key`` (in parts ``key#i`` if large, ``key`` last); return the keys."""
        if len(data) < CHUNK_BYTES:
            self.store.set(key, b"=" + data)
            return [key]
        keys = []
        for i, start in enumerate(range(0, len(data), CHUNK_BYTES)):
            keys.append(f"{key}#{i}")
            self.store.set(keys[-1], data[start : start + CHUNK_BYTES])
        self.store.set(key, b"#%d" % len(keys))
        return keys + [key]

    def _take(self, key: str, delete: bool = False) -> bytes:
        """Read what :meth:`_put` wrote under ``key`` (which must be there); ``delete``: then delete it."""
        value = self.store.get(key)
        keys = [key]
        if value[:1] == b"#":
            keys = [f"{key}#{i}" for i in range(int(value[1:]))] + keys
            value = b"".join(self.store.get(k) for k in keys[:-1])
        else:
            value = value[1:]
        if delete:
            for k in keys:
                self.store.delete_key(k)
        return value

    def _wait(self, keys: Sequence[str], ranks: Sequence[int], what: str) -> None:
        """Poll until every key is set; on timeout, name the ranks whose keys are missing."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        delay = POLL_MIN
        while not self.store.check(list(keys)):
            if self._closed:
                raise DistBackendError(f"{what}: the process group was destroyed")
            now = time.monotonic()
            if now >= deadline:
                missing = [r for r, k in zip(ranks, keys) if not self.store.check([k])]
                raise DistBackendTimeoutError(
                    f"{what}: backend {BACKEND_NAME!r} timed out after {self.timeout.total_seconds():g} s "
                    f"waiting for rank(s) {missing}"
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, POLL_MAX)

    # ------------------------------------------------------------------ collectives
    def _collective(self, op: str, sig: str, run: Callable[[_Round], None], outputs: Sequence[torch.Tensor]) -> Work:
        """Queue ``run`` for the worker thread; return the Work it completes."""
        with self._lock:
            if self._closed:
                raise DistBackendError(f"{op}: the process group was destroyed")
            self._seq += 1
            seq = self._seq
            # A done-callback may issue a collective and wait for it (torch's Future callbacks,
            # DDP's PowerSGD hook): when the collector is in one, a new collector takes over.
            if self._completing is not None and self._completing is self._collector:
                self._collector = self._collectives_thread()
                self._threads.append(self._collector)
                self._collector.start()
        work = Work(op)
        self._jobs.put((work, _Round(self, seq, op, sig), run, list(outputs)))
        return work

    def _run_collectives(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.put(None)  # for a collector that took over from this one
                return
            work, rnd, run, outputs = job
            error: Optional[BaseException] = None
            try:
                run(rnd)
            except BaseException as exc:
                error = exc
            try:
                rnd.close()
            except Exception as exc:
                error = error or exc
            with self._lock:
                self._completing = me
            if error is not None:
                work.set_exception(_as_backend_error(error, rnd.op))
            else:
                work.set_result(outputs)
            with self._lock:
                if self._completing is me:
                    self._completing = None
                if self._collector is not me:
                    return  # a new collector took over while this one ran callbacks

    def _reduce(
        self, like: torch.Tensor, mine: torch.Tensor, op: Reduction, fetch: Callable[[int], bytes], what: str
    ) -> torch.Tensor:
        """Combine every rank's contribution in rank order (the same result on every rank)."""
        acc: Optional[torch.Tensor] = None
        for r in range(self.size):
            part = mine if r == self.rank else from_bytes(fetch(r), like, what)
            if acc is None:
                acc = part.clone()
            else:
                combine_(acc, part, op)
        assert acc is not None
        return finalize_(acc, op, self.size)

    @staticmethod
    def _check_reducible(op: Reduction, dtype: torch.dtype, what: str) -> None:
        """Fail before communicating if torch cannot combine ``dtype`` with ``op``."""
        try:
            combine_(torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype), op)
        except (RuntimeError, TypeError) as exc:
            raise TypeError(f"{what}: backend {BACKEND_NAME!r} cannot reduce {dtype} with {op.name}: {exc}") from None

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        def run(rnd: _Round) -> None:
            rnd.publish(shared=to_bytes(tensor) if self.rank == src else None)
            if self.rank != src:
                tensor.copy_(from_bytes(rnd.shared(src), tensor, rnd.op))

        return self._collective("broadcast", f"broadcast(src={src}) {_describe(tensor)}", run, [tensor])

    def all_reduce(self, tensor: torch.Tensor, op: Reduction) -> Work:
        self._check_reducible(op, tensor.dtype, "all_reduce")

        def run(rnd: _Round) -> None:
            mine = prescaled(tensor, op)
            rnd.publish(shared=to_bytes(mine))
            tensor.copy_(self._reduce(tensor, mine, op, rnd.shared, rnd.op))

        return self._collective("all_reduce", f"all_reduce({op.name}) {_describe(tensor)}", run, [tensor])

    def reduce(self, tensor: torch.Tensor, dst: int, op: Reduction) -> Work:
        self._check_reducible(op, tensor.dtype, "reduce")

        def run(rnd: _Round) -> None:
            mine = prescaled(tensor, op)
            rnd.publish(shared=to_bytes(mine) if self.rank != dst else None)
            if self.rank == dst:
                tensor.copy_(self._reduce(tensor, mine, op, rnd.shared, rnd.op))

        return self._collective("reduce", f"reduce(dst={dst}, {op.name}) {_describe(tensor)}", run, [tensor])

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        def run(rnd: _Round) -> None:
            rnd.publish(shared=to_bytes(tensor))
            for r, out in enumerate(outputs):
                out.copy_(tensor.reshape(out.shape) if r == self.rank else from_bytes(rnd.shared(r), out, rnd.op))

        return self._collective("all_gather", f"all_gather {_describe(tensor)}", run, outputs)

    def gather(self, tensor: torch.Tensor, outputs: Optional[Sequence[torch.Tensor]], dst: int) -> Work:
        def run(rnd: _Round) -> None:
            rnd.publish(shared=to_bytes(tensor) if self.rank != dst else None)
            if self.rank == dst:
                assert outputs is not None
                for r, out in enumerate(outputs):
                    out.copy_(tensor.reshape(out.shape) if r == dst else from_bytes(rnd.shared(r), out, rnd.op))

        return self._collective("gather", f"gather(dst={dst}) {_describe(tensor)}", run, outputs or [])

    def scatter(self, tensor: torch.Tensor, inputs: Optional[Sequence[torch.Tensor]], src: int) -> Work:
        def run(rnd: _Round) -> None:
            if self.rank == src:
                assert inputs is not None
                rnd.publish(private={r: to_bytes(t) for r, t in enumerate(inputs) if r != src})
                tensor.copy_(inputs[src].reshape(tensor.shape))
            else:
                rnd.publish()
                tensor.copy_(from_bytes(rnd.private(src), tensor, rnd.op))

        return self._collective("scatter", f"scatter(src={src}) {_describe(tensor)}", run, [tensor])

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: Reduction) -> Work:
        self._check_reducible(op, output.dtype, "reduce_scatter")

        def run(rnd: _Round) -> None:
            parts = [prescaled(t, op) for t in inputs]
            rnd.publish(private={r: to_bytes(p) for r, p in enumerate(parts) if r != self.rank})
            mine = parts[self.rank].reshape(output.shape)
            output.copy_(self._reduce(output, mine, op, rnd.private, rnd.op))

        return self._collective("reduce_scatter", f"reduce_scatter({op.name}) {_describe(output)}", run, [output])

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        def run(rnd: _Round) -> None:
            sends = [t.numel() for t in inputs]
            expects = [t.numel() for t in outputs]
            rnd.publish(
                private={r: to_bytes(t) for r, t in enumerate(inputs) if r != self.rank}, sends=sends, expects=expects
            )
            assert rnd.headers is not None
            # Sizes may differ per pair, so they are not in the signature: check every pair here,
            # so that every rank (not only the one receiving the wrong size) raises.
            wrong = [
                (i, j)
                for i, hi in enumerate(rnd.headers)
                for j, hj in enumerate(rnd.headers)
                if hi["sends"][j] != hj["expects"][i]
            ]
            if wrong:
                i, j = wrong[0]
                raise DistBackendError(
                    f"{rnd.op}: rank {i} sends {rnd.headers[i]['sends'][j]} elements to rank {j}, which expects "
                    f"{rnd.headers[j]['expects'][i]} ({len(wrong)} mismatched pair(s))"
                )
            for r, out in enumerate(outputs):
                out.copy_(inputs[r].reshape(out.shape) if r == self.rank else from_bytes(rnd.private(r), out, rnd.op))

        dtypes = {str(t.dtype).replace("torch.", "") for t in [*inputs, *outputs]}
        return self._collective("all_to_all", f"all_to_all {','.join(sorted(dtypes))}", run, outputs)

    def barrier(self) -> Work:
        return self._collective("barrier", "barrier", lambda rnd: rnd.publish(), [])

    # ------------------------------------------------------------------ point-to-point
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        with self._lock:
            if self._closed:
                raise DistBackendError("send: the process group was destroyed")
            n = self._sent.get((dst, tag), 0)
            self._sent[(dst, tag)] = n + 1
        meta = json.dumps({"dtype": str(tensor.dtype), "numel": tensor.numel()}).encode()
        try:
            self._put(f"p/{self.rank}/{dst}/{tag}/{n}", meta + b"\n" + to_bytes(tensor))
        except Exception as exc:
            work = Work("send")
            work.set_exception(_as_backend_error(exc, f"send to rank {dst}"))
            return work
        return Work.completed("send")

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Work:
        work = Work("recv")
        with self._lock:
            if self._closed:
                raise DistBackendError("recv: the process group was destroyed")
            self._pending.append(_Recv(tensor, src, tag, work, time.monotonic() + self.timeout.total_seconds()))
            self._lock.notify_all()
        return work

    def _run_receives(self) -> None:
        delay = POLL_MIN
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                    delay = POLL_MIN
                if self._closed:
                    return
                pending = list(self._pending)
            try:
                progressed = self._match(pending)
            except Exception as exc:  # the store failed: every pending receive fails with it
                progressed = True
                for rv in pending:
                    self._fail(rv, _as_backend_error(exc, "recv"))
            if progressed:
                delay = POLL_MIN
                continue
            with self._lock:
                self._lock.wait(delay)  # a new receive wakes us early
            delay = min(delay * 2, POLL_MAX)

    def _candidates(self, rv: _Recv) -> list[int]:
        return [rv.src] if rv.src is not None else [r for r in range(self.size) if r != self.rank]

    def _key(self, src: int, tag: int) -> str:
        return f"p/{src}/{self.rank}/{tag}/{self._received.get((src, tag), 0)}"

    def _match(self, pending: list[_Recv]) -> bool:
        """Hand the messages that are there now to the posted receives, in posting order."""
        wanted = {(src, rv.tag) for rv in pending for src in self._candidates(rv)}
        present = {st for st in wanted if self.store.check([self._key(*st)])}
        progressed = False
        now = time.monotonic()
        for rv in pending:
            src = next((s for s in self._candidates(rv) if (s, rv.tag) in present), None)
            if src is not None:
                present.discard((src, rv.tag))
                self._deliver(rv, src)
                progressed = True
            elif now > rv.deadline:
                who = "any rank" if rv.src is None else f"rank {rv.src}"
                self._fail(
                    rv,
                    DistBackendTimeoutError(
                        f"recv: backend {BACKEND_NAME!r} timed out after {self.timeout.total_seconds():g} s "
                        f"waiting for a message from {who} (tag {rv.tag})"
                    ),
                )
                progressed = True
        return progressed

    def _deliver(self, rv: _Recv, src: int) -> None:
        key = self._key(src, rv.tag)
        self._received[(src, rv.tag)] = self._received.get((src, rv.tag), 0) + 1
        with self._lock:
            self._pending.remove(rv)
        try:
            record = self._take(key, delete=True)
            head, _, data = record.partition(b"\n")
            meta = json.loads(head)
            if meta["dtype"] != str(rv.tensor.dtype):
                raise DistBackendError(
                    f"recv from rank {src}: rank {src} sent a {meta['dtype']} tensor, this rank expects {rv.tensor.dtype}"
                )
            rv.tensor.copy_(from_bytes(data, rv.tensor, f"recv from rank {src}"))
        except Exception as exc:
            rv.work.set_exception(_as_backend_error(exc, f"recv from rank {src}"))
        else:
            rv.work.set_result([rv.tensor], source_rank=src)

    def _fail(self, rv: _Recv, error: BaseException) -> None:
        with self._lock:
            if rv in self._pending:
                self._pending.remove(rv)
        rv.work.set_exception(error)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending, self._pending = self._pending, []
            self._lock.notify_all()
        self._jobs.put(None)
        for rv in pending:
            rv.work.set_exception(DistBackendError("recv: the process group was destroyed before a message arrived"))
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5.0)


def create_backend(
    *,
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    options: Optional[dict] = None,
    global_ranks: Optional[list[int]] = None,
    **_ignored: Any,
) -> StoreBackend:
    """The factory the core calls for each process group (``BackendSpec.factory``).

    ``store`` is already prefixed for this group; ``rank``/``world_size`` are the group
    rank and size; ``options`` are the caller's ``pg_options`` (this backend has none);
    ``global_ranks`` are the members' global ranks (unused here).
    """
    if not isinstance(store, Store):
        raise DistError(f"backend {BACKEND_NAME!r}: expected a tdist.Store, got {type(store).__name__}")
    return StoreBackend(store, rank, world_size, timeout)
