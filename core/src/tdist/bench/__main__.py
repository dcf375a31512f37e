"""``python -m tdist.bench``: collective performance, tdist against torch's gloo and raw MPI.

Examples::

    python -m tdist.bench                                   # every op, 4 B .. 64 MiB, 2 and 4 ranks
    python -m tdist.bench --ops all_reduce --max-size 16M --world-sizes 2
    python -m tdist.bench --sizes 4,256K,4M --csv out.csv --json out.json --plot busbw.png
    python -m tdist.bench --core-overhead
    python -m tdist.bench --recorder-overhead               # tdist-debug's flight recorder, per op
    python -m tdist.bench --store                           # TCPStore: tdist against torch's
    python -m tdist.bench --ddp                   # torch DDP steps on tdist-tcp vs torch's gloo
    python -m tdist.bench --scale                 # per rank as the world grows: tcp vs gloo, simulated 16..256
    python -m tdist.bench --recovery              # a lost rank: shrink (tcp, gloo, mpi) vs a restart + checkpoint
    python -m tdist.bench --recovery --hosts 2    # one of 2 simulated hosts cut off: shrink (tcp, gloo) (root)
    python -m tdist.bench --torchft               # torchft's recovery from a SIGKILL: tdist-tcp vs torchft's gloo
    python -m tdist.bench --tls                   # tcp over sockets: TLS on vs off (16 MiB all_reduce)
    python -m tdist.bench --hosts 2               # 2 simulated hosts x 2 ranks: tcp vs gloo (root)
    python -m tdist.bench --hosts 2 --link-rate 1gbit --link-delay 0.001

Every mode first byte-compiles tdist's packages where their ``.pyc`` is missing or stale
(:mod:`tdist.bench.precompile`), as ``pip install`` does, so that no worker compiles them.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Optional

from .report import annotate, table, write_csv, write_json
from .runner import mpi_available, run_world
from .workers import OPS

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """``4``, ``256K``, ``4MiB``, ``1G`` -> bytes."""
    s = text.strip().upper().replace(" ", "")
    digits = s.rstrip("KMGIB")
    unit = s[len(digits) :]
    if not digits or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 4, 256K, 4M, 64MiB)")
    return int(float(digits) * _UNITS[unit])


def default_sizes(min_size: int, max_size: int, factor: int) -> list[int]:
    sizes, n = [], min_size
    while n <= max_size:
        sizes.append(n)
        n *= factor
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tdist.bench",
        description="Time tdist collectives against torch.distributed's gloo and raw mpi4py "
        "(in the spirit of nccl-tests' all_reduce_perf).",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated operations (default: {','.join(OPS)})")
    p.add_argument("--sizes", help="comma-separated sizes in bytes (4,1K,256K,4M); overrides --min/--max-size")
    p.add_argument("--min-size", type=parse_size, default=4, help="smallest size (default 4)")
    p.add_argument("--max-size", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    p.add_argument("--factor", type=int, default=4, choices=(2, 4), help="size step factor (default 4)")
    p.add_argument("--world-sizes", default="2,4", help="comma-separated numbers of ranks (default 2,4)")
    p.add_argument(
        "--backends",
        default="tcp,gloo,mpi",
        help="comma-separated: tcp (tdist's), gloo (torch.distributed's), mpi (raw mpi4py), "
        "tdist-gloo, tdist-mpi (default tcp,gloo,mpi)",
    )
    p.add_argument("--no-mpi", action="store_true", help="do not start the workers under mpirun")
    p.add_argument("--repeats", type=int, default=5, help="timed samples per backend and size (median; default 5)")
    p.add_argument("--sample-time", type=float, default=0.05, help="seconds per sample (default 0.05)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before sampling (default 3)")
    p.add_argument("--no-check", action="store_true", help="skip the correctness check of each op and size")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="BACKEND:KEY=VALUE",
        help="backend option (pg_options), e.g. tcp:shm=0; repeatable",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per world size")
    p.add_argument("--csv", metavar="FILE", help="also write the results as CSV")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--plot", metavar="FILE", help="also plot bus bandwidth against size (PNG; needs matplotlib)")
    p.add_argument("--reference", default="gloo", help="backend the ratio columns divide by (default gloo)")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print a line per result as it is measured, also on a terminal (default: a progress bar there, "
        "lines elsewhere)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr (only the table)")
    p.add_argument(
        "--core-overhead", action="store_true", help="measure the core's own cost per call at world size 1 instead"
    )
    p.add_argument(
        "--recorder-overhead",
        action="store_true",
        help="measure what tdist-debug's flight recorder adds per call at world size 1 instead",
    )
    p.add_argument(
        "--iters", type=int, default=20000, help="calls per sample for --core-overhead and --recorder-overhead"
    )
    p.add_argument(
        "--store",
        action="store_true",
        help="measure the TCPStore instead, against torch's: multi_get against single gets, "
        "--store-clients clients doing --store-ops adds each, and a load test: --store-load-clients "
        "clients connected at once doing set/get (p50/p99 latency, connect time)",
    )
    p.add_argument("--store-clients", type=int, default=16, help="client processes for --store (default 16)")
    p.add_argument("--store-ops", type=int, default=1000, help="adds per client for --store (default 1000)")
    p.add_argument("--store-keys", type=int, default=100, help="keys per multi_get for --store (default 100)")
    p.add_argument(
        "--store-load-clients",
        type=int,
        default=4096,
        help="light clients of --store's load test, all connected at once (default 4096; 0: no load test)",
    )
    p.add_argument(
        "--store-load-procs", type=int, default=4, help="processes the load clients are spread over (default 4)"
    )
    p.add_argument("--store-load-rounds", type=int, default=5, help="set + get rounds per load client (default 5)")
    p.add_argument(
        "--tls",
        action="store_true",
        help="tcp over sockets with TLS against without (throwaway certificates; needs openssl); "
        "default: all_reduce of 16M on 2 ranks",
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        help="time torch's DistributedDataParallel steps on tdist-tcp against torch's gloo instead "
        "(--world-sizes, --repeats apply)",
    )
    p.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="run on a simulated cluster of this many hosts (network namespaces; root) instead; "
        "default: all_reduce of 4,256K,16M,64M, tcp against gloo",
    )
    p.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host for --hosts (default 2)")
    p.add_argument("--link-rate", help="each host's link rate for --hosts, e.g. 1gbit (tc tbf; default unlimited)")
    p.add_argument(
        "--link-delay", type=float, default=0.0, help="seconds added to every frame a host sends, for --hosts"
    )
    p.add_argument(
        "--torchft",
        action="store_true",
        help="time torchft's recovery from a SIGKILL (its DDP example, 2 replica groups) with tdist's process "
        "group against torchft's gloo instead (--repeats applies; needs torchft and a source checkout)",
    )
    p.add_argument(
        "--scale",
        action="store_true",
        help="threads, descriptors, RSS and init time per rank as the world grows: tdist-tcp against torch's "
        "gloo at --world-sizes (default 4,8,16,32 here), and simulated worlds of --sim-worlds ranks, instead",
    )
    p.add_argument("--sim-worlds", default="16,64,256", help="ranks of the simulated worlds for --scale")
    p.add_argument("--sim-procs", type=int, default=8, help="processes the simulated ranks share for --scale")
    p.add_argument(
        "--scale-repeats", type=int, default=1, help="runs of each world for --scale (the median run; default 1)"
    )
    p.add_argument(
        "--recovery",
        action="store_true",
        help="time the recovery from a SIGKILLed rank of 4 (torch DDP): shrinking on tcp, gloo and mpi against "
        "tdistrun --max-restarts 1 with a checkpoint reload, instead; with --hosts H, from the last of H "
        "simulated hosts' link cut mid-step (root)",
    )
    p.add_argument(
        "--torchft-heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout for --torchft"
    )
    p.add_argument("--ddp-steps", type=int, default=5, help="training steps per sample for --ddp")
    p.add_argument("--ddp-batch", type=int, default=16, help="rows per rank per step for --ddp (default 16)")
    return p


def _options(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        backend, _, kv = item.partition(":")
        key, eq, value = kv.partition("=")
        if not backend or not key or not eq:
            raise SystemExit(f"tdist.bench: bad --option {item!r} (want BACKEND:KEY=VALUE)")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        out.setdefault(backend, {})[key] = parsed
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from .precompile import precompile

    said = precompile()  # what a pip install does: no worker compiles tdist at import
    if not args.quiet:
        print(said, file=sys.stderr, flush=True)
    if args.store:
        from .store import format_store_bench, store_bench

        result = store_bench(
            args.store_clients,
            args.store_ops,
            args.store_keys,
            args.repeats,
            args.store_load_clients,
            args.store_load_procs,
            args.store_load_rounds,
        )
        print(format_store_bench(result))
        if args.json:
            write_json(args.json, [result], {"mode": "store"})
        return 0
    if args.core_overhead or args.recorder_overhead:
        if args.core_overhead:
            from .overhead import core_overhead, format_overhead

            result = core_overhead(iters=args.iters, repeats=args.repeats)
            print(format_overhead(result))
        else:
            from .recorder import format_recorder_overhead, recorder_overhead

            result = recorder_overhead(iters=args.iters, repeats=args.repeats)
            print(format_recorder_overhead(result))
        if args.json:
            write_json(args.json, [result], {"mode": "core-overhead" if args.core_overhead else "recorder-overhead"})
        return 0
    if args.ddp:
        from .ddp import ddp_bench, format_ddp

        worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
        rows = ddp_bench(worlds, steps=args.ddp_steps, repeats=args.repeats, batch=args.ddp_batch, timeout=args.timeout)
        print(format_ddp(rows))
        if args.json:
            write_json(args.json, rows, {"mode": "ddp"})
        return 0
    if args.scale:
        from .scale import format_scale, scale_bench

        default_worlds = args.world_sizes == "2,4"
        worlds = [4, 8, 16, 32] if default_worlds else [int(w) for w in args.world_sizes.split(",") if w.strip()]
        sims = [int(w) for w in args.sim_worlds.split(",") if w.strip()]
        rows = scale_bench(worlds, sims, sim_procs=args.sim_procs, timeout=args.timeout, repeats=args.scale_repeats)
        print(format_scale(rows))
        if args.json:
            write_json(args.json, rows, {"mode": "scale"})
        return 0
    if args.recovery:
        from .recovery import format_recovery, recovery_backends, recovery_bench

        if args.hosts:  # a host's link cut, on a simulated cluster
            from .recovery_hosts import recovery_hosts_bench

            rows = recovery_hosts_bench(["tcp", "gloo"], args.hosts, args.ranks_per_host, min(args.timeout, 600.0))
        else:
            rows = recovery_bench(recovery_backends(), timeout=min(args.timeout, 600.0))
        print(format_recovery(rows))
        if args.json:
            write_json(args.json, rows, {"mode": "recovery"})
        return 0
    if args.torchft:
        from .torchft import format_torchft, torchft_bench

        rows = torchft_bench(repeats=args.repeats, heartbeat_ms=args.torchft_heartbeat_ms, timeout=args.timeout)
        print(format_torchft(rows))
        if args.json:
            write_json(args.json, rows, {"mode": "torchft"})
        return 0
    if args.hosts:
        _configure_hosts(args)
    if args.tls:
        import shutil

        from .tls import configure_tls_bench

        certificates = configure_tls_bench(args)
        try:
            return _collectives(args, argv)
        finally:
            shutil.rmtree(certificates, ignore_errors=True)
    return _collectives(args, argv)


def _configure_hosts(args: argparse.Namespace) -> None:
    """``--hosts``' defaults: all_reduce of 4 B .. 64 MiB; tcp (hierarchical), tcp with the
    flat socket algorithms (``tcp+flat``) and torch's gloo, ratios against gloo; no MPI
    (its workers would need one mpirun across the hosts)."""
    from .hosts import DEFAULT_SIZES, FLAT_BACKEND

    if args.ops == ",".join(OPS):
        args.ops = "all_reduce"
    if not args.sizes:
        args.sizes = ",".join(str(n) for n in DEFAULT_SIZES)
    if args.backends == build_parser().get_default("backends"):
        args.backends = f"tcp,{FLAT_BACKEND},gloo"
        args.option = list(args.option) + [f"{FLAT_BACKEND}:hierarchy=off"]
    args.no_mpi = True


def _needs_mpirun(name: str) -> bool:
    """Whether the bench's backend ``name`` is a tdist backend whose ranks must share one
    ``mpirun`` (its ``BackendSpec.launcher``)."""
    if name in ("gloo", "mpi"):  # torch's gloo and raw mpi4py, not tdist backends
        return False
    import tdist

    from .workers import tdist_backend_name

    try:
        return tdist.get_backend_spec(tdist_backend_name(name)).launcher == "mpirun"
    except tdist.DistError:
        return False  # not installed: the worker says so


def progress_mode(args: argparse.Namespace) -> Optional[str]:
    """How the workers show their progress on stderr: None (``--quiet``), ``"bar"`` (on a
    terminal) or ``"lines"`` (elsewhere, and with ``--verbose``)."""
    if args.quiet:
        return None
    if args.verbose:
        return "lines"
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "bar" if tty else "lines"


def _collectives(args: argparse.Namespace, argv: Optional[list[str]]) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"tdist.bench: unknown operation(s) {bad} (known: {', '.join(OPS)})")
    if args.sizes:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    else:
        sizes = default_sizes(args.min_size, args.max_size, args.factor)
    worlds = [int(w) for w in args.world_sizes.split(",") if w.strip()]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    use_mpi, why = mpi_available()
    if args.no_mpi:
        use_mpi, why = False, "--no-mpi"
    if not use_mpi and "mpi" in backends:
        print(f"tdist.bench: raw MPI not measured ({why})", file=sys.stderr)
        backends = [b for b in backends if b != "mpi"]
    if not use_mpi:
        for name in [b for b in backends if _needs_mpirun(b)]:
            print(f"tdist.bench: {name} needs mpirun ({why}); skipped", file=sys.stderr)
            backends.remove(name)
    cfg = {
        "ops": ops,
        "sizes": sizes,
        "backends": backends,
        "repeats": args.repeats,
        "sample_time": args.sample_time,
        "warmup": args.warmup,
        "check": not args.no_check,
        "options": _options(args.option),
        "timeout": min(args.timeout, 300.0),
    }
    results: list[dict] = []
    started = time.time()
    progress = progress_mode(args)
    if args.hosts:
        from .hosts import format_bounds, run_hosts

        results = run_hosts(
            args.hosts, args.ranks_per_host, cfg, args.timeout, args.link_rate, args.link_delay, progress
        )
    else:
        for index, world in enumerate(worlds, 1):
            if progress is not None:
                print(
                    f"[bench] world {world} ({index} of {len(worlds)}): starting {world} workers "
                    f"({', '.join(backends)}{', under mpirun' if use_mpi else ''})",
                    file=sys.stderr,
                    flush=True,
                )
            results.extend(run_world(world, cfg, use_mpi, args.timeout, progress))
    results = annotate(results)
    if args.hosts:
        link = f", links {args.link_rate or 'unlimited'}, {args.link_delay * 1e3:g} ms delay"
        print(f"simulated cluster: {args.hosts} hosts x {args.ranks_per_host} ranks{link}\n")
    print(table(results, backends, args.reference))
    if args.hosts:
        print(format_bounds(results, backends))
    meta = {
        "argv": sys.argv[1:] if argv is None else argv,
        "backends": backends,
        "mpirun": use_mpi,
        "host": platform.node(),
        "python": platform.python_version(),
        "started": started,
        "seconds": time.time() - started,
    }
    if args.csv:
        write_csv(args.csv, results)
    if args.json:
        write_json(args.json, results, meta)
    if args.plot:
        from .plot import plot

        plot(args.plot, results, backends)
    return 0


if __name__ == "__main__":
    sys.exit(main())
