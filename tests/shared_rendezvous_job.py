"""One process of a job that shares its rendezvous (``group_name``) with other jobs.

    python shared_rendezvous_job.py INIT_METHOD GROUP WORLD_SIZE STATE_DIR [RANK]

Initialises the tcp backend (rank assigned unless RANK is given), all_reduces its
rank + 1 and writes ``STATE_DIR/GROUP-RANK.ready``; then waits for
``STATE_DIR/GROUP.go`` (if the test asks for it with TDIST_TEST_HOLD=1) and uses the
store again (new_group, monitored_barrier) before an all_reduce in the new group and
destroy_process_group. Prints ``RESULT GROUP RANK SUM SUM2``.
"""

import os
import sys
import time
from datetime import timedelta

import torch

import tdist as dist

init_method, group, world_size, state = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
rank = int(sys.argv[5]) if len(sys.argv) > 5 else -1
dist.init_process_group(
    "tcp", init_method=init_method, world_size=world_size, rank=rank, group_name=group, timeout=timedelta(seconds=60)
)
me = dist.get_rank()
t = torch.tensor([float(me + 1)])
dist.all_reduce(t)
open(os.path.join(state, f"{group}-{me}.ready"), "w").close()
if os.environ.get("TDIST_TEST_HOLD") == "1":
    deadline = time.monotonic() + 90
    while not os.path.exists(os.path.join(state, f"{group}.go")):
        assert time.monotonic() < deadline, "never told to go on"
        time.sleep(0.05)
g = dist.new_group(list(range(world_size)))
dist.monitored_barrier(timeout=timedelta(seconds=30))
t2 = torch.tensor([float(me + 1)])
dist.all_reduce(t2, group=g)
dist.destroy_process_group()
print(f"RESULT {group} {me} {t.item():g} {t2.item():g}", flush=True)
