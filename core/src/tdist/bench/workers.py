"""The benchmark's worker processes: ``python -m tdist.bench.workers CONFIG.json``.

One worker per rank, started either by ``mpirun -n N`` (then raw mpi4py is measured
in the same processes) or directly by the runner (rank and world size in
``$TDIST_BENCH_RANK`` / ``$TDIST_BENCH_WORLD``). Every worker sets up each backend
it measures once (tdist over its own port, torch.distributed's gloo over another,
MPI's ``COMM_WORLD``), then for each operation and size runs the backends in turn,
``repeats`` times, so that they are measured alternately under the same machine load.

A timed sample is ``iters`` back-to-back calls after a barrier; its time is the
slowest rank's, per call. ``iters`` is chosen (the same on every rank) so that a
sample lasts about ``sample_time`` seconds. Rank 0 writes the medians to the
result file named in the configuration.

Progress (``cfg["progress"]``): ``"lines"`` (or True), rank 0 writes a line per case
(operation and size) to stderr, with each backend's time; ``"bar"``, one line on a
terminal, redrawn per case (lines under mpirun, which forwards output by lines, and when
the worker's stderr is not a terminal); else nothing.
"""

from __future__ import annotations

import abc

import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

__all__ = ["main", "serve", "Adapter", "make_adapters", "run", "OPS"]

#: Operations the benchmark knows, in the order it runs them.
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "barrier")
#: Operations that move no data: measured once, at size 0, whatever the sizes asked for.
SIZELESS = frozenset({"barrier"})


def _env_rank() -> tuple[int, int, bool]:
    """(rank, world size, started by mpirun)."""
    if "TDIST_BENCH_RANK" in os.environ:  # started by the runner itself (wins over an outer mpirun's variables)
        return int(os.environ["TDIST_BENCH_RANK"]), int(os.environ["TDIST_BENCH_WORLD"]), False
    for rank_var, size_var in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMI_RANK", "PMI_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
    ):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var]), True
    raise RuntimeError("tdist.bench.workers: no rank given (start it through python -m tdist.bench)")


def _elements(op: str, nbytes: int, world: int, itemsize: int) -> int:
    """Elements of the per-rank *input* for an operation whose size is ``nbytes``.

    The size of an operation is that of its largest per-rank buffer, as in nccl-tests:
    the tensor (all_reduce, broadcast), the gathered output (all_gather), the input
    to be scattered (reduce_scatter) or the whole send buffer (all_to_all). Sizes are
    rounded down to a multiple of ``world`` elements where the buffer is split.
    """
    n = max(1, nbytes // itemsize)
    if op in ("all_gather",):
        return max(1, n // world)
    if op in ("reduce_scatter", "all_to_all"):
        return max(world, n - n % world)
    return n


class Adapter(abc.ABC):
    """One backend under test: ``prepare(op, nbytes)`` returns a zero-argument callable
    doing one call of the operation on preallocated buffers, and a checker."""

    name = "?"

    @abc.abstractmethod
    def barrier(self) -> None:
        """Synchronise the ranks of this backend."""

    @abc.abstractmethod
    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], Optional[str]]]:
        """Allocate buffers for ``op`` at ``nbytes``; return (one call, checker)."""

    def close(self) -> None:
        pass


class _TorchLike(Adapter):
    """tdist and torch.distributed share one API: ``self.d`` is the module, ``self.group`` the group."""

    def __init__(self, d: Any, group: Any, rank: int, world: int) -> None:
        self.d, self.group, self.rank, self.world = d, group, rank, world
        # torch >= 2.10 deprecates the *_tensor spellings in favour of *_single
        self._gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        self._scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor

    def barrier(self) -> None:
        self.d.barrier(group=self.group)

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], Optional[str]]]:
        import torch

        d, g, p, r = self.d, self.group, self.world, self.rank
        gather, scatter = self._gather, self._scatter
        n = _elements(op, nbytes, p, 4)
        if op == "barrier":
            return (lambda: d.barrier(group=g)), lambda: None
        if op == "all_reduce":
            t = torch.zeros(n, dtype=torch.float32)  # zeros: repeated in-place sums never overflow

            def check() -> Optional[str]:
                t.fill_(r + 1)
                d.all_reduce(t, group=g)
                want = p * (p + 1) / 2
                ok = bool((t == want).all())
                got = t[:4].tolist()
                t.zero_()
                return None if ok else f"all_reduce: got {got}, want {want}"

            return (lambda: d.all_reduce(t, group=g)), check
        if op == "broadcast":
            t = torch.ones(n, dtype=torch.float32)

            def check() -> Optional[str]:
                t.fill_(7.0 if r == 0 else -1.0)
                d.broadcast(t, 0, group=g)
                return None if bool((t == 7.0).all()) else f"broadcast: got {t[:4].tolist()}"

            return (lambda: d.broadcast(t, 0, group=g)), check
        if op == "all_gather":
            t = torch.ones(n, dtype=torch.float32)
            out = torch.empty(n * p, dtype=torch.float32)

            def check() -> Optional[str]:
                t.fill_(r)
                gather(out, t, group=g)
                want = torch.arange(p, dtype=torch.float32).repeat_interleave(n)
                return None if torch.equal(out, want) else f"all_gather: got {out[::n].tolist()}"

            return (lambda: gather(out, t, group=g)), check
        if op == "reduce_scatter":
            t = torch.ones(n, dtype=torch.float32)
            out = torch.empty(n // p, dtype=torch.float32)

            def check() -> Optional[str]:
                t.copy_(torch.arange(p, dtype=torch.float32).repeat_interleave(n // p) + r)
                scatter(out, t, group=g)
                want = float(p * r + p * (p - 1) / 2)
                return None if bool((out == want).all()) else f"reduce_scatter: got {out[:4].tolist()}, want {want}"

            return (lambda: scatter(out, t, group=g)), check
        if op == "all_to_all":
            t = torch.ones(n, dtype=torch.float32)
            out = torch.empty(n, dtype=torch.float32)

            def check() -> Optional[str]:
                t.copy_(torch.arange(p, dtype=torch.float32).repeat_interleave(n // p) + 100 * r)
                d.all_to_all_single(out, t, group=g)
                want = torch.tensor([100.0 * k + r for k in range(p)]).repeat_interleave(n // p)
                return None if torch.equal(out, want) else f"all_to_all: got {out[:: n // p].tolist()}"

            return (lambda: d.all_to_all_single(out, t, group=g)), check
        raise ValueError(f"unknown operation {op!r}")


class TdistAdapter(_TorchLike):
    def __init__(self, name: str, backend: str, group: Any, rank: int, world: int) -> None:
        import tdist

        super().__init__(tdist, group, rank, world)
        self.name = name
        self.backend = backend


class TorchGlooAdapter(_TorchLike):
    name = "gloo"

    def __init__(self, rank: int, world: int, port: int, timeout: float, master: str = "127.0.0.1") -> None:
        import torch.distributed as td

        td.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        super().__init__(td, None, rank, world)

    def close(self) -> None:
        self.d.destroy_process_group()


class MpiAdapter(Adapter):
    """Raw mpi4py on numpy buffers: Allreduce (in place), Bcast, Allgather,
    Reduce_scatter_block, Alltoall."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()

    def barrier(self) -> None:
        self.comm.Barrier()

    def prepare(self, op: str, nbytes: int) -> tuple[Callable[[], Any], Callable[[], Optional[str]]]:
        import numpy as np

        MPI, comm, p, r = self.MPI, self.comm, self.world, self.rank
        n = _elements(op, nbytes, p, 4)
        if op == "barrier":
            return comm.Barrier, lambda: None
        if op == "all_reduce":
            a = np.zeros(n, dtype=np.float32)

            def check() -> Optional[str]:
                a.fill(r + 1)
                comm.Allreduce(MPI.IN_PLACE, a)
                ok = bool((a == p * (p + 1) / 2).all())
                got = a[:4].tolist()
                a.fill(0)
                return None if ok else f"Allreduce: got {got}"

            return (lambda: comm.Allreduce(MPI.IN_PLACE, a)), check
        if op == "broadcast":
            a = np.ones(n, dtype=np.float32)

            def check() -> Optional[str]:
                a.fill(7.0 if r == 0 else -1.0)
                comm.Bcast(a, 0)
                return None if bool((a == 7.0).all()) else f"Bcast: got {a[:4]}"

            return (lambda: comm.Bcast(a, 0)), check
        if op == "all_gather":
            a = np.ones(n, dtype=np.float32)
            out = np.empty(n * p, dtype=np.float32)

            def check() -> Optional[str]:
                a.fill(r)
                comm.Allgather(a, out)
                return None if bool((out == np.repeat(np.arange(p, dtype=np.float32), n)).all()) else "Allgather"

            return (lambda: comm.Allgather(a, out)), check
        if op == "reduce_scatter":
            a = np.ones(n, dtype=np.float32)
            out = np.empty(n // p, dtype=np.float32)

            def check() -> Optional[str]:
                a[:] = np.repeat(np.arange(p, dtype=np.float32), n // p) + r
                comm.Reduce_scatter_block(a, out)
                return None if bool((out == p * r + p * (p - 1) / 2).all()) else "Reduce_scatter_block"

            return (lambda: comm.Reduce_scatter_block(a, out)), check
        if op == "all_to_all":
            a = np.ones(n, dtype=np.float32)
            out = np.empty(n, dtype=np.float32)

            def check() -> Optional[str]:
                a[:] = np.repeat(np.arange(p, dtype=np.float32), n // p) + 100 * r
                comm.Alltoall(a, out)
                want = np.repeat(np.array([100.0 * k + r for k in range(p)], dtype=np.float32), n // p)
                return None if bool((out == want).all()) else "Alltoall"

            return (lambda: comm.Alltoall(a, out)), check
        raise ValueError(f"unknown operation {op!r}")


def tdist_backend_name(name: str) -> str:
    """The tdist backend a bench column names: "tdist-gloo" -> "gloo", "tcp+tls" -> "tcp"
    (a variant of "tcp" with other options)."""
    backend = name[len("tdist-") :] if name.startswith("tdist-") else name
    return backend.partition("+")[0]


def make_adapters(cfg: dict, rank: int, world: int, under_mpi: bool) -> tuple[list[Adapter], Any]:
    """The adapters named in ``cfg["backends"]`` (in that order) and the control group
    (torch.distributed gloo, always set up: it also times and agrees on counts)."""
    import torch.distributed as td

    timeout = float(cfg.get("timeout", 300))
    master = cfg.get("master", "127.0.0.1")  # rank 0's address (another host's, on a simulated cluster)
    gloo = TorchGlooAdapter(rank, world, cfg["ports"]["gloo"], timeout, master)
    adapters: list[Adapter] = []
    tdist_default = None
    for name in cfg["backends"]:
        if name == "gloo":
            adapters.append(gloo)
        elif name == "mpi":
            if under_mpi:
                adapters.append(MpiAdapter())
        else:  # "tcp", "tdist-gloo", "tdist-mpi", ... : a tdist backend
            import tdist

            backend = tdist_backend_name(name)
            options = cfg.get("options", {}).get(name) or None
            if tdist_default is None:
                spec = tdist.get_backend_spec(backend)
                init = spec.default_init_method or f"tcp://{master}:{cfg['ports']['tdist']}"
                tdist.init_process_group(
                    backend,
                    init_method=init,
                    rank=rank,
                    world_size=world,
                    timeout=timedelta(seconds=timeout),
                    pg_options=options,
                    torch_bridge=False,
                )  # torch's default group is the gloo reference
                tdist_default = backend
                group = None
            else:
                group = tdist.new_group(list(range(world)), backend=backend, pg_options=options)
            adapters.append(TdistAdapter(name, backend, group, rank, world))
    return adapters, td


def _agree_max(td: Any, value: float) -> float:
    import torch

    t = torch.tensor([value], dtype=torch.float64)
    td.all_reduce(t, op=td.ReduceOp.MAX)
    return float(t.item())


def _sample(td: Any, adapter: Adapter, fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call, the slowest rank's, over ``iters`` back-to-back calls."""
    td.barrier()
    adapter.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - start
    return _agree_max(td, elapsed) / iters


class Progress:
    """Rank 0's progress through the cases of one world (see the module docstring)."""

    BAR_WIDTH = 24

    def __init__(self, mode: Any, world: int, total: int, under_mpi: bool, tty: Optional[bool] = None) -> None:
        mode = "lines" if mode is True else mode
        if tty is None:
            try:
                tty = sys.stderr.isatty()
            except (AttributeError, ValueError):
                tty = False
        if mode == "bar" and (under_mpi or not tty):  # mpirun (or a pipe) would get the redrawn line
            mode = "lines"
        self.mode = mode if mode in ("lines", "bar") else None
        self.world = world
        self.total = total
        self.done = 0

    def case_done(self, op: str, nbytes: int, times: dict[str, float]) -> None:
        if self.mode is None:
            return
        from .report import format_size

        self.done += 1
        what = op if op in SIZELESS else f"{op} {format_size(nbytes)}"
        if self.mode == "lines":
            line = "  ".join(f"{name} {t * 1e6:.1f}us" for name, t in times.items())
            print(f"[bench] world {self.world}, {self.done}/{self.total}: {what}: {line}", file=sys.stderr, flush=True)
            return
        filled = self.BAR_WIDTH * self.done // max(1, self.total)
        bar = "#" * filled + "." * (self.BAR_WIDTH - filled)
        end = "\n" if self.done >= self.total else ""
        text = f"[bench] world {self.world} [{bar}] {self.done}/{self.total} {what}"
        sys.stderr.write(f"\r{text:<79}{end}")
        sys.stderr.flush()


def run(cfg: dict, rank: int, world: int, under_mpi: bool) -> list[dict]:
    adapters, td = make_adapters(cfg, rank, world, under_mpi)
    sample_time = float(cfg.get("sample_time", 0.05))
    repeats = max(1, int(cfg.get("repeats", 5)))
    warmup = max(1, int(cfg.get("warmup", 3)))
    max_iters = int(cfg.get("max_iters", 10000))
    check = bool(cfg.get("check", True))
    results = []
    cases = sum(1 if op in SIZELESS else len(cfg["sizes"]) for op in cfg["ops"])
    progress = Progress(cfg.get("progress") if rank == 0 else None, world, cases, under_mpi)
    for op in cfg["ops"]:
        for nbytes in [0] if op in SIZELESS else cfg["sizes"]:
            prepared: list = []
            for ad in adapters:
                fn, checker = ad.prepare(op, nbytes)
                error = checker() if check else None
                if error is not None:
                    raise RuntimeError(f"{ad.name} {op} {nbytes} B on rank {rank}: wrong result: {error}")
                for _ in range(warmup):
                    fn()
                td.barrier()
                ad.barrier()
                t0 = time.perf_counter()
                fn()
                fn()
                per_call = _agree_max(td, (time.perf_counter() - t0) / 2)
                iters = int(min(max_iters, max(1, sample_time / max(per_call, 1e-7))))
                prepared.append((ad, fn, iters, []))
            for _ in range(repeats):  # alternate the backends, sample by sample
                for ad, fn, iters, samples in prepared:
                    samples.append(_sample(td, ad, fn, iters))
            for ad, _fn, iters, samples in prepared:
                results.append(
                    {
                        "world": world,
                        "op": op,
                        "bytes": nbytes,
                        "backend": ad.name,
                        "time_s": statistics.median(samples),
                        "samples_s": samples,
                        "iters": iters,
                    }
                )
            progress.case_done(op, nbytes, {ad.name: statistics.median(s) for ad, _f, _i, s in prepared})
    for ad in adapters:
        if ad.name != "gloo":
            ad.close()
    try:
        import tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
    except Exception:
        pass
    td.barrier()
    td.destroy_process_group()
    return results


def main(argv: Optional[list[str]] = None) -> int:
    return serve(run, argv, "[bench]")


def serve(run_fn: Callable[[dict, int, int, bool], list], argv: Optional[list[str]], label: str) -> int:
    """A worker's life: read the configuration, ``run_fn(cfg, rank, world, under_mpi)``,
    rank 0 writes the results to ``cfg["result"]``; an error is printed and exits 3."""
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        cfg = json.load(f)
    rank, world, under_mpi = _env_rank()
    if under_mpi:  # initialise MPI before anything else, as tdist's mpi backend would (if installed)
        try:
            from tdist_mpi import init_mpi
        except ImportError:
            from mpi4py import MPI  # noqa: F401
        else:
            init_mpi()
    try:
        results = run_fn(cfg, rank, world, under_mpi)
    except BaseException as exc:
        print(f"{label} rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)
    if rank == 0:
        with open(cfg["result"], "w") as f:
            json.dump(results, f)
    sys.stdout.flush()
    sys.stderr.flush()
    if under_mpi:
        from mpi4py import MPI

        MPI.Finalize()
    os._exit(0)  # skip torch's slow interpreter teardown


if __name__ == "__main__":
    sys.exit(main())
