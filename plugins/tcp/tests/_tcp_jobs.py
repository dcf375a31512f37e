"""Job bodies run on every rank, as threads (``run_threads``) or processes (``ProcWorld``).

Each job has the signature ``job(backend, rank, *args)`` and returns plain data
(lists of failure descriptions, timings, error texts) so that process workers can
send it back through a pipe.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from typing import Any

import torch
from tdist import Work
from tdist._errors import DistBackendError, DistBackendTimeoutError
from tdist._reduce_op import ReduceOp, Reduction, make_premul_sum
from tdist.plugin import COLLECTIVES
from tdist.reduction import check_reduction, combine_, finalize_, prescaled

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
]


def reductions() -> list[Reduction]:
    plain = [Reduction(op) for op in ReduceOp if op is not ReduceOp.PREMUL_SUM]
    return plain + [make_premul_sum(2.0), make_premul_sum(torch.tensor([3.0], dtype=torch.float64))]


def make(seed: int, n: int, dtype: torch.dtype, small: bool = False) -> torch.Tensor:
    """Deterministic, exactly representable values (so any reduction order is exact)."""
    base = torch.arange(n, dtype=torch.int64) * 7 + seed * 3
    if dtype == torch.bool:
        return base % 3 == 0
    values = base % 2 + 1 if small else base % 11
    if dtype.is_complex:
        return torch.complex(values.double(), (values % 3).double()).to(dtype)
    return values.to(dtype)


def expected_reduction(size: int, n: int, dtype: torch.dtype, op: Reduction, seed=lambda k: k) -> torch.Tensor:
    small = op.op is ReduceOp.PRODUCT
    acc = prescaled(make(seed(0), n, dtype, small), op).clone()
    for k in range(1, size):
        combine_(acc, prescaled(make(seed(k), n, dtype, small), op), op)
    return finalize_(acc, op, size)


def _valid(op: Reduction, dtype: torch.dtype) -> bool:
    try:
        check_reduction(op, dtype, "test")
        return True
    except (TypeError, ValueError):
        return False


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


class Blocking:
    """A backend used as a caller that waits uses it (``tdist.all_reduce(t)`` without
    ``async_op``): every collective runs through ``run_blocking`` (the tcp backend's
    quick path: in the calling thread, one C call where it can) and returns a completed
    Work, so that the suites' ``.wait()`` still reads. Anything else is the backend's."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if name not in COLLECTIVES:
            return attr

        def call(*args: Any) -> Work:
            self._backend.run_blocking(lambda b: getattr(b, name)(*args), None)
            return Work.completed(f"blocking {name}")

        return call


# ------------------------------------------------------------------ suites
def all_reduce_suite(b: Any, rank: int, sizes: tuple = (5, 1000)) -> list[str]:
    """Every valid (op, dtype) at each size; returns failure descriptions."""
    p = b.size
    failures = []
    for n in sizes:
        for dtype in DTYPES:
            for op in reductions():
                if not _valid(op, dtype):
                    continue
                small = op.op is ReduceOp.PRODUCT
                t = make(rank, n, dtype, small)
                b.all_reduce(t, op).wait()
                want = expected_reduction(p, n, dtype, op)
                if not _same(t, want):
                    failures.append(f"all_reduce {op.name} {dtype} n={n}: {t[:6].tolist()} != {want[:6].tolist()}")
    return failures


def collectives_suite(b: Any, rank: int, n: int = 37) -> list[str]:
    """broadcast, reduce, all_gather(+into_tensor), gather, scatter, reduce_scatter(+tensor),
    all_to_all(+single), barrier, async issue order, non-contiguous tensors."""
    p = b.size
    f: list[str] = []
    SUM, MAX = Reduction(ReduceOp.SUM), Reduction(ReduceOp.MAX)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex128):
        for root in range(p):
            t = make(rank, n, dtype)
            b.broadcast(t, root).wait()
            if not _same(t, make(root, n, dtype)):
                f.append(f"broadcast {dtype} root {root}")
        op = MAX if dtype in (torch.bool, torch.bfloat16) else SUM
        if dtype.is_complex:
            op = SUM
        for root in range(p):
            t = make(rank, n, dtype)
            b.reduce(t, root, op).wait()
            if rank == root and not _same(t, expected_reduction(p, n, dtype, op)):
                f.append(f"reduce {dtype} root {root}")
        outs = [torch.empty(n, dtype=dtype) for _ in range(p)]
        b.all_gather(outs, make(rank, n, dtype)).wait()
        if not all(_same(outs[i], make(i, n, dtype)) for i in range(p)):
            f.append(f"all_gather {dtype}")
        big = torch.empty(p * n, dtype=dtype)
        b.all_gather_into_tensor(big, make(rank, n, dtype)).wait()
        if not _same(big, torch.cat([make(i, n, dtype) for i in range(p)])):
            f.append(f"all_gather_into_tensor {dtype}")
        for root in {0, p - 1}:
            outs = [torch.empty(n, dtype=dtype) for _ in range(p)] if rank == root else None
            b.gather(make(rank, n, dtype), outs, root).wait()
            if rank == root and not all(_same(outs[i], make(i, n, dtype)) for i in range(p)):
                f.append(f"gather {dtype} root {root}")
            t = torch.empty(n, dtype=dtype)
            ins = [make(100 + i, n, dtype) for i in range(p)] if rank == root else None
            b.scatter(t, ins, root).wait()
            if not _same(t, make(100 + rank, n, dtype)):
                f.append(f"scatter {dtype} root {root}")
        # rank k's inputs[j] = make(10 k + j): output of rank r = reduction over k of make(10 k + r)
        ins = [make(10 * rank + j, n, dtype) for j in range(p)]
        keep = [x.clone() for x in ins]
        out = torch.empty(n, dtype=dtype)
        b.reduce_scatter(out, ins, op).wait()
        want = expected_reduction(p, n, dtype, op, seed=lambda k: 10 * k + rank)
        if not _same(out, want) or not all(_same(a, c) for a, c in zip(ins, keep)):
            f.append(f"reduce_scatter {dtype}")
        src = torch.cat(ins)
        out = torch.empty(n, dtype=dtype)
        b.reduce_scatter_tensor(out, src, op).wait()
        if not _same(out, want) or not _same(src, torch.cat(keep)):
            f.append(f"reduce_scatter_tensor {dtype}")
        outs = [torch.empty(n + j, dtype=dtype) for j in range(p)]
        ins = [make(10 * rank + j, n + rank, dtype) for j in range(p)]
        b.all_to_all(outs, ins).wait()
        if not all(_same(outs[j], make(10 * j + rank, n + j, dtype)) for j in range(p)):
            f.append(f"all_to_all {dtype}")
        # all_to_all_single with uneven splits: rank k sends (k + j + 1) rows to rank j
        in_splits = [rank + j + 1 for j in range(p)]
        out_splits = [j + rank + 1 for j in range(p)]
        src = torch.cat([make(10 * rank + j, s, dtype) for j, s in enumerate(in_splits)])
        out = torch.empty(sum(out_splits), dtype=dtype)
        b.all_to_all_single(out, src, out_splits, in_splits).wait()
        if not _same(out, torch.cat([make(10 * j + rank, s, dtype) for j, s in enumerate(out_splits)])):
            f.append(f"all_to_all_single {dtype}")
    b.barrier().wait()
    # async ops complete in issue order whatever order they are waited in
    ts = [make(rank + k, n, torch.float32) for k in range(4)]
    works = [b.all_reduce(t, SUM) for t in ts]
    for w in reversed(works):
        w.wait()
    for k, t in enumerate(ts):
        if not _same(t, expected_reduction(p, n, torch.float32, SUM, seed=lambda i, k=k: i + k)):
            f.append(f"async all_reduce #{k}")
    # non-contiguous tensors
    base = torch.zeros(n, 3)
    col = base[:, 1]
    col.copy_(make(rank, n, torch.float32))
    b.all_reduce(col, SUM).wait()
    if not _same(col.contiguous(), expected_reduction(p, n, torch.float32, SUM)) or base[:, 0].abs().sum() != 0:
        f.append("all_reduce non-contiguous")
    # 0-dim and empty tensors
    z = torch.tensor(float(rank + 1))
    b.all_reduce(z, SUM).wait()
    if z.item() != p * (p + 1) / 2:
        f.append("all_reduce 0-dim")
    e = torch.empty(0)
    b.all_reduce(e, SUM).wait()
    b.broadcast(e, 0).wait()
    return f


def bitwise_digest(b: Any, rank: int, n: int, seed: int) -> str:
    """all_reduce and reduce_scatter random floats (SUM and AVG, float32 and bfloat16);
    digest of the results (reduce_scatter's all-gathered, so every rank digests the same)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    h = hashlib.sha256()
    for dtype in (torch.float32, torch.bfloat16):
        for op in (Reduction(ReduceOp.SUM), Reduction(ReduceOp.AVG), make_premul_sum(0.3)):
            t = torch.randn(n, generator=g).to(dtype)
            b.all_reduce(t, op).wait()
            h.update(t.view(torch.uint8).numpy().tobytes())
            ins = [torch.randn(n // b.size + 1, generator=g).to(dtype) for _ in range(b.size)]
            mine = torch.empty_like(ins[0])
            b.reduce_scatter(mine, ins, op).wait()
            every = [torch.empty_like(mine) for _ in range(b.size)]
            b.all_gather(every, mine).wait()
            h.update(torch.cat(every).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def p2p_suite(b: Any, rank: int) -> list[str]:
    """Order, tags, any-source, mixed with collectives; rank 0 talks to every other rank."""
    p = b.size
    f: list[str] = []
    if rank == 0:
        for peer in range(1, p):
            for k in range(5):
                b.send(make(peer * 100 + k, 9, torch.float32), peer, 0).wait()
            b.send(torch.full((3,), 7.0), peer, 7).wait()  # tag 7 sent first ...
            b.send(torch.full((3,), 5.0), peer, 5).wait()  # ... received second
            b.send(make(peer, 4, torch.bfloat16), peer, 1).wait()
            b.send(torch.tensor([True, False, True]), peer, 2).wait()
        seen = set()
        for _ in range(p - 1):
            t = torch.empty(2, dtype=torch.int64)
            w = b.recv(t, None, 3)
            w.wait()
            src = w.source_rank()
            if t.tolist() != [src, src * 2]:
                f.append(f"any-source from {src}: {t.tolist()}")
            seen.add(src)
        if seen != set(range(1, p)):
            f.append(f"any-source senders {seen}")
    else:
        got = []
        works = []
        for _ in range(5):
            t = torch.empty(9)
            works.append((b.recv(t, 0, 0), t))
        for k, (w, t) in enumerate(works):
            w.wait()
            if not _same(t, make(rank * 100 + k, 9, torch.float32)):
                got.append(k)
        if got:
            f.append(f"in-order recv mismatch at {got}")
        t5 = torch.empty(3)
        b.recv(t5, 0, 5).wait()
        t7 = torch.empty(3)
        b.recv(t7, 0, 7).wait()
        if t5.tolist() != [5.0] * 3 or t7.tolist() != [7.0] * 3:
            f.append(f"tag matching {t5.tolist()} {t7.tolist()}")
        bf = torch.empty(4, dtype=torch.bfloat16)
        w = b.recv(bf, 0, 1)
        w.wait()
        if not _same(bf, make(rank, 4, torch.bfloat16)) or w.source_rank() != 0:
            f.append("bfloat16 recv")
        bo = torch.empty(3, dtype=torch.bool)
        b.recv(bo, 0, 2).wait()
        if bo.tolist() != [True, False, True]:
            f.append("bool recv")
        b.send(torch.tensor([rank, rank * 2]), 0, 3).wait()
    b.barrier().wait()
    return f


# ---------------------------------------------------------------- scenarios
def describe_error(fn) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        fn()
    except BaseException as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "", "", time.monotonic() - start


def mismatch_job(b: Any, rank: int, kind: str, blocking: bool = False) -> tuple:
    """Rank 0 and the others call incompatible collectives; everyone must raise."""
    SUM = Reduction(ReduceOp.SUM)
    if blocking:
        b = Blocking(b)
    if kind == "op":
        body = (
            (lambda: b.broadcast(torch.ones(4), 0).wait())
            if rank == 0
            else (lambda: b.all_reduce(torch.ones(4), SUM).wait())
        )
    elif kind == "size":
        body = lambda: b.all_reduce(torch.ones(4 if rank == 0 else 5), SUM).wait()  # noqa: E731
    elif kind == "dtype":
        body = lambda: b.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int32), SUM).wait()  # noqa
    elif kind == "root":  # every rank believes it is the root
        body = lambda: b.broadcast(torch.ones(4), rank).wait()  # noqa: E731
    else:  # redop
        body = lambda: b.all_reduce(torch.ones(4), SUM if rank == 0 else Reduction(ReduceOp.MAX)).wait()  # noqa
    first = describe_error(body)
    later = describe_error(lambda: b.barrier().wait())
    p2p_later = describe_error(lambda: b.send(torch.ones(1), (rank + 1) % b.size, 0).wait())
    return first, later, p2p_later


def dead_peer_job(b: Any, rank: int, victim: int, how: str) -> Any:
    """``victim`` dies (os._exit) while the others are in an all_reduce; returns the survivors' error.
    ``how`` "exit-cma": after two large all_reduces (the group then reads its peers' memory,
    tdist_tcp.shared.cma), and the survivors' is one too."""
    SUM = Reduction(ReduceOp.SUM)
    b.all_reduce(torch.ones(8), SUM).wait()  # everyone is connected and working
    large = 1 << 18  # 1 MiB of float32: tdist_tcp.shared.cma's
    if how == "exit-cma":
        for _ in range(2):
            b.all_reduce(torch.ones(large), SUM).wait()
    if rank == victim:
        if how == "exit-mid-send":
            threading.Timer(0.3, lambda: os._exit(3)).start()
            while True:  # keep sending large frames until killed
                b.send(torch.ones(1 << 18), (rank + 1) % b.size, 99)
                time.sleep(0.01)
        time.sleep(0.3)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)
    big = torch.ones({"exit-mid-send": 1 << 20, "exit-cma": large}.get(how, 1000))
    first = describe_error(lambda: b.all_reduce(big, SUM).wait())
    later = describe_error(lambda: b.all_reduce(torch.ones(2), SUM).wait())
    return first, later


def wait_forever_job(b: Any, rank: int) -> Any:
    """Rank 1 stops participating (the test kills it); the others wait in an all_reduce."""
    SUM = Reduction(ReduceOp.SUM)
    b.all_reduce(torch.ones(8), SUM).wait()
    if rank == 1:
        b.test_store.set("test/waiting/1", "1")
        time.sleep(120)
        return None
    return describe_error(lambda: b.all_reduce(torch.ones(1000), SUM).wait())


def stopped_peer_job(b: Any, rank: int, victim: int, nbytes: int) -> Any:
    """``victim`` is stopped (SIGSTOP, by the test) while the others run an all_reduce of
    ``nbytes``; once continued it tries an all_reduce too. Returns every rank's error."""
    SUM = Reduction(ReduceOp.SUM)
    store = b.test_store
    b.all_reduce(torch.ones(8), SUM).wait()  # everyone is connected and working
    if rank == victim:
        store.set("test/ready", "1")
        store.wait(["test/continued"], timeout=120)  # the test stops this process in here
    else:
        store.wait(["test/stopped"], timeout=60)
    error = describe_error(lambda: b.all_reduce(torch.ones(nbytes // 4), SUM).wait())
    store.set(f"test/done/{rank}", "1")
    return error


def threads_after_shutdown_job(b: Any, rank: int) -> list[str]:
    """Run a few ops, shut the backend down, list the tdist-tcp threads still alive."""
    SUM = Reduction(ReduceOp.SUM)
    b.all_reduce(torch.ones(100000), SUM).wait()
    w = b.all_reduce(torch.ones(10), SUM)
    w.wait()
    if rank == 0:
        b.send(torch.ones(3), 1, 0).wait()
    elif rank == 1:
        b.recv(torch.empty(3), 0, 0).wait()
    b.barrier().wait()
    b.shutdown()
    time.sleep(0.05)
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("tdist-tcp"))


def timing_job(b: Any, rank: int, nbytes: int, iters: int) -> float:
    SUM = Reduction(ReduceOp.SUM)
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(3):
        b.all_reduce(t, SUM).wait()
    b.barrier().wait()
    start = time.perf_counter()
    for _ in range(iters):
        b.all_reduce(t, SUM).wait()
    return (time.perf_counter() - start) / iters


def suites_job(b: Any, rank: int) -> list[str]:
    return all_reduce_suite(b, rank, sizes=(5,)) + collectives_suite(b, rank, n=9) + p2p_suite(b, rank)


# ------------------------------------------------------------- shared memory
def shm_files(pids) -> list[str]:
    """Entries in /dev/shm named after any of ``pids`` (segments are anonymous memory
    files now: any such entry is one left behind)."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    return sorted(n for n in names for pid in pids if n.startswith(f"tdist-tcp-{pid}-"))


def shm_mapped() -> set:
    """The names of the tdist-tcp segments this process maps (no garbage collection first:
    a destroyed group's segment must be gone at once)."""
    with open("/proc/self/maps") as f:
        return {line.split("/memfd:", 1)[1].split()[0] for line in f if "/memfd:tdist-tcp-" in line}


def shm_fds() -> set:
    """The names of the tdist-tcp segments this process holds a descriptor of."""
    names = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:tdist-tcp-"):
            names.add(target.split(":", 1)[1].split()[0])
    return names


def shm_mappings() -> int:
    """How many tdist-tcp segments this process still maps."""
    return len(shm_mapped())


def init_destroy_cycles_job(b: Any, rank: int, cycles: int) -> list:
    """``cycles`` times, through the public API: init_process_group("tcp") on this job's
    store, an all_reduce (through shared memory), destroy_process_group. With the garbage
    collector off, lists the cycles after which this process still mapped or held a
    descriptor of a segment (or that did not use one)."""
    import gc
    from datetime import timedelta

    import tdist as dist

    maps, fds = shm_mapped(), shm_fds()
    problems = []
    gc.disable()
    try:
        for k in range(cycles):
            dist.init_process_group(
                "tcp",
                store=dist.PrefixStore(f"cycle{k}", b.test_store),
                rank=rank,
                world_size=b.size,
                timeout=timedelta(seconds=30),
            )
            t = torch.ones(4)
            dist.all_reduce(t)
            used = shm_mapped() - maps
            dist.destroy_process_group()
            left = (shm_mapped() - maps) | (shm_fds() - fds)
            if len(used) != 1 or left or t[0].item() != b.size:
                problems.append((k, sorted(used), sorted(left), t[0].item()))
    finally:
        gc.enable()
    return problems


def shm_suites_job(b: Any, rank: int, sizes: tuple = (5, 1000, 5000), n: int = 3000, blocking: bool = False) -> tuple:
    """The suites at sizes that span one and several rounds of the segment's buffers,
    a bitwise digest (every rank must agree), and what is left in /dev/shm.
    ``blocking``: every collective as a caller that waits issues it (see :class:`Blocking`)."""
    if blocking:
        b = Blocking(b)
    failures = all_reduce_suite(b, rank, sizes=sizes)
    failures += collectives_suite(b, rank, n=9) + collectives_suite(b, rank, n=n)
    failures += p2p_suite(b, rank)
    digest = bitwise_digest(b, rank, 7000, 3)
    return b.uses_shm, failures, digest, shm_files([os.getpid()]), shm_mappings()


C_DTYPES = (torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


def cma_job(b: Any, rank: int) -> tuple:
    """Large all_reduces (over tdist_tcp.shared.cma's threshold; an odd element count, so the
    slices differ in size) of every dtype and reduce op the C part has, a bfloat16 and a
    PREMUL_SUM one (the segment's way), then random floats (SUM, AVG) digested: (the
    engine's cross-memory state, failures, digest). The first large all_reduce always goes
    the segment's way and the second settles whether the group reads its peers' memory."""
    failures = []
    for dtype in C_DTYPES + (torch.bfloat16,):
        n = (1 << 20) // dtype.itemsize + 7
        for op in reductions() if dtype in C_DTYPES else [Reduction(ReduceOp.SUM), make_premul_sum(2.0)]:
            if not _valid(op, dtype):
                continue
            small = op.op is ReduceOp.PRODUCT
            t = make(rank, n, dtype, small)
            b.all_reduce(t, op).wait()
            want = expected_reduction(b.size, n, dtype, op)
            if not _same(t, want):
                failures.append(f"all_reduce {op.name} {dtype} n={n}: {t[:6].tolist()} != {want[:6].tolist()}")
    g = torch.Generator().manual_seed(11 + rank)
    h = hashlib.sha256()
    for op in (Reduction(ReduceOp.SUM), Reduction(ReduceOp.AVG)):
        t = torch.randn((3 << 18) + 5, generator=g)
        b.all_reduce(t, op).wait()
        h.update(t.view(torch.uint8).numpy().tobytes())
    return b._shm.cma.state, failures, h.hexdigest()


def hierarchy_suites_job(b: Any, rank: int) -> tuple:
    """The group's hosts and :func:`shm_suites_job` across the hierarchical algorithms'
    sizes (odd rank: as a caller that waits)."""
    return b.hosts, shm_suites_job(b, rank, sizes=(5, 70001), n=700, blocking=rank % 2 == 1)


def shm_state_job(b: Any, rank: int) -> tuple:
    """(uses shm, segments this process created still in /dev/shm, segments it maps)."""
    b.all_reduce(torch.ones(4), Reduction(ReduceOp.SUM)).wait()
    return b.uses_shm, shm_files([os.getpid()]), shm_mappings()


__all__ = [name for name in dir() if not name.startswith("_")] + ["DistBackendError", "DistBackendTimeoutError"]


def shm_wait_policy_job(b: Any, rank: int) -> tuple:
    """This rank's shared-memory waiting policy (tdist_tcp.shared.shmwait), as the Python steps and
    the C part hold it, the CPUs its group may use, its group size and buffer bytes."""
    from tdist_tcp.shared import shmwait

    eng = b._shm
    fast = eng.fast
    pol = eng.policy
    c_part = None if fast is None else (fast.spin_ns, bool(fast.adaptive))
    return pol.spin, pol.adaptive, pol.yield_first, c_part, shmwait.usable_cpus(), eng.p, eng.S


def connected_peers(b: Any) -> list[int]:
    """The peers this rank's backend has connections to (they are made when first needed)."""
    return sorted(p.rank for p in b._tr.peers if p is not None and p.links)


def resources_job(b: Any, rank: int) -> tuple[list[str], int, list[int]]:
    """After one all_reduce: this process's tdist-tcp threads, open descriptors and connected peers."""
    b.all_reduce(torch.ones(1000), Reduction(ReduceOp.SUM)).wait()
    names = sorted(t.name for t in threading.enumerate() if t.name.startswith("tdist-tcp"))
    return names, len(os.listdir("/proc/self/fd")), connected_peers(b)


def looked_at_setup(b: Any, rank: int) -> None:
    """Wait (through the group's store, not a connection) until every rank of ``b``'s group
    has called this: a rank that finished its setup first then cannot connect to one that
    has not yet looked at what its setup left."""
    store = b._tr.mesh.store
    store.set(f"test/looked/{rank}", "1")
    store.wait([f"test/looked/{r}" for r in range(b._tr.size)], timeout=60)


def first_contact_job(b: Any, rank: int) -> tuple[list[int], list[int]]:
    """The connected peers right after init, then after rank 0 sent rank 2 one message."""
    before = connected_peers(b)
    looked_at_setup(b, rank)
    if rank == 0:
        b.send(torch.ones(3), 2, 0).wait()
    elif rank == 2:
        t = torch.zeros(3)
        b.recv(t, 0, 0).wait()
        assert t.tolist() == [1.0, 1.0, 1.0]
    return before, connected_peers(b)
