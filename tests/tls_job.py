"""A 2-rank tcp job for tests/test_tls.py (started with RANK/WORLD_SIZE/MASTER_* set, env:// init).

``python tls_job.py run``: the TLS settings come from the environment; checks that the mesh
connection is TLS, then all_reduce (16 MiB), send/recv and an object collective.
``python tls_job.py mesh-only CA CERT KEY``: only rank 0 passes TLS as pg_options; prints the
error init raises (the ranks disagree about TLS, so both must fail with a clear error).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch

import tdist as dist
from tdist._groups import resolve_group


def _mesh_socket_type() -> str:
    pg = resolve_group(None)
    backend = next(iter(pg.backends.values()))
    peer = backend._tr.peers[1 - dist.get_rank()]
    return type(peer.links[0].sock).__name__


def run() -> None:
    dist.init_process_group("tcp", init_method="env://", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    assert _mesh_socket_type() == "TlsStream", _mesh_socket_type()
    t = torch.full((4 << 20,), float(rank + 1))
    dist.all_reduce(t)
    assert float(t.min()) == 3.0 and float(t.max()) == 3.0
    x = torch.arange(1000.0)
    if rank == 0:
        dist.send(x, 1)
    else:
        y = torch.zeros(1000)
        dist.recv(y, 0)
        assert torch.equal(x, y)
    objects: list = [None, None]
    dist.all_gather_object(objects, {"rank": rank})
    assert objects == [{"rank": 0}, {"rank": 1}]
    print("TLS-JOB-OK", flush=True)
    dist.destroy_process_group()


def mesh_only(ca: str, cert: str, key: str) -> None:
    options = {"tls_ca": ca, "tls_cert": cert, "tls_key": key} if int(__import__("os").environ["RANK"]) == 0 else {}
    try:
        dist.init_process_group("tcp", init_method="env://", timeout=timedelta(seconds=6), pg_options=options)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        print(f"INIT-FAILED {type(exc).__name__}: {exc}", flush=True)
        return
    print("INIT-SUCCEEDED", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run()
    else:
        mesh_only(*sys.argv[2:5])
