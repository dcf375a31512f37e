"""The ``mpi`` backend: every operation is one nonblocking MPI call on the group's
communicator (Isend/Irecv, Ibcast, Iallreduce, ...), returned as an :class:`MPIWork`.

Buffers are mpi4py buffers over the tensors' memory (zero-copy, buffer protocol);
list-form collectives stage through one contiguous buffer. Reductions MPI cannot
express directly are built around it: AVG = SUM then divide, PREMUL_SUM = multiply
then SUM, float16/bfloat16 reduced in float32 staging buffers.
"""

from __future__ import annotations

import math
import weakref
from datetime import timedelta
from itertools import accumulate
from typing import Any, Callable, Optional, Sequence

import torch

from tdist.plugin import Backend, DistBackendError, ReduceOp, Reduction, Work, finalize_, premul_factor

from ._dtypes import Plan, Tables, buffer
from ._runtime import Runtime, check_collectives_default, mpi_error, note_ranks_lost, runtime
from ._ulfm import Failures, communicator_of
from ._ulfm import problem as ulfm_problem
from ._work import MPIWork

__all__ = ["MPIBackend", "create_backend"]

#: AVG as the backend finishes it: the division by the group size after MPI's SUM.
_AVG = Reduction(ReduceOp.AVG)

MPIException: Any = None
_tables: Optional[Tables] = None
#: tdist global rank -> MPI_COMM_WORLD rank, once shrink_group renumbered the default
#: group (None: the same numbers). Groups are communicators over MPI_COMM_WORLD's ranks.
_world_rank_of: Optional[dict[int, int]] = None


def _bind(rt: Runtime) -> Tables:
    """Module-level names that need the loaded MPI (done once)."""
    global MPIException, _tables
    if _tables is None:
        MPIException = rt.MPI.Exception
        _tables = Tables(rt.MPI)
    return _tables


def _offsets(counts: Sequence[int]) -> list[int]:
    return [0, *accumulate(counts)][:-1]


def _flat_cat(tensors: Sequence[torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    out = torch.cat([t.detach().reshape(-1) for t in tensors])
    return out if dtype is None or out.dtype == dtype else out.to(dtype)


class MPIBackend(Backend):
    """One process group over one MPI communicator (group rank == communicator rank).

    ``world_ranks``: the MPI_COMM_WORLD rank of each group rank; ``global_ranks``: the
    tdist global rank of each (both default to ``0 .. size-1``); ``ft``: MPI's fault
    tolerance (ULFM) is on: a lost member revokes the communicator and is named in the
    error, ``abort`` revokes it, ``shrink`` builds the survivors' communicator."""

    name = "mpi"

    def __init__(
        self,
        rt: Runtime,
        comm: Any,
        rank: int,
        size: int,
        timeout: timedelta,
        check_collectives: bool = False,
        *,
        world_ranks: Optional[Sequence[int]] = None,
        global_ranks: Optional[Sequence[int]] = None,
        ft: bool = False,
    ) -> None:
        super().__init__(rank, size, timeout)
        MPI = rt.MPI
        self._rt = rt
        self._comm = comm
        self._lock = rt.lock
        self._wlock = None if rt.multiple else rt.lock  # what MPIWork takes around Test()
        self._t = timeout.total_seconds()
        self._tables = _bind(rt)
        self._plans: dict[Any, Plan] = {}
        self._IN_PLACE = MPI.IN_PLACE
        self._ANY_SOURCE = MPI.ANY_SOURCE
        self._Status = MPI.Status
        tag_ub = comm.Get_attr(MPI.TAG_UB)
        self._tag_ub = int(tag_ub) if tag_ub else 32767
        self.check_collectives = check_collectives
        self._works: "weakref.WeakSet[MPIWork]" = weakref.WeakSet()  # failed by shutdown if still pending
        self._world_ranks = list(world_ranks) if world_ranks is not None else list(range(size))
        self._global_ranks = list(global_ranks) if global_ranks is not None else list(range(size))
        self._failures = Failures(rt, comm, self._global_ranks) if ft else None
        #: an MPI.Exception of an operation as the tdist error to raise
        self._convert: Callable[[str, BaseException], BaseException] = (
            self._failures.error if self._failures is not None else mpi_error
        )
        #: whether a member revoked the communicator (with fault tolerance)
        self._revoked: Optional[Callable[[], bool]] = self._failures.is_revoked if self._failures is not None else None

    # ------------------------------------------------------------------ helpers
    def _issue(
        self,
        operation: str,
        call: Callable[[], Any],
        outputs: Sequence[Any] = (),
        finalize: Optional[Callable[[], None]] = None,
        keep: Any = None,
        status: Any = None,
    ) -> Work:
        try:
            with self._lock:
                req = call()
        except MPIException as exc:
            raise self._convert(operation, exc) from exc
        work = MPIWork(
            operation, req, self._t, outputs, finalize, keep, status, self._wlock, self._convert, self._revoked
        )
        self._works.add(work)
        return work

    def _plan(self, dtype: torch.dtype, op: Reduction, operation: str) -> Plan:
        key = (dtype, id(op.op))  # ReduceOp members are singletons; hashing an Enum runs Python code
        plan = self._plans.get(key)
        if plan is None:
            plan = self._tables.plan(dtype, op, operation)
            if op.op is not ReduceOp.PREMUL_SUM:  # PREMUL_SUM's validity depends on its factor
                self._plans[key] = plan
        return plan

    def _check_tag(self, operation: str, tag: int) -> None:
        if not 0 <= tag <= self._tag_ub:
            raise ValueError(f"{operation}: tag {tag} is outside the range MPI allows (0..{self._tag_ub})")

    # ------------------------------------------------------------ point-to-point
    # ``outputs`` and ``keep`` hold every tensor MPI reads or writes until the work
    # completes (the buffers are bare addresses and do not keep them alive).
    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        if not 0 <= tag <= self._tag_ub:
            self._check_tag("send", tag)
        buf = buffer(tensor)
        dt = self._tables.xfer(tensor.dtype)
        comm = self._comm
        return self._issue("send", lambda: comm.Isend([buf, dt], dst, tag), (tensor,))

    def recv(self, tensor: torch.Tensor, src: Optional[int], tag: int) -> Work:
        if not 0 <= tag <= self._tag_ub:
            self._check_tag("recv", tag)
        buf = buffer(tensor)
        dt = self._tables.xfer(tensor.dtype)
        source = self._ANY_SOURCE if src is None else src
        comm = self._comm
        status = self._Status()
        expected = tensor.nbytes // dt.Get_size()

        def check_size() -> None:  # a larger message fails in MPI itself (MPI_ERR_TRUNCATE)
            got = status.Get_count(dt)
            if got != expected:
                raise DistBackendError(
                    f"mpi backend: recv: the message from group rank {status.Get_source()} (tag {status.Get_tag()}) "
                    f"holds {got} items of {dt.Get_name() or 'its type'}, the receive buffer {expected}"
                )

        return self._issue("recv", lambda: comm.Irecv([buf, dt], source, tag), (tensor,), check_size, status=status)

    # --------------------------------------------------------------- collectives
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        buf = buffer(tensor)
        dt = self._tables.xfer(tensor.dtype)
        comm = self._comm
        return self._issue("broadcast", lambda: comm.Ibcast([buf, dt], src), (tensor,))

    def all_reduce(self, tensor: torch.Tensor, op: Reduction) -> Work:
        plan = self._plans.get((tensor.dtype, id(op.op))) or self._plan(tensor.dtype, op, "all_reduce")
        if plan.direct:  # the hot path: one Iallreduce in place on the tensor's memory
            buf = buffer(tensor)
            try:
                if self._wlock is None:
                    req = self._comm.Iallreduce(self._IN_PLACE, [buf, plan.dt], plan.op)
                else:
                    with self._wlock:
                        req = self._comm.Iallreduce(self._IN_PLACE, [buf, plan.dt], plan.op)
            except MPIException as exc:
                raise self._convert("all_reduce", exc) from exc
            return MPIWork(
                "all_reduce", req, self._t, (tensor,), None, None, None, self._wlock, self._convert, self._revoked
            )
        target = tensor.detach()
        work = target.to(plan.stage) if plan.stage is not None else target
        if plan.premul:
            work.mul_(premul_factor(op.factor, work))
        buf = buffer(work)
        comm, size, in_place = self._comm, self.size, self._IN_PLACE

        def finalize() -> None:
            if plan.avg:
                finalize_(work, _AVG, size)  # integers: truncated, as NCCL
            if work is not target:
                target.copy_(work)

        return self._issue(
            "all_reduce", lambda: comm.Iallreduce(in_place, [buf, plan.dt], plan.op), (tensor,), finalize, work
        )

    def reduce(self, tensor: torch.Tensor, dst: int, op: Reduction) -> Work:
        plan = self._plan(tensor.dtype, op, "reduce")
        root = self.rank == dst
        target = tensor.detach()
        if plan.stage is not None:
            work = target.to(plan.stage)
        elif plan.premul and not root:
            work = target.clone()  # leave a non-root's input as it was
        else:
            work = target
        if plan.premul:
            work.mul_(premul_factor(op.factor, work))
        buf = buffer(work)
        comm, size, in_place = self._comm, self.size, self._IN_PLACE
        if not root:
            return self._issue("reduce", lambda: comm.Ireduce([buf, plan.dt], None, plan.op, dst), (tensor,), keep=work)
        finalize = None
        if plan.avg or work is not target:

            def finalize() -> None:
                if plan.avg:
                    finalize_(work, _AVG, size)  # integers: truncated, as NCCL
                if work is not target:
                    target.copy_(work)

        return self._issue(
            "reduce", lambda: comm.Ireduce(in_place, [buf, plan.dt], plan.op, dst), (tensor,), finalize, work
        )

    def all_gather(self, outputs: Sequence[torch.Tensor], tensor: torch.Tensor) -> Work:
        n = tensor.numel()
        staging = torch.empty(self.size * n, dtype=tensor.dtype, device=tensor.device)
        sbuf, rbuf = buffer(tensor), buffer(staging)
        dt = self._tables.xfer(tensor.dtype)
        comm, size = self._comm, self.size

        def finalize() -> None:
            rows = staging.view(size, n)
            for i, out in enumerate(outputs):
                out.detach().view(-1).copy_(rows[i])

        return self._issue(
            "all_gather", lambda: comm.Iallgather([sbuf, dt], [rbuf, dt]), list(outputs), finalize, (tensor, staging)
        )

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        sbuf, rbuf = buffer(tensor), buffer(output)
        dt = self._tables.xfer(tensor.dtype)
        comm = self._comm
        return self._issue(
            "all_gather_into_tensor", lambda: comm.Iallgather([sbuf, dt], [rbuf, dt]), (output,), keep=tensor
        )

    def gather(self, tensor: torch.Tensor, outputs: Optional[Sequence[torch.Tensor]], dst: int) -> Work:
        sbuf = buffer(tensor)
        dt = self._tables.xfer(tensor.dtype)
        comm = self._comm
        if outputs is None:
            return self._issue("gather", lambda: comm.Igather([sbuf, dt], None, dst), (), keep=tensor)
        n = tensor.numel()
        staging = torch.empty(self.size * n, dtype=tensor.dtype, device=tensor.device)
        rbuf = buffer(staging)
        size = self.size

        def finalize() -> None:
            rows = staging.view(size, n)
            for i, out in enumerate(outputs):
                out.detach().view(-1).copy_(rows[i])

        return self._issue(
            "gather", lambda: comm.Igather([sbuf, dt], [rbuf, dt], dst), list(outputs), finalize, (tensor, staging)
        )

    def scatter(self, tensor: torch.Tensor, inputs: Optional[Sequence[torch.Tensor]], src: int) -> Work:
        rbuf = buffer(tensor)
        dt = self._tables.xfer(tensor.dtype)
        comm = self._comm
        if inputs is None:
            return self._issue("scatter", lambda: comm.Iscatter(None, [rbuf, dt], src), (tensor,))
        send = _flat_cat(inputs)
        sbuf = buffer(send)
        return self._issue("scatter", lambda: comm.Iscatter([sbuf, dt], [rbuf, dt], src), (tensor,), keep=send)

    def reduce_scatter(self, output: torch.Tensor, inputs: Sequence[torch.Tensor], op: Reduction) -> Work:
        plan = self._plan(output.dtype, op, "reduce_scatter")
        send = _flat_cat(inputs, plan.stage)
        if plan.premul:
            send.mul_(premul_factor(op.factor, send))
        return self._reduce_scatter("reduce_scatter", output, send, plan)

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor, op: Reduction) -> Work:
        plan = self._plan(output.dtype, op, "reduce_scatter_tensor")
        send = tensor.detach()
        if plan.stage is not None:
            send = send.to(plan.stage)
            if plan.premul:
                send.mul_(premul_factor(op.factor, send))
        elif plan.premul:
            send = send * premul_factor(op.factor, send)
        return self._reduce_scatter("reduce_scatter_tensor", output, send, plan)

    def _reduce_scatter(self, operation: str, output: torch.Tensor, send: torch.Tensor, plan: Plan) -> Work:
        target = output.detach()
        recv = target if plan.stage is None else torch.empty(output.shape, dtype=plan.stage, device=output.device)
        sbuf, rbuf = buffer(send), buffer(recv)
        comm, size = self._comm, self.size
        finalize = None
        if plan.avg or recv is not target:

            def finalize() -> None:
                if plan.avg:
                    finalize_(recv, _AVG, size)  # integers: truncated, as NCCL
                if recv is not target:
                    target.copy_(recv)

        return self._issue(
            operation,
            lambda: comm.Ireduce_scatter_block([sbuf, plan.dt], [rbuf, plan.dt], plan.op),
            (output,),
            finalize,
            (send, recv),
        )

    def all_to_all(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> Work:
        dtype = inputs[0].dtype
        dt = self._tables.xfer(dtype)
        scounts = [t.numel() for t in inputs]
        rcounts = [t.numel() for t in outputs]
        send = _flat_cat(inputs)
        recv = torch.empty(sum(rcounts), dtype=dtype, device=inputs[0].device)
        sspec = [buffer(send), (scounts, _offsets(scounts)), dt]
        rspec = [buffer(recv), (rcounts, _offsets(rcounts)), dt]
        comm = self._comm

        def finalize() -> None:
            for out, piece in zip(outputs, recv.split(rcounts)):
                out.detach().view(-1).copy_(piece)

        return self._issue("all_to_all", lambda: comm.Ialltoallv(sspec, rspec), list(outputs), finalize, (send, recv))

    def all_to_all_single(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
    ) -> Work:
        dt = self._tables.xfer(tensor.dtype)
        sbuf, rbuf = buffer(tensor), buffer(output)
        comm = self._comm
        first = input_split_sizes[0] if input_split_sizes else 0
        if all(s == first for s in input_split_sizes) and list(output_split_sizes) == list(input_split_sizes):
            call = lambda: comm.Ialltoall([sbuf, dt], [rbuf, dt])  # noqa: E731
        else:
            row = math.prod(tensor.shape[1:])
            scounts = [s * row for s in input_split_sizes]
            rcounts = [s * row for s in output_split_sizes]
            sspec = [sbuf, (scounts, _offsets(scounts)), dt]
            rspec = [rbuf, (rcounts, _offsets(rcounts)), dt]
            call = lambda: comm.Ialltoallv(sspec, rspec)  # noqa: E731
        return self._issue("all_to_all_single", call, (output,), keep=tensor)

    def barrier(self) -> Work:
        comm = self._comm
        return self._issue("barrier", lambda: comm.Ibarrier())

    # ---------------------------------------------------------------- lifecycle
    @property
    def comm(self) -> Any:
        """The group's MPI communicator (an mpi4py ``Comm``)."""
        return self._comm

    def set_timeout(self, timeout: timedelta) -> None:
        super().set_timeout(timeout)
        self._t = timeout.total_seconds()

    def abort(self) -> None:
        """With MPI's fault tolerance: revoke the communicator (every member's pending and
        later operations on it fail at once), then release it as :meth:`shutdown` does.
        Without it (the spec declares ``abort`` unsupported): only :meth:`shutdown`."""
        if self._failures is not None:
            self._failures.give_up("aborted the group (group.abort())")
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
        """The survivors' group: a communicator of exactly their MPI ranks, in their order
        (:func:`tdist_mpi._ulfm.communicator_of`); no store. The old communicator is then
        revoked: a rank left out that is still running sees its operations fail."""
        if self._failures is None:  # the spec declared shrink_group unsupported: the core refused already
            raise DistBackendError(f"mpi backend: shrink_group: {ulfm_problem() or 'MPI fault tolerance is off'}")
        global _world_rank_of
        note_ranks_lost()
        if abort:  # SHRINK_ABORT: this group's pending operations fail first, everywhere
            self._failures.give_up("shrank the group (SHRINK_ABORT)")
            self._abandon(DistBackendError(f"mpi backend: group rank {self.rank}'s group was shrunk (SHRINK_ABORT)"))
        world_ranks = [self._world_ranks[r] for r in survivors]
        comm = communicator_of(self._rt, world_ranks, self._t, "shrink_group")
        self._failures.revoke()
        new_rank = list(survivors).index(self.rank)
        if comm.Get_rank() != new_rank:
            comm.Free()
            raise DistBackendError(f"mpi backend: shrink_group: communicator rank {comm.Get_rank()} is not {new_rank}")
        if list(global_ranks) != [self._global_ranks[r] for r in survivors]:  # the default group, renumbered
            _world_rank_of = dict(zip(global_ranks, world_ranks))
        check = options.get("check_collectives")
        return MPIBackend(
            self._rt,
            comm,
            new_rank,
            len(survivors),
            self.timeout,
            bool(check_collectives_default() if check is None else check),
            world_ranks=world_ranks,
            global_ranks=global_ranks,
            ft=True,
        )

    def _abandon(self, error: BaseException) -> None:
        for work in list(self._works):
            work.abandon(error)

    def shutdown(self) -> None:
        """Fail the operations still pending (cancelling receives), then free the communicator."""
        self._abandon(DistBackendError(f"mpi backend: group rank {self.rank}'s process group was destroyed"))
        comm, self._comm = self._comm, None
        MPI = self._rt.MPI
        if comm is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            try:
                with self._lock:
                    comm.Free()
            except MPIException:
                pass

    def __repr__(self) -> str:
        return f"<MPIBackend rank {self.rank}/{self.size} {self._rt.thread_level_name}>"


def create_backend(
    *,
    store: Any = None,
    rank: int,
    world_size: int,
    timeout: timedelta,
    options: Optional[dict] = None,
    global_ranks: Optional[Sequence[int]] = None,
    **_ignored: Any,  # later versions of the factory contract may pass more (e.g. secret=)
) -> MPIBackend:
    """The factory: a communicator over ``global_ranks`` (MPI COMM_WORLD ranks, or the
    ranks they stand for once ``shrink_group`` renumbered the default group).

    The whole world gets ``COMM_WORLD.Dup()``; a subgroup gets
    ``COMM_WORLD.Create_group(group.Incl(ranks))``, collective over its members only, or
    with MPI's fault tolerance on, ``MPI_Comm_create_from_group`` (which works after a
    rank was lost too).
    """
    global _world_rank_of
    rt = runtime()
    MPI = rt.MPI
    _bind(rt)
    ranks = list(global_ranks) if global_ranks is not None else list(range(world_size))
    if len(ranks) != world_size or not 0 <= rank < world_size:
        raise DistBackendError(
            f"mpi backend: rank {rank} / {len(ranks)} global ranks do not match world size {world_size}"
        )
    if len(ranks) == rt.world_size:  # a new default group over every MPI rank: the numbering is MPI's again
        _world_rank_of = None
    mapping = _world_rank_of
    world_ranks = ranks if mapping is None else [mapping.get(r, -1) for r in ranks]
    me = world_ranks[rank]
    if rt.world_size == 1 and len(ranks) > 1:
        raise DistBackendError(
            f"mpi backend: a group of {len(ranks)} ranks, but this process is not part of an MPI job "
            "(MPI_COMM_WORLD has 1 rank); start the program with mpirun -n N"
        )
    if me != rt.world_rank or max(world_ranks) >= rt.world_size or min(world_ranks) < 0:
        raise DistBackendError(
            f"mpi backend: tdist rank {ranks[rank]} is MPI rank {rt.world_rank} of {rt.world_size}; the mpi backend "
            "needs tdist's ranks to be MPI_COMM_WORLD's ranks (use init_method='mpi://', this backend's default; "
            "a process that joins a running job is not part of it)"
        )
    ft = ulfm_problem() is None and rt.world_size > 1
    try:
        if ft and world_ranks != list(range(rt.world_size)):  # also after a loss (see communicator_of)
            comm = communicator_of(rt, world_ranks, timeout.total_seconds(), "new_group")
        else:
            comm = _world_or_subgroup(rt, world_ranks)
    except MPI.Exception as exc:
        raise mpi_error("creating the group's communicator", exc) from exc
    if comm.Get_rank() != rank:
        comm.Free()
        raise DistBackendError(f"mpi backend: communicator rank {comm.Get_rank()} differs from group rank {rank}")
    check = (options or {}).get("check_collectives")
    if check is None:
        check = check_collectives_default()
    return MPIBackend(
        rt, comm, rank, len(ranks), timeout, bool(check), world_ranks=world_ranks, global_ranks=ranks, ft=ft
    )


def _world_or_subgroup(rt: Runtime, world_ranks: list[int]) -> Any:
    """``COMM_WORLD.Dup()`` for the whole world, else ``COMM_WORLD.Create_group`` over
    ``world_ranks`` (collective over them only)."""
    world = rt.world
    with rt.lock:
        if world_ranks == list(range(rt.world_size)):
            comm = world.Dup()
        else:
            world_group = world.Get_group()
            members = world_group.Incl(world_ranks)
            try:
                comm = world.Create_group(members, 0)
            finally:
                members.Free()
                world_group.Free()
        comm.Set_errhandler(rt.MPI.ERRORS_RETURN)
    return comm
