"""A request that a revocation leaves pending (as Open MPI's non-blocking collectives may)
fails with MPI_ERR_REVOKED at the next poll past the spinning phase, whether a done-callback's
polling thread or a blocked ``wait()`` sees it; an unrevoked one stays pending, and a
request that completed before the poll saw the revocation completes normally.

The request is a stand-in (its ``Test()`` answers what the test wants); MPI itself is real:
the error is made from ``MPI_ERR_REVOKED`` by the work's ``convert``. One rank."""

import threading
import time

from tdist.plugin import DistBackendError
from tdist_mpi._work import _ABANDONED, YIELD_S, MPIWork
from tdist_mpi._runtime import runtime


class Request:
    """An MPI request whose Test() returns ``done`` (never completes by default)."""

    def __init__(self) -> None:
        self.done = False
        self.tests = 0

    def Test(self, status=None) -> bool:  # noqa: N802 - mpi4py's name
        self.tests += 1
        return self.done


def convert(operation: str, exc: BaseException) -> BaseException:
    return DistBackendError(f"{operation}: {exc}")


runtime()  # MPI_Init: the error class and the exception are MPI's own
revoked = threading.Event()

# 1. A done-callback's poll: pending while not revoked, failed once revoked.
req = Request()
work = MPIWork("all_reduce", req, 60.0, convert=convert, revoked=revoked.is_set)
called = threading.Event()
work.add_done_callback(lambda w: called.set())
time.sleep(0.2)
assert not called.is_set() and req.tests > 1, "the polling thread does not test the request, or completed it"
revoked.set()
assert called.wait(10), "the polling thread did not fail a request the revocation left pending"
assert "MPI_ERR_REVOKED" in str(work.exception()), work.exception()
assert any(entry[0] is req for entry in _ABANDONED), "the abandoned request is not kept (MPI may still write)"
print("POLL OK", flush=True)

# 2. A blocked wait(): fails within the yielding phase's first batches, not at the timeout.
revoked.clear()
req = Request()
work = MPIWork("broadcast", req, 60.0, convert=convert, revoked=revoked.is_set)
threading.Timer(0.3, revoked.set).start()
start = time.monotonic()
try:
    work.wait()
except DistBackendError as exc:
    assert "MPI_ERR_REVOKED" in str(exc), exc
else:
    raise AssertionError("a blocked wait() on a request the revocation left pending did not raise")
took = time.monotonic() - start
assert took < 0.3 + YIELD_S + 5, f"the blocked wait() took {took:.2f} s to see the revocation"
print("WAIT OK", flush=True)

# 3. Completed before the revocation was looked at: the work succeeds.
req = Request()
req.done = True
work = MPIWork("all_reduce", req, 60.0, convert=convert, revoked=lambda: True)
assert work.is_completed() and work.is_success(), f"a completed request was failed: {work.exception()}"
print("DONE OK", flush=True)
