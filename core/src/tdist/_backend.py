"""The contract between the core and a backend: :class:`Backend`, :class:`BackendSpec`.

A backend instance serves exactly one process group. Ranks it receives are
*group* ranks (0 .. size-1); the core has already validated every argument
(ranks in range, list lengths, matching sizes and dtypes on this rank), so a
backend only checks what needs the other ranks (and its own limits, such as a
dtype it cannot reduce, which it must reject before communicating).

Every operation returns a :class:`tdist.Work` at once or after completing; the
core waits on it unless the caller passed ``async_op=True``.
"""

from __future__ import annotations

import abc
import difflib
import inspect
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence

from ._errors import DistError
from ._reduce_op import ReduceOp, Reduction
from ._work import Work
from .reduction import combine_, prescaled

if TYPE_CHECKING:
    import torch

__all__ = [
    "Backend",
    "BackendSpec",
    "BackendFactory",
    "OPERATIONS",
    "OPERATION_CODES",
    "COLLECTIVES",
    "ANY_SOURCE_OP",
    "FEATURES",
    "LAUNCHERS",
]

#: The operation names a :class:`BackendSpec` may declare per device type.
OPERATIONS: tuple[str, ...] = (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "gather",
    "scatter",
    "reduce_scatter",
    "all_to_all",
    "barrier",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
)
#: The collective operations: :data:`OPERATIONS` without the point-to-point ones.
COLLECTIVES: tuple[str, ...] = tuple(op for op in OPERATIONS if op not in ("send", "recv"))
#: A small integer per operation name, its position in :data:`OPERATIONS` from 1 (0 is
#: free for "none"): for wire formats and collective checks that carry the operation as
#: a number. Stable: new operations are appended.
OPERATION_CODES: Mapping[str, int] = {name: code for code, name in enumerate(OPERATIONS, start=1)}
#: Declared in addition to "recv" by backends that can receive from any source.
ANY_SOURCE_OP = "recv_anysource"

#: The finer features a backend may declare unsupported in ``BackendSpec.extra["unsupported"]``
#: (``{key: why}``), besides ``reduce_op.<ReduceOp name>`` and ``dtype.<torch dtype name>``;
#: the conformance kit (:mod:`tdist.testing.capabilities`) explains each.
FEATURES: tuple[str, ...] = (
    "multigpu",
    "monitored_barrier",
    "p2p_tags",
    "p2p_size_check",
    "p2p_dtype_check",
    "collective_mismatch",
    "peer_failure",
    "timeout_names_ranks",
    "shrink_group",
    "abort",
)

#: How the conformance kit starts a world of a backend (:attr:`BackendSpec.launcher`):
#: None, one process per rank (``env://``); ``"mpirun"``, every rank under one ``mpirun``.
LAUNCHERS: tuple[Optional[str], ...] = (None, "mpirun")


class BackendFactory(Protocol):
    """What :attr:`BackendSpec.factory` is: builds the backend of one process group.

    ``store`` is the group's store (already prefixed for the group and backend),
    ``rank``/``world_size`` the group rank and size, ``timeout`` the group's timeout,
    ``options`` the caller's ``pg_options`` (a dict), ``global_ranks`` the global rank
    of each group rank. A factory that declares ``secret`` (or ``**kwargs``) also
    receives the job's key for this backend (32 bytes, b"" without a store token).
    """

    def __call__(
        self,
        *,
        store: Any,
        rank: int,
        world_size: int,
        timeout: timedelta,
        options: dict[str, Any],
        global_ranks: list[int],
        **kwargs: Any,
    ) -> "Backend": ...


@dataclass(frozen=True)
class BackendSpec:
    """What a plugin registers for one backend.

    ``factory(store=..., rank=..., world_size=..., timeout=..., options=..., global_ranks=...)``
    builds the backend of one process group; ``store`` is already prefixed for that
    group. ``operations`` maps a device type (``"cpu"``, ``"cuda"``) to the operation
    names it supports (see :data:`OPERATIONS`, plus :data:`ANY_SOURCE_OP`).
    ``available`` is None when usable, else the reason it is not (e.g. "no GPU").
    ``default_init_method`` is the init method used when the caller names none
    (e.g. ``"mpi://"`` for a backend whose launcher provides rank and size);
    None means ``env://``. ``launcher`` says how a job of this backend is started
    (see :data:`LAUNCHERS`: ``"mpirun"`` for a backend whose ranks must share one
    ``mpirun``). ``torch_bridge`` is None when tdist can serve
    ``torch.distributed`` through this backend (as torch's backend ``tdist-<name>``,
    and as torch's default group after ``tdist.init_process_group``), else the reason
    it cannot. ``extra["unsupported"]`` maps :data:`FEATURES` keys the backend lacks
    to why.

    The capability keys (operation names, ``unsupported`` keys, the launcher), the
    factory's keywords (:data:`FACTORY_KEYWORDS`, or ``**kwargs``) and ``available`` are
    checked when the spec is made: a wrong one is a :class:`ValueError` that names it,
    so the plugin is refused at registration instead of failing later.
    """

    name: str
    factory: BackendFactory
    operations: Mapping[str, frozenset[str]]
    description: str = ""
    available: Optional[str] = None
    default_init_method: Optional[str] = None
    distribution: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)
    torch_bridge: Optional[str] = None
    launcher: Optional[str] = None

    def __post_init__(self) -> None:
        problems = _spec_problems(self)
        if problems:
            raise ValueError(f"BackendSpec {self.name!r}: " + "; ".join(problems))

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(self.operations)

    def supports(self, operation: str, device: str) -> bool:
        return operation in self.operations.get(device, ())


def _unknown(names: Any, known: Sequence[str]) -> list[str]:
    out: list[str] = []
    for name in sorted(map(str, names)):
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            out.append(repr(name) + (f" (did you mean {close[0]!r}?)" if close else ""))
    return out


def _spec_problems(spec: BackendSpec) -> list[str]:
    """What is wrong with ``spec``'s capability keys (empty when nothing is)."""
    problems: list[str] = []
    if not spec.name or not isinstance(spec.name, str):
        problems.append("name must be a non-empty string")
    if not callable(spec.factory):
        problems.append("factory is not callable")
    else:
        problems += _factory_problems(spec.factory)
    if spec.available is not None and (not isinstance(spec.available, str) or not spec.available):
        problems.append(f"available must be None (usable) or the reason it is not, a string; got {spec.available!r}")
    known_ops = (*OPERATIONS, ANY_SOURCE_OP)
    for device, ops in spec.operations.items():
        if not isinstance(device, str) or not device:
            problems.append(f"device {device!r} is not a device type name ('cpu', 'cuda')")
        bad = _unknown(ops, known_ops)
        if bad:
            problems.append(f"unknown operation(s) for {device!r}: {', '.join(bad)} (known: {', '.join(known_ops)})")
    if spec.launcher not in LAUNCHERS:
        problems.append(f"launcher {spec.launcher!r} is not one of {LAUNCHERS}")
    unsupported = spec.extra.get("unsupported", {})
    reduce_ops = [op.name for op in ReduceOp]
    features = [
        str(key)
        for key in unsupported
        if not isinstance(key, str)
        or not (
            (key.startswith("reduce_op.") and key.partition(".")[2] in reduce_ops)
            or (key.startswith("dtype.") and key.partition(".")[2].isidentifier())
        )
    ]
    bad = _unknown(features, FEATURES)
    if bad:
        problems.append(
            f"unknown unsupported feature(s): {', '.join(bad)} (known: {', '.join(FEATURES)}, "
            "reduce_op.<NAME>, dtype.<name>)"
        )
    return problems


#: The keywords the core passes every factory (``secret`` only to one that declares it).
FACTORY_KEYWORDS = ("store", "rank", "world_size", "timeout", "options", "global_ranks")


def _factory_problems(factory: Callable[..., Any]) -> list[str]:
    """What keeps ``factory`` from being called the documented way (keywords only)."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): trust it
        return []
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    named = {p.name for p in parameters if p.kind in keyword}
    problems = []
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        missing = [k for k in FACTORY_KEYWORDS if k not in named]
        if missing:
            problems.append(f"factory does not accept the keyword(s) {', '.join(missing)} (nor **kwargs)")
    extra = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.name not in (*FACTORY_KEYWORDS, "secret")
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if extra:
        problems.append(f"factory requires {', '.join(extra)}, which the core never passes")
    return problems


_SUM = Reduction(ReduceOp.SUM)


def _combine_local(tensors: Sequence["torch.Tensor"], op: Reduction) -> tuple["torch.Tensor", Reduction]:
    """Reduce the local tensors into a new tensor; return it and the op to finish across ranks
    (PREMUL_SUM's factor is applied here, so SUM finishes it)."""
    scaled = op.op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PREMUL_SUM)
    local = _SUM if scaled else op
    acc = prescaled(tensors[0], op).clone() if op.op is ReduceOp.PREMUL_SUM else tensors[0].clone()
    for t in tensors[1:]:
        combine_(acc, prescaled(t, op).to(acc.device), local)
    return acc, (_SUM if op.op is ReduceOp.PREMUL_SUM else op)


class Backend(abc.ABC):
    """The communication engine of one process group.

    Subclasses implement the abstract operations; the ``*_tensor`` / ``_single``
    variants have defaults built on the list forms, and the optional ``*_multigpu``
    forms defaults built on the single-tensor collectives, that a backend may override
    with something faster. ``rank`` and ``size`` are the group rank and size.
    """

    name: str = "backend"
    #: True: the core compares every collective of this backend's groups across ranks
    #: before issuing it (one extra all-gather each; see ``TDIST_CHECK_COLLECTIVES``), so a
    #: backend that cannot detect mismatched collectives itself can offer it as an option.
    check_collectives: bool = False

    # torch.distributed.Backend's name constants, for programs that spell backends this way.
    TCP = "tcp"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"

    def __init__(self, rank: int, size: int, timeout: timedelta) -> None:
        self.rank = rank
        self.size = size
        self.timeout = timeout

    # ------------------------------------------------------------ point-to-point
    @abc.abstractmethod
    def send(self, tensor: "torch.Tensor", dst: int, tag: int) -> Work:
        """Send ``tensor`` to group rank ``dst``. Messages to one peer arrive in order."""

    @abc.abstractmethod
    def recv(self, tensor: "torch.Tensor", src: Optional[int], tag: int) -> Work:
        """Receive into ``tensor`` from ``src`` (None: any rank); the Work's
        ``source_rank()`` is the sender's group rank."""

    # --------------------------------------------------------------- collectives
    @abc.abstractmethod
    def broadcast(self, tensor: "torch.Tensor", src: int) -> Work:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` on every rank."""

    @abc.abstractmethod
    def all_reduce(self, tensor: "torch.Tensor", op: Reduction) -> Work:
        """Reduce ``tensor`` across ranks in place on every rank."""

    @abc.abstractmethod
    def reduce(self, tensor: "torch.Tensor", dst: int, op: Reduction) -> Work:
        """Reduce ``tensor`` across ranks into ``tensor`` on ``dst``; others' tensors may change."""

    @abc.abstractmethod
    def all_gather(self, outputs: Sequence["torch.Tensor"], tensor: "torch.Tensor") -> Work:
        """``outputs[i]`` receives rank i's ``tensor`` on every rank."""

    @abc.abstractmethod
    def gather(self, tensor: "torch.Tensor", outputs: Optional[Sequence["torch.Tensor"]], dst: int) -> Work:
        """On ``dst``, ``outputs[i]`` receives rank i's ``tensor``; ``outputs`` is None elsewhere."""

    @abc.abstractmethod
    def scatter(self, tensor: "torch.Tensor", inputs: Optional[Sequence["torch.Tensor"]], src: int) -> Work:
        """Rank i's ``tensor`` receives ``inputs[i]`` of ``src``; ``inputs`` is None elsewhere."""

    @abc.abstractmethod
    def reduce_scatter(self, output: "torch.Tensor", inputs: Sequence["torch.Tensor"], op: Reduction) -> Work:
        """Rank i's ``output`` receives the reduction over ranks of their ``inputs[i]``."""

    @abc.abstractmethod
    def all_to_all(self, outputs: Sequence["torch.Tensor"], inputs: Sequence["torch.Tensor"]) -> Work:
        """Rank i's ``outputs[j]`` receives rank j's ``inputs[i]``."""

    @abc.abstractmethod
    def barrier(self) -> Work:
        """Complete once every rank of the group has entered the barrier."""

    # ------------------------------------------------- defaults on the list forms
    def all_gather_into_tensor(self, output: "torch.Tensor", tensor: "torch.Tensor") -> Work:
        """``output`` (size * tensor's numel, contiguous) receives every rank's ``tensor`` in rank order."""
        chunks = list(output.view(-1).chunk(self.size))
        return self.all_gather([c.view(tensor.shape) for c in chunks], tensor)

    def gather_into_tensor(self, tensor: "torch.Tensor", output: Optional["torch.Tensor"], dst: int) -> Work:
        """On ``dst``, ``output`` (size * tensor's numel, contiguous) receives every rank's
        ``tensor`` in rank order; ``output`` is None elsewhere."""
        chunks = None if output is None else [c.view(tensor.shape) for c in output.view(-1).chunk(self.size)]
        return self.gather(tensor, chunks, dst)

    def reduce_scatter_tensor(self, output: "torch.Tensor", tensor: "torch.Tensor", op: Reduction) -> Work:
        """Rank i's ``output`` receives the reduction of chunk i of every rank's ``tensor``."""
        chunks = [c.view(output.shape) for c in tensor.reshape(-1).chunk(self.size)]
        return self.reduce_scatter(output, chunks, op)

    def all_to_all_single(
        self,
        output: "torch.Tensor",
        tensor: "torch.Tensor",
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        """Split ``tensor`` along dim 0 by ``input_split_sizes``; rank i's piece j goes to
        rank j, which stores it as piece i of ``output`` (split by ``output_split_sizes``)."""
        inputs = list(tensor.split(list(input_split_sizes)))
        outputs = list(output.split(list(output_split_sizes)))
        return self.all_to_all(outputs, inputs)

    # ------------------------------------------------ optional: multi-GPU forms
    # One tensor per local device. A backend that can run them in one call (NCCL group
    # calls) overrides them; these defaults combine the local tensors, run one collective
    # of this backend and copy the result out, synchronously (the Work is complete).
    # The core has checked the lists (same shape/dtype, indices in range, the reduction).

    def all_reduce_multigpu(self, tensors: Sequence["torch.Tensor"], op: Reduction) -> Work:
        """Every tensor of every rank receives the reduction over all of them."""
        acc, across = _combine_local(tensors, op)
        self.all_reduce(acc, _SUM if across.op is ReduceOp.AVG else across).wait()
        if across.op is ReduceOp.AVG:
            acc /= self.size * len(tensors)
        for t in tensors:
            t.copy_(acc)
        return Work.completed("all_reduce_multigpu")

    def reduce_multigpu(self, tensors: Sequence["torch.Tensor"], dst: int, op: Reduction, dst_tensor: int) -> Work:
        """``tensors[dst_tensor]`` of group rank ``dst`` receives the reduction over every tensor of every rank."""
        acc, across = _combine_local(tensors, op)
        self.reduce(acc, dst, _SUM if across.op is ReduceOp.AVG else across).wait()
        if across.op is ReduceOp.AVG:
            acc /= self.size * len(tensors)
        if self.rank == dst:
            tensors[dst_tensor].copy_(acc)
        return Work.completed("reduce_multigpu")

    def broadcast_multigpu(self, tensors: Sequence["torch.Tensor"], src: int, src_tensor: int) -> Work:
        """Every tensor of every rank receives ``tensors[src_tensor]`` of group rank ``src``."""
        source = (tensors[src_tensor] if self.rank == src else tensors[0]).contiguous()
        self.broadcast(source, src).wait()
        for t in tensors:
            if t is not source:
                t.copy_(source)
        return Work.completed("broadcast_multigpu")

    def all_gather_multigpu(
        self, output_lists: Sequence[Sequence["torch.Tensor"]], inputs: Sequence["torch.Tensor"]
    ) -> Work:
        """``output_lists[i][k * len(inputs) + j]`` receives ``inputs[j]`` of group rank k, for every i."""
        import torch

        local = torch.stack([t.to(inputs[0].device).reshape(-1) for t in inputs])
        gathered = local.new_empty((self.size * len(inputs), local.shape[1]))
        self.all_gather_into_tensor(gathered, local).wait()
        for out in output_lists:
            for k, t in enumerate(out):
                t.copy_(gathered[k].view(t.shape))
        return Work.completed("all_gather_multigpu")

    # ------------------------------------------------------ optional: blocking calls
    def run_blocking(self, call: Callable[["Backend"], Work], timeout: Optional[float]) -> None:
        """Run one operation for a caller that waits for it (``async_op=False``).

        ``call(self)`` issues one of this backend's operations and returns its Work.
        Return once the operation is done; raise its error (a
        :class:`DistBackendTimeoutError` once ``timeout`` seconds have passed; None: the
        Work's default timeout). The default does exactly ``call(self).wait(timeout)``. A
        backend may override it to run the operation in the calling thread without
        building a Work, as long as operations issued earlier still run first.
        """
        work = call(self)
        if not isinstance(work, Work):
            raise DistError(f"backend {self.name!r} returned {type(work).__name__}, not a tdist.Work")
        work.wait(timeout)

    def set_timeout(self, timeout: timedelta) -> None:
        """Operations issued from now on time out after ``timeout`` (``tdist.set_timeout``).
        The default records it in ``self.timeout``; a backend that keeps its own copies of
        the timeout overrides it (and calls this one)."""
        self.timeout = timeout

    def shrink(
        self,
        survivors: Sequence[int],
        *,
        store: Any,
        global_ranks: Sequence[int],
        options: dict[str, Any],
        abort: bool,
    ) -> Optional["Backend"]:
        """Optional: the backend of this group without some of its ranks, made from this one
        (``shrink_group``) instead of by the factory through the store.

        ``survivors``: the group ranks that stay (sorted, this rank among them), the same on
        every one of them; the new backend's rank i is ``survivors[i]``, its global ranks
        ``global_ranks``. Called once by every survivor, after they agreed; never by an
        excluded rank, which may be dead. ``store`` is the new group's store (prefixed as a
        factory's is), for whatever must still be exchanged; ``options`` the new group's
        options; ``abort`` (``SHRINK_ABORT``): fail this group's pending operations before
        anything else. Return None (the default) to have the core build the new backend with
        the factory, as for any new group (the core shuts this one down first when
        ``abort``). The core shuts this backend down after the new one is built: whatever
        the new backend took over (connections, shared memory, a communicator) must not be
        released by that :meth:`shutdown`."""
        return None

    def abort(self) -> None:
        """``group.abort()``: fail this rank's pending operations now and, where the backend
        can, its peers' (a backend declares ``abort`` unsupported where it cannot), then
        release everything as :meth:`shutdown` does. The default is :meth:`shutdown`."""
        self.shutdown()

    def shutdown(self) -> None:
        """Release connections and threads. Called once by ``destroy_process_group``."""
