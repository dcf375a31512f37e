"""MPI_Init must not hold the GIL: rank 0 serves a TCPStore (as under env://) and starts
MPI at once; rank 1 first needs that store (a late peer), then starts MPI.
Run: mpirun -n 2 python init_gil.py PORT"""

import os
import sys
import time
from datetime import timedelta

from tdist import TCPStore

port = int(sys.argv[1])
rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if rank == 0:
    store = TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=20), wait_for_workers=False)
else:
    time.sleep(1.5)  # rank 0 is inside MPI_Init by now
    store = TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=8), wait_for_workers=False)
    store.set("late", "1")  # needs rank 0's server threads to run during its MPI_Init
from tdist_mpi._runtime import runtime  # noqa: E402

started = time.monotonic()
rt = runtime()
assert store.get("late", timeout=20) == b"1"
print(f"INIT OK rank {rt.world_rank} {rt.thread_level_name} in {time.monotonic() - started:.1f}s", flush=True)
rt.world.Barrier()  # rank 0's server stays up until rank 1 is done with it
store.close()
