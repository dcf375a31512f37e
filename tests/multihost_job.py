"""A job for tests/test_multihost.py and tests/test_multicast_rendezvous.py, run on the
hosts of a simulated cluster (``tdist.testing.cluster``) the way a user runs a
torch.distributed program.

    python multihost_job.py --backend tcp [--init-method URL ...] [--size BYTES] [--steps K] [--hold]

For each ``--init-method`` in turn (default: one ``init_process_group`` without one,
i.e. env://; ``URL#NAME`` passes ``group_name=NAME``), initialises tdist, checks, then
destroys the group. The checks, on every rank:

- ``all_reduce`` (sum) of ``--size`` bytes of float32, each rank contributing rank + 1,
  while this host's ``eth0`` counters are read before and after (the bytes every host
  must send and receive for it: at least half the tensor);
- ``all_gather`` of every rank's (rank, host name as a number tensor): which host each
  rank runs on, so the test can check that the ranks span the hosts;
- broadcast, reduce, reduce_scatter, all_gather and an AVG all_reduce, small and large;
- for the tcp backend, whether the group uses shared memory, and the hosts its
  hierarchical collectives see (shared memory within a host, never across hosts);
- how long ``init_process_group`` took, and how many UDP sockets of this process are still
  bound to the init method's port (a multicast ``tcp://`` rendezvous must close its own).

Prints one line ``RESULT {json}`` per init method. With ``--steps K``, it then runs K more
all_reduces, printing ``step i`` after each (the test kills a host in the middle). With
``--hold`` it waits for a line on stdin before its first init (a process the test starts
ready, then lets in late).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import socket
import sys
import time
import urllib.parse
from datetime import timedelta


def link_bytes(ifname: str = "eth0") -> tuple[int, int]:
    """(received, sent) bytes of ``ifname`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == ifname:
                fields = counters.split()
                return int(fields[0]), int(fields[8])
    return 0, 0


def udp_sockets_on(port: int) -> int:
    """How many UDP sockets of this process are bound to ``port``."""
    links = set()
    for fd in glob.glob("/proc/self/fd/*"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.add(os.readlink(fd))
    mine = {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    count = 0
    for table in ("/proc/net/udp", "/proc/net/udp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in mine:
                    count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", "--local-rank", type=int, default=0)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--init-method", action="append", default=None)
    parser.add_argument("--size", type=int, default=4 << 20)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--hold", action="store_true", help="wait for a line on stdin to start")
    args = parser.parse_args()

    import torch

    import tdist as dist

    if args.hold:
        sys.stdin.readline()
    for i, init_method in enumerate(args.init_method or [None]):
        if i:
            dist.destroy_process_group()
        url, _, group_name = (init_method or "").partition("#")
        started = time.perf_counter()
        dist.init_process_group(
            args.backend, init_method=url or None, group_name=group_name, timeout=timedelta(seconds=args.timeout)
        )
        init_seconds = time.perf_counter() - started
        port = urllib.parse.urlsplit(url).port if url.startswith("tcp://") else None
        check(
            dist,
            args.backend,
            init_method,
            args.size,
            init_seconds=init_seconds,
            udp_open=udp_sockets_on(port) if port else 0,
        )

    small = torch.ones(16)
    for step in range(args.steps):
        dist.all_reduce(small)
        print(f"step {step}", flush=True)
        time.sleep(0.1)
    dist.destroy_process_group()
    return 0


def other_collectives_ok(dist, rank: int, size: int) -> list[str]:
    """broadcast, reduce, reduce_scatter, all_gather_into_tensor and an AVG all_reduce,
    small and large (the tcp backend's hierarchical algorithms take both paths): the
    names of those that gave a wrong result."""
    import torch

    wrong = []
    for n in (5, 300001):
        root = size - 1
        t = torch.full((n,), float(rank))
        dist.broadcast(t, src=root)
        if not torch.all(t == root):
            wrong.append(f"broadcast {n}")
        t = torch.full((n,), float(rank + 1))
        dist.reduce(t, dst=root)
        if rank == root and not torch.all(t == size * (size + 1) / 2):
            wrong.append(f"reduce {n}")
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, torch.arange(size, dtype=torch.float32).repeat_interleave(n) + rank)
        if not torch.all(out == size * rank + size * (size - 1) / 2):
            wrong.append(f"reduce_scatter_tensor {n}")
        gathered = torch.empty(n * size)
        dist.all_gather_into_tensor(gathered, torch.full((n,), float(rank)))
        if not torch.equal(gathered, torch.arange(size, dtype=torch.float32).repeat_interleave(n)):
            wrong.append(f"all_gather_into_tensor {n}")
        t = torch.full((n,), float(rank))
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.allclose(t, torch.full((n,), (size - 1) / 2)):
            wrong.append(f"all_reduce AVG {n}")
    return wrong


def check(dist, backend: str, init_method, nbytes: int, **extra) -> None:
    """The all_reduce, all_gather and transport checks of the module's description."""
    import torch

    rank, size = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()

    numel = nbytes // 4
    tensor = torch.full((numel,), float(rank + 1))
    dist.barrier()
    before = link_bytes()
    dist.all_reduce(tensor)
    after = link_bytes()
    expected = size * (size + 1) / 2
    reduced_ok = bool(torch.all(tensor == expected))

    name = torch.zeros(64, dtype=torch.int64)
    raw = host.encode()[:64]
    name[: len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    names = [torch.zeros(64, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(names, name)
    hosts = [bytes(int(c) for c in t.tolist() if c).decode() for t in names]
    others_ok = other_collectives_ok(dist, rank, size)

    uses_shm = tcp_hosts = links = None
    if backend == "tcp":
        uses_shm = bool(dist.group.WORLD.backends["cpu"].uses_shm)
        tcp_hosts = dist.group.WORLD.backends["cpu"].hosts
        peers = dist.group.WORLD.backends["cpu"]._tr.peers  # connections per peer (test introspection)
        links = {str(p.rank): len(p.links) for p in peers if p is not None}
    print(
        "RESULT "
        + json.dumps(
            {
                "init_method": init_method,
                "rank": rank,
                "world_size": size,
                "host": host,
                "hosts": hosts,
                "reduced_ok": reduced_ok,
                "others_ok": others_ok,
                "rx": after[0] - before[0],
                "tx": after[1] - before[1],
                "uses_shm": uses_shm,
                "tcp_hosts": tcp_hosts,
                "links": links,
                **extra,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
