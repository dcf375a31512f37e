"""TEST-ONLY STAND-INS for ``cupy.cuda.nccl`` and for CUDA streams/events.

*** These are fakes. They exist only because this project's CI machines have no GPU
and no CuPy. Nothing tested with them proves that real NCCL or CUDA behaves this way;
the tests marked ``gpu`` (test_nccl_gpu.py) are the real check. ***

:class:`FakeNccl` mimics the Python surface of ``cupy.cuda.nccl`` (constants,
``get_unique_id``, ``groupStart``/``groupEnd``, ``NcclCommunicator`` and its methods) of
either CuPy generation (``unique_id=bytes``: CuPy >= 14; ``unique_id=tuple``: a tuple of
signed ``char`` values, before 14), logs every call, and -- so that pointer arithmetic
and reduction plans can be checked -- carries the data out on *host* memory: the "device pointers" it receives are the
``data_ptr()`` of CPU tensors, read and written with ctypes. Ranks are threads of one
process; collectives of one communicator clique meet in a shared :class:`_Fabric`.
Inside groupStart/groupEnd calls are deferred to groupEnd, like NCCL's group semantics.

:class:`FakeCuda` replaces :class:`tdist_nccl.cuda.TorchCuda`: a tensor's "device" is
its ``fake_device`` attribute (default 0), streams are integers, events are done at once
(or never, for timeout tests).

With ``binding=`` the real ``cupy.cuda.nccl`` module (CuPy and libnccl installed, no GPU
needed), every call is *also* passed to the real Cython binding first -- the constructor,
``initAll`` and each method on a communicator whose NCCL handle is NULL -- and must come
back as an ``NcclError`` from NCCL (no CUDA device / invalid argument), not as a
``TypeError`` or ``OverflowError`` from converting the arguments. That checks the backend's
calls against CuPy's real signatures and argument types; it still runs no NCCL operation.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import sys
import threading
import types
from collections import defaultdict, deque
from typing import Any, Iterator, Optional

import torch

# ------------------------------------------------------------------ constants
CONSTANTS = {
    "NCCL_SUM": 0,
    "NCCL_PROD": 1,
    "NCCL_MAX": 2,
    "NCCL_MIN": 3,
    "NCCL_AVG": 4,
    "NCCL_INT8": 0,
    "NCCL_CHAR": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_INT": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_HALF": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_DOUBLE": 8,
    "NCCL_BFLOAT16": 9,
}
TORCH_OF = {
    0: torch.int8,
    1: torch.uint8,
    2: torch.int32,
    3: torch.uint32,
    4: torch.int64,
    5: torch.uint64,
    6: torch.float16,
    7: torch.float32,
    8: torch.float64,
    9: torch.bfloat16,
}
_TIMEOUT = 20.0


def _read(ptr: int, count: int, dtype: int) -> torch.Tensor:
    size = count * torch.empty(0, dtype=TORCH_OF[dtype]).element_size()
    data = bytearray(ctypes.string_at(ptr, size)) if size else bytearray()
    return torch.frombuffer(data, dtype=TORCH_OF[dtype]).clone() if size else torch.empty(0, dtype=TORCH_OF[dtype])


def _write(ptr: int, values: torch.Tensor) -> None:
    data = values.contiguous().view(torch.uint8).numpy().tobytes()
    if data:
        ctypes.memmove(ptr, data, len(data))


def _reduce(values: list[torch.Tensor], op: int) -> torch.Tensor:
    stacked = torch.stack(values)
    if op in (0, 4):
        out = stacked.sum(0, dtype=stacked.dtype)
        return out / len(values) if op == 4 else out
    if op == 1:
        return stacked.prod(0, dtype=stacked.dtype)
    if op == 2:
        return stacked.max(0).values
    if op == 3:
        return stacked.min(0).values
    raise AssertionError(f"fake nccl: unknown op {op}")


class _Fabric:
    """Where the ranks of one clique (one unique id) meet: collective rounds and mailboxes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.rounds: dict[int, dict[int, Any]] = defaultdict(dict)
        self.counter: dict[int, int] = defaultdict(int)
        self.mail: dict[tuple[int, int], deque] = defaultdict(deque)

    def post(self, rank: int, value: Any) -> int:
        with self.cond:
            k = self.counter[rank]
            self.counter[rank] += 1
            self.rounds[k][rank] = value
            self.cond.notify_all()
            return k

    def collect(self, k: int) -> list[Any]:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.rounds[k]) == self.size, _TIMEOUT):
                raise RuntimeError(f"fake nccl: collective round {k} incomplete: {sorted(self.rounds[k])}")
            return [self.rounds[k][r] for r in range(self.size)]

    def send(self, src: int, dst: int, data: torch.Tensor) -> None:
        with self.cond:
            self.mail[(src, dst)].append(data)
            self.cond.notify_all()

    def recv(self, src: int, dst: int) -> torch.Tensor:
        with self.cond:
            if not self.cond.wait_for(lambda: bool(self.mail[(src, dst)]), _TIMEOUT):
                raise RuntimeError(f"fake nccl: rank {dst} never got a message from {src}")
            return self.mail[(src, dst)].popleft()


class RealBinding:
    """The real ``cupy.cuda.nccl``, used only to convert arguments (see the module docstring)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.null = module.NcclCommunicator.__new__(module.NcclCommunicator)  # NCCL handle NULL

    def check(self, call: str, fn: Any, *args: Any, convert_errors: bool = False) -> None:
        """``fn(*args)`` must fail inside NCCL (NcclError), i.e. after CuPy accepted the arguments.
        With ``convert_errors`` CuPy's own refusal (TypeError, OverflowError) is raised as it
        is, as the real call would (the backend offers a unique id in another form then)."""
        try:
            fn(*args)
        except self.module.NcclError:
            return
        except Exception as exc:
            if convert_errors and isinstance(exc, (TypeError, OverflowError)):
                raise
            raise AssertionError(
                f"the real cupy.cuda.nccl refused {call}{args!r}: {type(exc).__name__}: {exc}"
            ) from exc
        raise AssertionError(f"the real cupy.cuda.nccl ran {call}{args!r} on a NULL communicator")

    def method(self, name: str, *args: Any) -> None:
        self.check(f"NcclCommunicator.{name}", getattr(self.null, name), *args)

    def has(self, owner: Any, name: str) -> None:
        """For calls not worth running on NULL (groupStart, destroy): they must exist."""
        assert callable(getattr(owner, name, None)), f"the real cupy.cuda.nccl has no {name}()"


class FakeNccl(types.ModuleType):
    """A stand-in ``cupy.cuda.nccl`` module (see the module docstring)."""

    #: what a FakeNccl() gets when not told: ``unique_id`` (bytes or tuple) and ``binding``
    #: (a RealBinding or None); test_nccl_fake.py runs every test under each CuPy form.
    defaults: dict[str, Any] = {"unique_id": bytes, "binding": None}

    def __init__(
        self,
        version: int = 21803,
        bfloat16: bool = True,
        avg: bool = True,
        unique_id: Optional[type] = None,
        binding: Optional[RealBinding] = None,
    ) -> None:
        super().__init__("cupy.cuda.nccl")
        self.unique_id_type = unique_id or FakeNccl.defaults["unique_id"]
        self.binding = binding or FakeNccl.defaults["binding"]
        for name, value in CONSTANTS.items():
            if self.binding is not None:
                assert getattr(self.binding.module, name) == value, f"the real {name} differs from the fake's"
            setattr(self, name, value)
        if not bfloat16:
            del self.NCCL_BFLOAT16
        if not avg:
            del self.NCCL_AVG
        self.available = True
        self._version = version
        self.log: list[tuple] = []
        self.by_thread: dict[str, list[tuple]] = defaultdict(list)
        self._log_lock = threading.Lock()
        self._fabrics: dict[tuple, _Fabric] = {}
        self._ids = itertools.count(1)
        self._local = threading.local()
        self.created: list[FakeCommunicator] = []
        nccl = self

        class NcclCommunicator(FakeCommunicator):
            def __init__(self, ndev: int, commId: Any, rank: int) -> None:
                if nccl.binding is not None:
                    nccl.binding.check(
                        "NcclCommunicator",
                        nccl.binding.module.NcclCommunicator,
                        ndev,
                        commId,
                        rank,
                        convert_errors=True,
                    )
                super().__init__(nccl, ndev, nccl.convert_unique_id(commId), rank)

            @staticmethod
            def initAll(devices: Any) -> list[FakeCommunicator]:
                if nccl.binding is not None:
                    nccl.binding.check(
                        "NcclCommunicator.initAll", nccl.binding.module.NcclCommunicator.initAll, devices
                    )
                devs = list(range(devices)) if isinstance(devices, int) else list(devices)
                uid = nccl.convert_unique_id(nccl.get_unique_id())
                nccl.record("initAll", tuple(devs))
                return [FakeCommunicator(nccl, len(devs), uid, r, device=d) for r, d in enumerate(devs)]

        self.NcclCommunicator = NcclCommunicator

    # --------------------------------------------------------------- module API
    def record(self, *entry: Any) -> None:
        with self._log_lock:
            self.log.append(entry)
            self.by_thread[threading.current_thread().name].append(entry)

    def get_version(self) -> int:
        return self._version

    def get_build_version(self) -> int:
        return self._version

    def get_unique_id(self) -> Any:
        n = next(self._ids)
        raw = bytes((n * 37 + i * 11) % 256 for i in range(128))
        if self.unique_id_type is bytes:
            return raw
        # signed char values, negative ones included, as CuPy before 14 returns them on x86
        return tuple(b - 256 if b > 127 else b for b in raw)

    def convert_unique_id(self, comm_id: Any) -> bytes:
        """The id's bytes, converting ``comm_id`` the way this CuPy generation's Cython does."""
        if not isinstance(comm_id, self.unique_id_type):
            raise TypeError(
                f"Argument 'commId' has incorrect type (expected {self.unique_id_type.__name__}, "
                f"got {type(comm_id).__name__})"
            )
        assert len(comm_id) == 128, "an NCCL unique id has 128 chars"
        if isinstance(comm_id, bytes):
            return comm_id
        if any(not -128 <= v <= 127 for v in comm_id):
            raise OverflowError("value too large to convert to char")
        return bytes(v & 0xFF for v in comm_id)

    def fabric(self, uid: bytes, size: int) -> _Fabric:
        with self._log_lock:
            return self._fabrics.setdefault(uid, _Fabric(size))

    @property
    def _deferred(self) -> Optional[list]:
        return getattr(self._local, "deferred", None)

    def groupStart(self) -> None:
        if self.binding is not None:
            self.binding.has(self.binding.module, "groupStart")
        self.record("groupStart")
        if getattr(self._local, "depth", 0) == 0:
            self._local.deferred = []
        self._local.depth = getattr(self._local, "depth", 0) + 1

    def groupEnd(self) -> None:
        if self.binding is not None:
            self.binding.has(self.binding.module, "groupEnd")
        self.record("groupEnd")
        self._local.depth -= 1
        if self._local.depth:
            return
        deferred, self._local.deferred = self._local.deferred, None
        finishers = [start() for start in deferred]  # every send / contribution first ...
        for finish in finishers:  # ... then every receive / result
            finish()

    def run(self, start: Any) -> None:
        if self._deferred is not None:
            self._deferred.append(start)
        else:
            start()()


class FakeCommunicator:
    """A stand-in ``NcclCommunicator``: logs its calls, moves host memory."""

    def __init__(self, nccl: FakeNccl, ndev: int, uid: bytes, rank: int, device: Optional[int] = None) -> None:
        assert isinstance(uid, bytes) and len(uid) == 128
        assert 0 <= rank < ndev
        self.nccl = nccl
        self.ndev = ndev
        self.uid = uid
        self.rank = rank
        self.device = device if device is not None else FakeCuda.current.get(threading.current_thread().name, 0)
        self.fabric = nccl.fabric(self.uid, ndev)
        self.destroyed = False
        nccl.created.append(self)
        nccl.record("init", rank, ndev, self.device, nccl._deferred is not None)

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ndev

    def device_id(self) -> int:
        return self.device

    def destroy(self) -> None:
        if self.nccl.binding is not None:
            self.nccl.binding.has(self.nccl.binding.null, "destroy")
        self.destroyed = True
        self.nccl.record("destroy", self.rank)

    abort = destroy

    # --------------------------------------------------------------- collectives
    def _collective(self, name: str, value: Any, finish: Any, *log: Any) -> None:
        self.nccl.record(name, self.rank, *log)

        def start() -> Any:
            k = self.fabric.post(self.rank, value())
            return lambda: finish(self.fabric.collect(k))

        self.nccl.run(start)

    def _real(self, name: str, *args: Any) -> None:
        """With a real binding, the call must get past CuPy's argument conversion."""
        if self.nccl.binding is not None:
            self.nccl.binding.method(name, *args)

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._real("allReduce", send, recv, count, dtype, op, stream)
        self._collective(
            "allReduce",
            lambda: _read(send, count, dtype),
            lambda vals: _write(recv, _reduce(vals, op)),
            count,
            dtype,
            op,
            stream,
        )

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, stream: int) -> None:
        self._real("reduce", send, recv, count, dtype, op, root, stream)

        def finish(vals: list) -> None:
            if self.rank == root:
                _write(recv, _reduce(vals, op))

        self._collective("reduce", lambda: _read(send, count, dtype), finish, count, dtype, op, root, stream)

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._real("broadcast", send, recv, count, dtype, root, stream)
        self._collective(
            "broadcast",
            lambda: _read(send, count, dtype) if self.rank == root else None,
            lambda vals: _write(recv, vals[root]),
            count,
            dtype,
            root,
            stream,
        )

    def bcast(self, buff: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._real("bcast", buff, count, dtype, root, stream)
        self.broadcast(buff, buff, count, dtype, root, stream)

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:
        self._real("allGather", send, recv, count, dtype, stream)
        self._collective(
            "allGather",
            lambda: _read(send, count, dtype),
            lambda vals: _write(recv, torch.cat(vals)),
            count,
            dtype,
            stream,
        )

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:
        self._real("reduceScatter", send, recv, count, dtype, op, stream)

        def finish(vals: list) -> None:
            _write(recv, _reduce(vals, op)[self.rank * count : (self.rank + 1) * count])

        self._collective(
            "reduceScatter", lambda: _read(send, count * self.ndev, dtype), finish, count, dtype, op, stream
        )

    # ------------------------------------------------------------ point-to-point
    def send(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._real("send", buf, count, dtype, peer, stream)
        self.nccl.record("send", self.rank, peer, count, dtype, stream)

        def start() -> Any:
            self.fabric.send(self.rank, peer, _read(buf, count, dtype))
            return lambda: None

        self.nccl.run(start)

    def recv(self, buf: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._real("recv", buf, count, dtype, peer, stream)
        self.nccl.record("recv", self.rank, peer, count, dtype, stream)

        def start() -> Any:
            def finish() -> None:
                data = self.fabric.recv(peer, self.rank)
                assert data.numel() == count, f"fake nccl: recv of {count} got {data.numel()}"
                _write(buf, data)

            return finish

        self.nccl.run(start)


@contextlib.contextmanager
def fake_cupy(nccl: FakeNccl) -> Iterator[FakeNccl]:
    """Make ``from cupy.cuda import nccl`` return ``nccl`` (restores sys.modules afterwards)."""
    cupy = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cuda.nccl = nccl  # type: ignore[attr-defined]
    cupy.cuda = cuda  # type: ignore[attr-defined]
    saved = {name: sys.modules.get(name) for name in ("cupy", "cupy.cuda", "cupy.cuda.nccl")}
    sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})
    try:
        yield nccl
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ------------------------------------------------------------------ CUDA side
class FakeEvent:
    def __init__(self, device: int, done: bool, log: list) -> None:
        self.device = device
        self.done = done
        self.log = log

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.device))
        if not self.done:
            raise AssertionError("fake cuda: synchronize on an event that never completes")

    def block_current_stream(self) -> None:
        self.log.append(("stream_wait", self.device))


class FakeStream:
    def __init__(self, device: int, handle: int) -> None:
        self.device = device
        self.cuda_stream = handle


class FakeCuda:
    """Stand-in for :class:`tdist_nccl.cuda.TorchCuda` on CPU tensors (``fake_device`` attribute)."""

    #: thread name -> device made current by guard() (read by FakeCommunicator)
    current: dict[str, int] = {}

    def __init__(self, events_done: bool = True, stream_base: int = 1000) -> None:
        self.events_done = events_done
        self.stream_base = stream_base
        self.log: list[tuple] = []

    def device_index(self, tensor: torch.Tensor, operation: str) -> int:
        if tensor.device.type != "cpu":
            raise ValueError(f"nccl {operation}: fake cuda takes CPU tensors")
        return int(getattr(tensor, "fake_device", 0))

    def current_device(self) -> int:
        return FakeCuda.current.get(threading.current_thread().name, 0)

    def device_count(self) -> int:
        return 8

    def stream(self, device: int) -> FakeStream:
        return FakeStream(device, self.stream_base + device)

    def handle(self, stream: FakeStream) -> int:
        return stream.cuda_stream

    def record(self, stream: FakeStream, device: int) -> FakeEvent:
        self.log.append(("record", device, stream.cuda_stream))
        return FakeEvent(device, self.events_done, self.log)

    def zeros(self, numel: int, device: int) -> torch.Tensor:
        return torch.zeros(numel, dtype=torch.float32)

    @contextlib.contextmanager
    def guard(self, device: int) -> Iterator[None]:
        name = threading.current_thread().name
        before = FakeCuda.current.get(name)
        FakeCuda.current[name] = device
        try:
            yield
        finally:
            if before is None:
                FakeCuda.current.pop(name, None)
            else:
                FakeCuda.current[name] = before


def on(device: int, tensor: torch.Tensor) -> torch.Tensor:
    """Mark a CPU tensor as living on fake CUDA device ``device``."""
    tensor.fake_device = device  # type: ignore[attr-defined]
    return tensor


def run_ranks(n: int, fn: Any, timeout: float = 30.0) -> list[Any]:
    """Run ``fn(rank)`` in ``n`` threads named ``rank<r>`` (the fake "processes"); return
    their results in rank order, re-raising the first exception."""
    results: list[Any] = [None] * n
    errors: list[Optional[BaseException]] = [None] * n

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise AssertionError(f"fake world: {t.name} did not finish within {timeout} s")
    for exc in errors:
        if exc is not None:
            raise exc
    return results
