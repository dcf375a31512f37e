"""Programs for tests/test_torchft.py, run as separate processes.

``contract BACKEND RANK PORT``: two processes drive :class:`tdist.integrations.torchft.ProcessGroupTdist`
as torchft's Manager does (configure on a fresh store prefix, operations, a peer that dies,
configure again) and print one ``CONTRACT {json}`` line of what they saw.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as torch_dist


def contract(backend: str, rank: int, port: int) -> None:
    from tdist.integrations.torchft import ProcessGroupTdist

    seen: dict = {}
    if rank == 0:
        store = torch_dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841
    pg = ProcessGroupTdist(backend=backend, timeout=timedelta(seconds=20))
    seen["name"] = pg.getBackendName()
    pg.configure(f"127.0.0.1:{port}/torchft/1/0", "replica", rank, 2)
    seen["size"] = pg.size()
    t = torch.ones(4) * (rank + 1)
    pg.allreduce([t], torch_dist.AllreduceOptions()).wait()
    seen["all_reduce"] = t.tolist()
    opts = torch_dist.BroadcastOptions()
    opts.rootRank = 1
    b = torch.full((2,), float(rank))
    pg.broadcast([b], opts).wait()
    seen["broadcast"] = b.tolist()
    if rank == 0:
        pg.send([torch.arange(3.0)], 1, 0).wait()
    else:
        r = torch.zeros(3)
        pg.recv([r], 0, 0).wait()
        seen["recv"] = r.tolist()
    future = pg.allreduce([torch.ones(2)], torch_dist.AllreduceOptions()).get_future()
    seen["future"] = [x.tolist() for x in future.wait()]
    seen["errored_healthy"] = pg.errored() is None
    # torchft gives every configure a fresh prefix; the old group is aborted first.
    pg.configure(f"127.0.0.1:{port}/torchft/2/0", "replica", rank, 2)
    t = torch.ones(1) * (rank + 1)
    pg.allreduce([t], torch_dist.AllreduceOptions()).wait()
    seen["after_reconfigure"] = t.tolist()
    pg.barrier(torch_dist.BarrierOptions()).wait()
    if rank == 1:
        print(f"CONTRACT {json.dumps(seen)}", flush=True)
        os._exit(0)  # dies without a goodbye, as a SIGKILLed peer
    work = pg.allreduce([torch.ones(2)], torch_dist.AllreduceOptions())
    try:
        work.wait()
        seen["wait_raised"] = False
    except Exception as exc:  # noqa: BLE001 - what the test checks
        seen["wait_raised"] = repr(exc)
    work.get_future().wait()
    seen["errored_after_death"] = type(pg.errored()).__name__ if pg.errored() is not None else None
    pg.configure(f"127.0.0.1:{port}/torchft/3/0", "replica", 0, 1)
    seen["errored_after_configure"] = pg.errored() is None
    t = torch.ones(1) * 5
    pg.allreduce([t], torch_dist.AllreduceOptions()).wait()
    seen["alone"] = t.tolist()
    pg.abort()
    seen["errored_after_abort"] = pg.errored() is not None
    # No group until the next configure: an operation fails its Work, it does not raise.
    late = pg.allreduce([torch.ones(1)], torch_dist.AllreduceOptions())
    late.wait()
    seen["late_future"] = [x.tolist() for x in late.get_future().wait()]
    pg.shutdown()
    print(f"CONTRACT {json.dumps(seen)}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "contract":
        contract(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown program {sys.argv[1]!r}")
