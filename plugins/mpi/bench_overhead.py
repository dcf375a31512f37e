"""Overhead of tdist's mpi backend over raw mpi4py, side by side in one run.

    mpirun -n 2 python plugins/mpi/bench_overhead.py [--sizes 4,16777216] [--rounds 15]

For each size: ``tdist.all_reduce(t)`` (SUM, synchronous) against
``COMM_WORLD.Allreduce(IN_PLACE, [a, MPI.FLOAT], MPI.SUM)`` on ``a = t.numpy()``,
the same memory. Blocks of calls alternate between the two (so drift and noise
hit both alike); the per-call time reported is the median over blocks, and, on a
shared machine, the fastest block of each (less sensitive to other processes).
Targets: at most +10 µs at 4 B, at most 1.05x at 16 MiB.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tdist as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16777216", help="message sizes in bytes (float32), comma-separated")
    parser.add_argument("--rounds", type=int, default=41, help="alternating blocks per variant")
    parser.add_argument(
        "--nonblocking",
        action="store_true",
        help="also time raw mpi4py Iallreduce + Test() loop (what the backend issues)",
    )
    args = parser.parse_args()

    dist.init_process_group("mpi")
    from mpi4py import MPI  # already initialised by the backend

    comm = MPI.COMM_WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"tdist mpi backend vs raw mpi4py Allreduce, {size} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"{'':>10} {'median of blocks':^48}   {'fastest block':^33}")
        print(
            f"{'bytes':>10} {'raw mpi4py':>14} {'tdist':>14} {'diff':>11} {'ratio':>7}   "
            f"{'raw mpi4py':>11} {'tdist':>11} {'ratio':>7}"
        )
    for nbytes in (int(s) for s in args.sizes.split(",")):
        count = max(1, nbytes // 4)
        t = torch.ones(count)
        a = t.numpy()
        per_block = max(3, min(200, (64 << 20) // max(nbytes, 1) // 8))  # short blocks: fit a time slice

        def raw() -> None:
            comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM)

        def via_tdist() -> None:
            dist.all_reduce(t)

        dup = comm.Dup()

        def raw_nonblocking() -> None:
            req = dup.Iallreduce(MPI.IN_PLACE, [a, MPI.FLOAT], MPI.SUM)
            while not req.Test():
                pass

        def block(fn) -> float:
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(per_block):
                fn()
            return (time.perf_counter() - start) / per_block

        variants = [("raw", raw), ("tdist", via_tdist)]
        if args.nonblocking:
            variants.append(("nonblocking", raw_nonblocking))
        for _, fn in variants:  # warm up every path
            block(fn)
        times: dict[str, list[float]] = {name: [] for name, _ in variants}
        for i in range(args.rounds):
            for name, fn in variants if i % 2 == 0 else variants[::-1]:
                times[name].append(block(fn))
        raw_s = statistics.median(times["raw"])
        tdist_s = statistics.median(times["tdist"])
        raw_b, tdist_b = min(times["raw"]), min(times["tdist"])
        if rank == 0:
            print(
                f"{count * 4:>10} {raw_s * 1e6:>11.2f} us {tdist_s * 1e6:>11.2f} us "
                f"{(tdist_s - raw_s) * 1e6:>+8.2f} us {tdist_s / raw_s:>6.3f}x   "
                f"{raw_b * 1e6:>8.2f} us {tdist_b * 1e6:>8.2f} us {tdist_b / raw_b:>6.3f}x",
                flush=True,
            )
            if args.nonblocking:
                nb = times["nonblocking"]
                print(
                    f"{'':>10} raw Iallreduce+Test: median {statistics.median(nb) * 1e6:.2f} us, "
                    f"fastest block {min(nb) * 1e6:.2f} us",
                    flush=True,
                )
        dup.Free()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
