"""Conformance bodies: bad arguments raise a clear error without communicating,
and the world keeps working afterwards (each body ends with a real all_reduce).

Each bad call is made only on the ranks where it is wrong by themselves (e.g.
``scatter_list`` given on a non-source rank), so that no rank is left waiting
for a peer that raised. The checks tdist promises beyond torch.distributed
(validating peers of point-to-point calls, error classes) are gated on
:func:`~tdist.testing.helpers.is_tdist`.
"""

from __future__ import annotations

from typing import Any

from ._registry import body
from .helpers import assert_tensor, assert_true, check_world_works, dist, is_tdist, raises

__all__ = [
    "bad_roots",
    "bad_p2p_peers",
    "send_to_self",
    "bad_tensor_lists",
    "bad_tensor_sizes",
    "bad_root_only_arguments",
    "bad_group_ranks",
    "bad_argument_types",
    "init_twice",
    "interrupt_during_collective",
]

_ARG_ERRORS = (ValueError, TypeError, RuntimeError)


def _torch():
    import torch

    return torch


def _clear(exc: Any, what: str) -> None:
    """tdist's errors are ValueError/TypeError or a DistError (a RuntimeError), with a message."""
    if exc is None:
        return
    assert_true(str(exc).strip() != "", f"{what}: {type(exc).__name__} with an empty message")
    if is_tdist():
        assert_true(
            isinstance(exc, (ValueError, TypeError, dist.DistError)),
            f"{what}: raised {type(exc).__name__}, expected ValueError, TypeError or a tdist DistError",
        )


def _expect(what: str, fn: Any, *args: Any, **kwargs: Any) -> None:
    with raises(*_ARG_ERRORS, what=what) as caught:
        fn(*args, **kwargs)
    _clear(caught.value, what)


@body
def bad_roots():
    """broadcast/reduce/gather/scatter with a root outside the world raise on every rank."""
    torch = _torch()
    n = dist.get_world_size()
    for root in (n, n + 3):
        _expect(f"broadcast(src={root})", dist.broadcast, torch.ones(2), src=root)
        _expect(f"reduce(dst={root})", dist.reduce, torch.ones(2), dst=root)
        if is_tdist():  # torch gloo waits for the missing root instead
            _expect(f"gather(dst={root})", dist.gather, torch.ones(2), None, dst=root)
            _expect(f"scatter(src={root})", dist.scatter, torch.ones(2), None, src=root)
    if is_tdist():
        _expect("broadcast(src=-1)", dist.broadcast, torch.ones(2), src=-1)
    check_world_works("bad roots")


@body(tdist_only="torch.distributed does not validate point-to-point peers (send to rank n waits on the store)")
def bad_p2p_peers():
    """send/recv/isend/irecv to a rank outside the world, or to oneself, raise at once."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    for peer in (n, n + 1, -2):
        _expect(f"send(dst={peer})", dist.send, torch.ones(1), dst=peer)
        _expect(f"isend(dst={peer})", dist.isend, torch.ones(1), dst=peer)
        _expect(f"recv(src={peer})", dist.recv, torch.ones(1), src=peer)
        _expect(f"irecv(src={peer})", dist.irecv, torch.ones(1), src=peer)
    _expect("send to self", dist.send, torch.ones(1), dst=r)
    _expect("recv from self", dist.recv, torch.ones(1), src=r)
    check_world_works("bad p2p peers")


@body
def send_to_self():
    """send to one's own rank is a ValueError (as in torch.distributed)."""
    torch = _torch()
    r = dist.get_rank()
    _expect("send to self", dist.send, torch.ones(1), dst=r)
    check_world_works("send to self")


@body
def bad_tensor_lists():
    """all_gather / all_to_all / reduce_scatter with a list of the wrong length raise on every rank."""
    torch = _torch()
    from .helpers import supports

    n = dist.get_world_size()
    _expect("all_gather with n+1 outputs", dist.all_gather, [torch.zeros(2) for _ in range(n + 1)], torch.ones(2))
    _expect("all_gather with an empty list", dist.all_gather, [], torch.ones(2))
    if n > 1:
        _expect("all_gather with n-1 outputs", dist.all_gather, [torch.zeros(2) for _ in range(n - 1)], torch.ones(2))
    if supports("reduce_scatter"):
        _expect(
            "reduce_scatter with n+1 inputs", dist.reduce_scatter, torch.zeros(2), [torch.ones(2) for _ in range(n + 1)]
        )
    if supports("all_to_all") and is_tdist():
        _expect(
            "all_to_all with n+1 inputs",
            dist.all_to_all,
            [torch.zeros(1) for _ in range(n)],
            [torch.ones(1) for _ in range(n + 1)],
        )
    check_world_works("wrong list lengths")


@body
def bad_tensor_sizes():
    """Mismatched tensor sizes within one rank's arguments raise on every rank."""
    torch = _torch()
    from .helpers import supports

    n = dist.get_world_size()
    _expect(
        "all_gather outputs larger than the input", dist.all_gather, [torch.zeros(3) for _ in range(n)], torch.ones(2)
    )
    if supports("all_gather_into_tensor"):
        _expect(
            "all_gather_into_tensor with a wrong output size",
            dist.all_gather_into_tensor,
            torch.zeros(2 * n + 1),
            torch.ones(2),
        )
    if supports("reduce_scatter_tensor"):
        _expect(
            "reduce_scatter_tensor with a wrong input size",
            dist.reduce_scatter_tensor,
            torch.zeros(2),
            torch.ones(2 * n + 1),
        )
    if supports("all_to_all_single"):
        _expect(
            "all_to_all_single with split sizes not matching the tensors",
            dist.all_to_all_single,
            torch.zeros(n),
            torch.ones(n),
            [2] * n,
            [1] * n,
        )
    check_world_works("mismatched sizes")


@body(min_world_size=2)
def bad_root_only_arguments():
    """scatter_list / gather_list given on a non-root rank, or with the wrong length on the
    root, raise on that rank (the only rank that calls)."""
    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    if r != 0:
        _expect(
            "scatter_list on a non-source rank", dist.scatter, torch.zeros(1), [torch.ones(1) for _ in range(n)], src=0
        )
        _expect(
            "gather_list on a non-destination rank",
            dist.gather,
            torch.zeros(1),
            [torch.zeros(1) for _ in range(n)],
            dst=0,
        )
    else:
        _expect(
            "scatter_list of n+1 tensors on the source",
            dist.scatter,
            torch.zeros(1),
            [torch.ones(1) for _ in range(n + 1)],
            src=0,
        )
        if is_tdist():  # torch gloo fails later, from inside the collective
            _expect(
                "gather_list of n-1 tensors on the destination",
                dist.gather,
                torch.zeros(1),
                [torch.zeros(1) for _ in range(n - 1)],
                dst=0,
            )
    check_world_works("root-only arguments")


@body
def bad_group_ranks():
    """new_group with a rank outside the world (or repeated, for tdist) raises on every rank;
    get_global_rank / get_group_rank outside the group raise."""
    n = dist.get_world_size()
    _expect(f"new_group([0, {n}])", dist.new_group, [0, n])
    _expect("new_group([-1])", dist.new_group, [-1])
    if is_tdist():
        if n > 1:
            _expect("new_group([0, 0, 1]) (duplicate rank)", dist.new_group, [0, 0, 1])
        _expect(f"get_global_rank(WORLD, {n})", dist.get_global_rank, dist.group.WORLD, n)
        _expect(f"get_group_rank(WORLD, {n})", dist.get_group_rank, dist.group.WORLD, n)
    check_world_works("bad group ranks")


@body
def bad_argument_types():
    """A non-tensor where a tensor is expected raises TypeError/ValueError-like errors, no I/O."""
    torch = _torch()
    _expect("all_reduce of a list", dist.all_reduce, [1.0, 2.0])
    _expect("broadcast of a number", dist.broadcast, 3.0, src=0)
    _expect("all_gather with a tensor instead of a list", dist.all_gather, torch.zeros(2), torch.ones(2))
    check_world_works("bad argument types")


@body
def init_twice():
    """init_process_group while initialised raises, and the default group keeps working."""
    from .helpers import backend_name

    _expect("second init_process_group", dist.init_process_group, backend_name())
    assert_true(dist.is_initialized(), "is_initialized() became False after a rejected second init")
    check_world_works("init twice")


# ------------------------------------------------------------------ an interrupt in a collective
def _in_collective(frame: Any) -> bool:
    """Whether the stack of ``frame`` is inside a collective that has been issued: tdist's
    ``Backend.run_blocking`` (any backend's), or torch.distributed's ``all_reduce`` (whose
    wait is C++, below the last Python frame)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "run_blocking":
            return True
        if not is_tdist() and code.co_name == "all_reduce" and code.co_filename.endswith("distributed_c10d.py"):
            return True
        frame = frame.f_back
    return False


def _interrupt_main_once_waiting(folder: str) -> None:
    """(A thread of rank 0.) Once the main thread waits in the collective, write
    ``signalled`` and send it SIGINT (as Ctrl-C or a launcher would; the signal interrupts
    the blocking call, which ``_thread.interrupt_main`` would not)."""
    import os
    import signal
    import sys
    import threading
    import time

    main = threading.main_thread()
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main.ident or 0)
        if frame is not None and _in_collective(frame):
            break
        time.sleep(0.01)
    time.sleep(0.2)  # into the blocking wait itself (a margin, not a measurement)
    with open(os.path.join(folder, "signalled"), "w"):
        pass
    signal.pthread_kill(main.ident or 0, signal.SIGINT)


def _wait_file(path: str, seconds: float) -> bool:
    import os
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.01)
    return False


def _outcome(fn: Any) -> dict:
    """``fn()``'s outcome: ``{"ok": True}`` or what it raised (type, tdist error or not, message)."""
    try:
        fn()
    except Exception as exc:
        error = isinstance(exc, dist.DistError) if is_tdist() else isinstance(exc, RuntimeError)
        return {"ok": False, "type": type(exc).__name__, "dist_error": error, "message": str(exc)[:300]}
    return {"ok": True}


@body(min_world_size=2, timeout=120)
def interrupt_during_collective():
    """SIGINT while rank 0 waits in a blocking all_reduce reaches rank 0 as the
    KeyboardInterrupt itself, never wrapped in a backend error. Afterwards the group either
    still works on every rank (gloo, mpi: the operation completes in the background) or
    fails cleanly on every rank with a backend error (tcp, when the interrupted rank ran
    the collective itself: its half-done collective breaks the group); no rank hangs, and
    the other groups (the default one) are untouched."""
    import os
    import shutil
    import signal
    import tempfile
    import threading
    import time
    from datetime import timedelta

    torch = _torch()
    r, n = dist.get_rank(), dist.get_world_size()
    box = [tempfile.mkdtemp(prefix="tdist-kit-interrupt-") if r == 0 else ""]
    dist.broadcast_object_list(box, src=0)
    folder = box[0]
    group = dist.new_group(list(range(n)), timeout=timedelta(seconds=30))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    report = {"rank": r}
    try:
        t = torch.ones(4)
        if r == 0:
            thread = threading.Thread(target=_interrupt_main_once_waiting, args=(folder,), daemon=True)
            try:
                thread.start()
                dist.all_reduce(t, group=group)
                report["completed"] = True  # (gloo: the interrupt lands once the wait returns)
                thread.join(30.0)
                for _ in range(1000):  # the interrupt is on its way: let it arrive here
                    time.sleep(0.01)
                report["interrupt"] = None
            except BaseException as exc:  # noqa: BLE001 - what arrives is the point
                report["interrupt"] = type(exc).__name__
                report["interrupt_message"] = str(exc)[:300]
            thread.join(30.0)
            with open(os.path.join(folder, "caught"), "w"):
                pass
        else:
            assert_true(_wait_file(os.path.join(folder, "signalled"), 60.0), "rank 0 never sent its SIGINT")
            # tcp: rank 0 catches it at once; gloo and torch: only once this collective completes
            _wait_file(os.path.join(folder, "caught"), 2.0)
            report["first"] = _outcome(lambda: dist.all_reduce(t, group=group))
        t2 = torch.ones(4) * (r + 1)
        report["second"] = _outcome(lambda: dist.all_reduce(t2, group=group))
        if report["second"]["ok"]:
            assert_tensor(t2, torch.ones(4) * (n * (n + 1) / 2), "all_reduce after the interrupt")
    finally:
        signal.signal(signal.SIGINT, previous)
    reports = [None] * n
    dist.all_gather_object(reports, report)
    dist.destroy_process_group(group)
    check_world_works("an interrupted collective in another group")
    dist.barrier()
    if r == 0:
        shutil.rmtree(folder, ignore_errors=True)
    first = reports[0]
    assert_true(
        first.get("interrupt") == "KeyboardInterrupt",
        f"rank 0 was sent SIGINT in all_reduce and got {first.get('interrupt')!r} "
        f"({first.get('interrupt_message', 'nothing raised')}), expected KeyboardInterrupt",
    )
    for rep in reports:
        for key in ("first", "second"):
            got = rep.get(key)
            if got is not None and not got["ok"]:
                assert_true(
                    "KeyboardInterrupt" not in got["type"],
                    f"rank {rep['rank']}'s {key} all_reduce raised {got['type']}: {got['message']}",
                )
    seconds = [rep["second"] for rep in reports]
    usable = all(s["ok"] for s in seconds)
    if not usable:
        for rep in reports:
            s = rep["second"]
            assert_true(
                not s["ok"] and s["dist_error"],
                f"after rank 0's interrupt the group neither works everywhere nor fails cleanly everywhere: "
                f"rank {rep['rank']}'s next all_reduce gave {s} (all: {seconds})",
            )
    return {"usable": usable, "rank0_completed": bool(first.get("completed"))}
