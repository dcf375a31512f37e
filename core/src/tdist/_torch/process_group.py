"""``TorchProcessGroup``: a tdist group as a ``torch.distributed.ProcessGroup``.

It is a Python subclass of torch's ``ProcessGroup`` (torch's supported mechanism for
process groups written in Python: pybind trampolines forward the C++ virtual methods,
so the DDP reducer, ``_broadcast_coalesced`` and the functional collectives reach the
same methods as torch's Python API). Every operation goes to the tdist group's backend
instance through :func:`tdist._dispatch.issue` -- the same path ``tdist.all_reduce``
takes after its argument checks -- so there is one connection mesh, one sequence of
operations and the same work hooks. torch leaves roots, list lengths and sizes to its
backends, so they are checked here as tdist's own functions check them, with what only
tdist knows (operations and devices the backend declares, reductions a dtype cannot
do), before anything is sent.

Ranks in options (``rootRank``, ``dstRank``, ``srcRank``) are group ranks, as in tdist's
backend interface. The tdist side of the group stays reachable as ``tdist_group``, and
the attributes tdist's group has (``ranks``, ``backends``, ``specs``, ``store``,
``timeout``, ``backend_name``) read through.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
import torch.distributed as torch_dist

from .._backend import Backend
from .._coalesced import _pieces
from .._collectives import monitored_barrier
from .._dispatch import StagedWork, contiguous_view, issue
from .._groups import STATE, ProcessGroup
from .._init import destroy_process_group, set_timeout
from .._reduce_op import ReduceOp, Reduction, make_premul_sum
from .._validate import (
    check_all_to_all_splits,
    check_gather_tensor,
    check_root,
    check_same_dtype,
    check_tensor_list,
    check_whole,
)
from .._work import Work
from ..reduction import check_reduction
from .features import features
from .work import BridgeWork, all_of

__all__ = ["TorchProcessGroup", "as_reduction", "checked_reduction"]


class _Finished(BridgeWork):
    """What a blocking call returns once it has waited: torch only calls ``wait()`` on it."""

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        return True


_FINISHED = _Finished(Work.completed("finished"), ())
_OPTIONS_SAY_ASYNC = features().options_say_async

_TORCH_REDUCE_OP = torch_dist.ReduceOp
_RED: Any = _TORCH_REDUCE_OP.RedOpType  # pybind enum: torch's stubs do not list its members
_PLAIN = {
    _RED.SUM: ReduceOp.SUM,
    _RED.PRODUCT: ReduceOp.PRODUCT,
    _RED.MIN: ReduceOp.MIN,
    _RED.MAX: ReduceOp.MAX,
    _RED.BAND: ReduceOp.BAND,
    _RED.BOR: ReduceOp.BOR,
    _RED.BXOR: ReduceOp.BXOR,
    _RED.AVG: ReduceOp.AVG,
}
# Keyed by the operator's integer value: hashing pybind's enum, or reading ReduceOp.op,
# costs about a microsecond, while hash(ReduceOp) is that integer (checked here).
_REDUCTIONS = {kind.value: Reduction(op) for kind, op in _PLAIN.items()}
_PREMUL_SUM = _RED.PREMUL_SUM.value
_HASH_IS_KIND = all(hash(_TORCH_REDUCE_OP(kind)) == kind.value for kind in _PLAIN)
#: (operator value, dtype) -> the Reduction check_reduction accepted for that dtype.
_ACCEPTED: dict[tuple[int, torch.dtype], Reduction] = {}


def _kind(op: Any) -> int:
    """The integer value of torch's ``ReduceOp`` (or ``ReduceOp.RedOpType``) ``op``."""
    if _HASH_IS_KIND:
        return hash(op)
    inner: Any = op.op if type(op) is _TORCH_REDUCE_OP else op  # type: ignore[attr-defined]  # not in the stubs
    return inner.value


def as_reduction(op: Any) -> Reduction:
    """tdist's :class:`Reduction` for torch's ``ReduceOp`` (an options' ``reduceOp``, a
    ``ReduceOp.SUM``-style member, or ``_make_nccl_premul_sum(factor)``)."""
    kind = _kind(op)
    reduction = _REDUCTIONS.get(kind)
    if reduction is not None:
        return reduction
    if kind == _PREMUL_SUM:
        return make_premul_sum(op.factor)
    raise ValueError(f"tdist: torch reduction {op!r} has no tdist equivalent")


def checked_reduction(opts: Any, dtype: torch.dtype, operation: str) -> Reduction:
    """The reduction of ``opts`` (SUM without options), checked against ``dtype`` before
    anything is sent (a TypeError for a combination the dtype cannot do)."""
    op = opts.reduceOp if opts is not None else _RED.SUM
    key = (_kind(op), dtype)
    reduction = _ACCEPTED.get(key)
    if reduction is None:
        reduction = as_reduction(op)
        check_reduction(reduction, dtype, operation)
        if reduction.factor is None:
            _ACCEPTED[key] = reduction
    return reduction


def _device(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.is_cpu else tensor.device.type


_T = TypeVar("_T")


def _one(tensors: Sequence[_T], operation: str) -> _T:
    if len(tensors) != 1:
        raise ValueError(f"{operation}: tdist's groups take one tensor per call, got {len(tensors)}")
    return tensors[0]


def _timeout(opts: Any) -> Optional[timedelta]:
    """An options' timeout, None when unset (torch's "unset" is negative)."""
    timeout = getattr(opts, "timeout", None)
    return timeout if timeout is not None and timeout > timedelta(0) else None


def _destroy_from_torch(pg: ProcessGroup) -> None:
    """torch.distributed destroyed ``pg``'s mirror: destroy the tdist group."""
    if pg is STATE.world:
        destroy_process_group()
    elif pg in STATE.groups:
        destroy_process_group(pg)
    else:
        pg.shutdown()  # a group torch made while tdist's default group was not torch's


class TorchProcessGroup(torch_dist.ProcessGroup):
    """torch.distributed's view of the tdist group ``group``; ``backend_name`` is what
    torch reports (``tdist-tcp``)."""

    def __init__(self, group: ProcessGroup, backend_name: str) -> None:
        super().__init__(group.rank, group.size)  # type: ignore[call-arg]  # the stubs list only (store, rank, size)
        self.tdist_group = group
        self._backend_name = backend_name
        self.closing = False
        self._in_flight: dict[int, tuple] = {}
        self._group_name = ""
        self._group_desc = ""
        self._device_list = [torch.device(d) for d in group.backends]

    def __repr__(self) -> str:
        g = self.tdist_group
        return (
            f"<ProcessGroup {g.name!r} ranks={g.ranks} backend={g.backend_name!r} "
            f"(tdist, torch: {self._backend_name!r})>"
        )

    # ------------------------------------------------------------- identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return self._backend_name

    # torch keeps a group's name and description on its C++ backends; this group has none.
    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        self._group_desc = desc

    _set_group_name = setGroupName
    _set_group_desc = setGroupDesc

    @property
    def group_name(self) -> str:  # type: ignore[override]  # torch's GroupName is a str
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the group serves (torch picks the device of object collectives from them)."""
        return list(self._device_list)

    def _get_backend(self, device: Any) -> "TorchProcessGroup":  # type: ignore[override]  # torch: a Backend
        """The group is its own backend for every device it serves (torch's Python-backend
        convention: a ProcessGroup subclass has no C++ backends registered on it)."""
        kind = torch.device(device).type  # "cpu", "cuda:0", a torch.device
        if kind not in self.tdist_group.backends:
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self

    # tdist's view of the group, for programs that use the group with tdist's API.
    @property
    def ranks(self) -> list[int]:
        return self.tdist_group.ranks

    @property
    def backends(self) -> dict[str, Backend]:
        return self.tdist_group.backends

    @property
    def specs(self) -> dict[str, Any]:
        return self.tdist_group.specs

    @property
    def store(self) -> Any:
        return self.tdist_group.store

    @property
    def timeout(self) -> timedelta:
        return self.tdist_group.timeout

    @property
    def backend_name(self) -> str:
        return self.tdist_group.backend_name

    def set_timeout(self, timeout: timedelta) -> None:
        set_timeout(timeout, self.tdist_group)

    # ------------------------------------------------------------- plumbing
    def _run(
        self,
        operation: str,
        device: str,
        call: Callable[[Backend], Work],
        outputs: Sequence[Any],
        tensors: Sequence[torch.Tensor],
        copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
        opts: Any = None,
        *,
        reduction: Any = None,
        root: Optional[int] = None,
        peer: Optional[int] = None,
        tag: Optional[int] = None,
    ) -> BridgeWork:
        """Issue ``call`` on the tdist group. torch's blocking calls (``opts.asyncOp`` False:
        torch waits at once and drops the Work) wait here and get a shared finished Work
        (where torch's options have no ``asyncOp``, torch waits on the returned Work).
        ``reduction``, ``root``/``peer`` (group ranks) and ``tag`` describe it to the work hooks."""
        work = issue(self.tdist_group, operation, device, call, True, copies, tensors, reduction, root, peer, tag)
        assert work is not None
        if _OPTIONS_SAY_ASYNC and opts is not None and not opts.asyncOp:
            work.wait()
            return _FINISHED
        return self._bridge(work, outputs, tensors)

    def _bridge(self, work: Work, outputs: Sequence[Any], tensors: Sequence[Any] = ()) -> BridgeWork:
        """torch's Work for ``work``. Until it completes the group holds it and its tensors:
        torch's callers may drop a Work they never wait for (DDP's join check does), and a
        backend may still be writing into those tensors."""
        if not work.is_completed():
            key = id(work)
            self._in_flight[key] = (work, outputs, tensors)

            def _forget(_done: Work) -> None:
                self._in_flight.pop(key, None)

            work.add_done_callback(_forget)
        return BridgeWork(work, outputs)

    def _each(self, operation: str, works: list[Work], outputs: Sequence[Any]) -> BridgeWork:
        return self._bridge(all_of(works, operation), outputs)

    # ------------------------------------------------------------- collectives
    # torch checks less than tdist's API does (it leaves roots, list lengths and sizes to
    # its backends), so the arguments are checked here as tdist.all_gather & co. check them.
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:  # type: ignore[override]
        # The hot path (DDP's buckets, every all_reduce): the helpers inlined.
        tensor = tensors[0] if len(tensors) == 1 else _one(tensors, "all_reduce")
        reduction = checked_reduction(opts, tensor.dtype, "all_reduce")
        copies: list = []
        t = tensor if tensor.is_contiguous() else contiguous_view(tensor, copies, output=True)
        return self._run(
            "all_reduce",
            "cpu" if tensor.is_cpu else tensor.device.type,
            lambda b: b.all_reduce(t, reduction),
            tensors,
            (tensor,),
            copies,
            opts,
            reduction=reduction,
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:
        checked = check_tensor_list("all_reduce_coalesced", "tensors", tensors, same_numel=False)
        reduction = checked_reduction(opts, checked[0].dtype, "all_reduce_coalesced")
        flat = torch.cat([t.reshape(-1) for t in checked])
        call = lambda b: b.all_reduce(flat, reduction)  # noqa: E731
        work = issue(self.tdist_group, "all_reduce", _device(flat), call, True, (), (flat,), reduction)
        assert work is not None
        return self._bridge(StagedWork(work, list(zip(checked, _pieces(flat, checked)))), tensors, (flat,))

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:  # type: ignore[override]
        tensor = _one(tensors, "broadcast")
        root = check_root("broadcast", self.tdist_group, "src", opts.rootRank if opts is not None else 0)
        copies: list = []
        t = contiguous_view(tensor, copies, output=True)
        call = lambda b: b.broadcast(t, root)  # noqa: E731
        return self._run("broadcast", _device(tensor), call, tensors, (tensor,), copies, opts, root=root)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> BridgeWork:  # type: ignore[override]
        tensor = _one(tensors, "reduce")
        reduction = checked_reduction(opts, tensor.dtype, "reduce")
        root = check_root("reduce", self.tdist_group, "dst", opts.rootRank if opts is not None else 0)
        copies: list = []
        t = contiguous_view(tensor, copies, output=True)
        call = lambda b: b.reduce(t, root, reduction)  # noqa: E731
        return self._run(
            "reduce", _device(tensor), call, tensors, (tensor,), copies, opts, reduction=reduction, root=root
        )

    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> BridgeWork:
        tensor = _one(input_tensors, "all_gather")
        outputs = check_tensor_list(
            "all_gather", "tensor_list", _one(output_tensors, "all_gather"), self.tdist_group.size, like=tensor
        )
        copies: list = []
        staged = [contiguous_view(o, copies, output=True) for o in outputs]
        t = contiguous_view(tensor, None, output=False)
        return self._run(
            "all_gather", _device(tensor), lambda b: b.all_gather(staged, t), output_tensors, (tensor,), copies, opts
        )

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> BridgeWork:
        check_same_dtype("all_gather_into_tensor", "output_tensor", output, "input_tensor", input)
        check_whole("all_gather_into_tensor", "output_tensor", output, input, self.tdist_group.size)
        copies: list = []
        out = contiguous_view(output, copies, output=True)
        inp = contiguous_view(input, None, output=False)
        return self._run(
            "all_gather_into_tensor",
            _device(input),
            lambda b: b.all_gather_into_tensor(out, inp),
            [output],
            (input,),
            copies,
            opts,
        )

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        """``output_lists[r][i]`` receives rank r's ``input_list[i]``: one all_gather per input."""
        if len(output_lists) != self.tdist_group.size:
            raise ValueError(
                f"all_gather_coalesced: output_tensor_lists has {len(output_lists)} lists, "
                f"the group {self.tdist_group.size} ranks"
            )
        works = []
        for i, tensor in enumerate(input_list):
            outputs = [per_rank[i] for per_rank in output_lists]
            works.append(self.allgather([outputs], [tensor], None).tdist_work)
        return self._each("all_gather_coalesced", works, output_lists)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        works = [self.all_gather_single(o, i, None).tdist_work for o, i in zip(outputs, inputs)]
        return self._each("all_gather_into_tensor_coalesced", works, outputs)

    def _root_list(
        self, operation: str, name: str, lists: Sequence[Any], root: int, like: torch.Tensor, role: str
    ) -> Optional[list[torch.Tensor]]:
        """The root's list of gather/scatter (torch passes ``[list]``), checked; None on the
        other ranks, where torch passes an empty one."""
        pg = self.tdist_group
        if pg.rank == root:
            return check_tensor_list(operation, name, _one(lists, operation), pg.size, like=like)
        if any(lists):
            raise ValueError(
                f"{operation}: {name} must be empty on non-{role} ranks (this is rank {pg.ranks[pg.rank]})"
            )
        return None

    def gather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> BridgeWork:
        tensor = _one(input_tensors, "gather")
        root = check_root("gather", self.tdist_group, "dst", opts.rootRank if opts is not None else 0)
        outputs = self._root_list("gather", "gather_list", output_tensors, root, tensor, "destination")
        copies: list = []
        staged = None if outputs is None else [contiguous_view(o, copies, output=True) for o in outputs]
        t = contiguous_view(tensor, None, output=False)
        call = lambda b: b.gather(t, staged, root)  # noqa: E731
        return self._run("gather", _device(tensor), call, output_tensors, (tensor,), copies, opts, root=root)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> BridgeWork:
        """torch 2.14's ``gather_single``: ``output`` on the root (torch passes an empty
        placeholder elsewhere) receives every rank's ``input`` in rank order."""
        pg = self.tdist_group
        root = check_root("gather_single", pg, "dst", opts.rootRank if opts is not None else 0)
        out = check_gather_tensor("gather_single", output, input, pg.size) if pg.rank == root else None
        t = contiguous_view(input, None, output=False)
        call = lambda b: b.gather_into_tensor(t, out, root)  # noqa: E731
        return self._run("gather", _device(input), call, [output], (input,), (), opts, root=root)

    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> BridgeWork:
        tensor = _one(output_tensors, "scatter")
        root = check_root("scatter", self.tdist_group, "src", opts.rootRank if opts is not None else 0)
        checked = self._root_list("scatter", "scatter_list", input_tensors, root, tensor, "source")
        inputs = None if checked is None else [contiguous_view(i, None, output=False) for i in checked]
        copies: list = []
        t = contiguous_view(tensor, copies, output=True)
        call = lambda b: b.scatter(t, inputs, root)  # noqa: E731
        return self._run("scatter", _device(tensor), call, output_tensors, (tensor,), copies, opts, root=root)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> BridgeWork:
        output = _one(output_tensors, "reduce_scatter")
        reduction = checked_reduction(opts, output.dtype, "reduce_scatter")
        inputs = check_tensor_list(
            "reduce_scatter", "input_list", _one(input_tensors, "reduce_scatter"), self.tdist_group.size, like=output
        )
        copies: list = []
        out = contiguous_view(output, copies, output=True)
        staged = [contiguous_view(i, None, output=False) for i in inputs]
        return self._run(
            "reduce_scatter",
            _device(output),
            lambda b: b.reduce_scatter(out, staged, reduction),
            output_tensors,
            (output,),
            copies,
            opts,
            reduction=reduction,
        )

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> BridgeWork:
        check_same_dtype("reduce_scatter_tensor", "output", output, "input", input)
        reduction = checked_reduction(opts, output.dtype, "reduce_scatter_tensor")
        check_whole("reduce_scatter_tensor", "input", input, output, self.tdist_group.size)
        copies: list = []
        out = contiguous_view(output, copies, output=True)
        inp = contiguous_view(input, None, output=False)
        return self._run(
            "reduce_scatter_tensor",
            _device(output),
            lambda b: b.reduce_scatter_tensor(out, inp, reduction),
            [output],
            (input,),
            copies,
            opts,
            reduction=reduction,
        )

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        works = [self.reduce_scatter_single(o, i, opts).tdist_work for o, i in zip(outputs, inputs)]
        return self._each("reduce_scatter_tensor_coalesced", works, outputs)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> BridgeWork:
        check_same_dtype("all_to_all_single", "output", output, "input", input)
        out_splits, in_splits = check_all_to_all_splits(
            output, input, list(output_split_sizes), list(input_split_sizes), self.tdist_group.size
        )
        copies: list = []
        out = contiguous_view(output, copies, output=True)
        inp = contiguous_view(input, None, output=False)
        return self._run(
            "all_to_all_single",
            _device(input),
            lambda b: b.all_to_all_single(out, inp, out_splits, in_splits),
            [output],
            (input,),
            copies,
            opts,
        )

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> BridgeWork:
        size = self.tdist_group.size
        inputs = check_tensor_list("all_to_all", "input_tensor_list", input_tensors, size, same_numel=False)
        outputs = check_tensor_list(
            "all_to_all", "output_tensor_list", output_tensors, size, like=inputs[0], same_numel=False
        )
        copies: list = []
        outs = [contiguous_view(o, copies, output=True) for o in outputs]
        ins = [contiguous_view(i, None, output=False) for i in inputs]
        return self._run(
            "all_to_all",
            _device(inputs[0]),
            lambda b: b.all_to_all(outs, ins),
            output_tensors,
            input_tensors,
            copies,
            opts,
        )

    def barrier(self, opts: Any = None) -> BridgeWork:
        device = getattr(opts, "device", None)
        served = self.tdist_group.backends
        if device is not None and device.type in served:
            kind = device.type
        else:
            kind = "cpu" if "cpu" in served else next(iter(served))
        work = issue(self.tdist_group, "barrier", kind, lambda b: b.barrier(), True)
        assert work is not None
        timeout = _timeout(opts)
        if timeout is not None:
            work.default_timeout = timeout.total_seconds()
        return self._bridge(work, [])

    def monitored_barrier(self, timeout: Optional[timedelta] = None, wait_all_ranks: bool = False) -> None:
        monitored_barrier(self, timeout, wait_all_ranks)

    # ------------------------------------------------------------- point-to-point
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> BridgeWork:  # noqa: N803
        tensor = _one(tensors, "send")
        dst = check_root("send", self.tdist_group, "dst", dstRank, allow_self=False)
        t = contiguous_view(tensor, None, output=False)
        return self._run("send", _device(tensor), lambda b: b.send(t, dst, tag), tensors, (tensor,), peer=dst, tag=tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> BridgeWork:  # noqa: N803
        tensor = _one(tensors, "recv")
        src = check_root("recv", self.tdist_group, "src", srcRank, allow_self=False)
        copies: list = []
        t = contiguous_view(tensor, copies, output=True)
        call = lambda b: b.recv(t, src, tag)  # noqa: E731
        return self._run("recv", _device(tensor), call, tensors, (tensor,), copies, peer=src, tag=tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> BridgeWork:
        tensor = _one(tensors, "recv")
        self.tdist_group.backend_for(_device(tensor), "recv_anysource")
        if self.tdist_group.size == 1:
            raise ValueError("recv: src=None in a group of one rank: there is no other rank to receive from")
        copies: list = []
        t = contiguous_view(tensor, copies, output=True)
        return self._run("recv", _device(tensor), lambda b: b.recv(t, None, tag), tensors, (tensor,), copies, tag=tag)

    # ------------------------------------------------------------- coalescing
    def _start_coalescing(self, device: Any) -> None:
        """Nothing to do: torch's coalescing manager then calls the ``*_coalesced`` forms."""

    def _end_coalescing(self, device: Any) -> BridgeWork:
        return BridgeWork(Work.completed("coalesced"), [])

    # ------------------------------------------------------------- lifetime
    def shutdown(self) -> None:
        """Called by ``torch.distributed.destroy_process_group``: tear the tdist group down
        too (once; a tdist-side destroy marks the group ``closing`` first)."""
        if self.closing:
            return
        self.closing = True
        _destroy_from_torch(self.tdist_group)

    def abort(self) -> None:
        """torch's ``ProcessGroup.abort()``: the tdist group's :meth:`~tdist.ProcessGroup.abort`
        (pending operations fail here and, through the backend, on the peers), then destroy it."""
        if not self.closing:
            self.tdist_group.abort()
        self.shutdown()

    # torch 2.x's older spellings of the same operations.
    _allgather_base = all_gather_single
    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]
    alltoall_base = all_to_all_single  # type: ignore[assignment]
    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]
