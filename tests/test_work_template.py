"""``Work`` as a template: subclasses implement ``_poll``/``_block`` (and ``_watch``) only;
done-callbacks and work-hook observers that raise are isolated."""

from __future__ import annotations

import logging
import threading
import types
from datetime import timedelta
from typing import Optional

import pytest

import tdist
from tdist.plugin import Work


def test_a_raising_callback_does_not_reach_the_completing_thread_and_the_others_run(caplog):
    work = Work("all_reduce")
    ran: list[str] = []

    def bad(_work: Work) -> None:
        ran.append("bad")
        raise RuntimeError("observer bug")

    work.add_done_callback(bad)
    work.add_done_callback(lambda w: ran.append("good"))
    errors: list[BaseException] = []

    def complete() -> None:  # stands for the backend's progress thread
        try:
            work.set_result(["out"])
        except BaseException as exc:
            errors.append(exc)

    with caplog.at_level(logging.ERROR, logger="tdist"):
        thread = threading.Thread(target=complete)
        thread.start()
        thread.join(10)
    assert errors == [] and ran == ["bad", "good"]
    assert work.result() == ["out"]
    assert "observer bug" in caplog.text
    work.add_done_callback(bad)  # on a completed Work: run at once, still isolated
    assert ran[-1] == "bad"


class _Polled(Work):
    """A Work over an outside request (an Event here), written against the template only."""

    __slots__ = ("request",)

    def __init__(self) -> None:
        super().__init__("recv", default_timeout=5.0)
        self.request = threading.Event()

    def _poll(self) -> bool:
        if self.request.is_set() and not self._done:
            self.set_result(["t"], source_rank=1)
        return self._done

    def _block(self, timeout: Optional[float]) -> bool:
        return self.request.wait(timeout) and self._poll()


def test_a_subclass_implementing_poll_and_block_gets_wait_and_the_rest():
    work = _Polled()
    assert not work.is_completed()
    with pytest.raises(tdist.DistBackendTimeoutError, match="recv: did not complete within 0.05 s"):
        work.wait(timedelta(milliseconds=50))
    work.request.set()
    assert work.wait() and work.is_completed() and work.is_success()
    assert work.source_rank() == 1 and work.result() == ["t"]
    assert work.get_future().wait() == ["t"]


def test_first_party_works_use_the_template():
    """No backend's Work rewrites ``wait``/``is_completed`` or skips ``Work.__init__``."""
    from tdist_gloo.work import GlooWork
    from tdist_mpi._work import MPIWork
    from tdist_nccl.work import NcclWork
    from tdist_tcp.collectives.lanes import TcpWork

    for cls in (GlooWork, MPIWork, NcclWork, TcpWork):
        assert not {"wait", "is_completed", "add_done_callback", "get_future"} & set(vars(cls)), cls
    gloo = GlooWork(None, "barrier")
    assert gloo._callbacks is None and gloo.default_timeout is None  # set by Work.__init__


def test_a_raising_work_hook_observer_is_isolated(caplog):
    """An observer that raises neither fails the operation nor silences the other observers,
    also when the backend completes the operation on its own thread (async_op)."""
    import torch

    from tdist._plugins import plugins, reset_plugins

    seen: list = []
    broken = types.ModuleType("broken_observer")
    broken.TDIST_HOOKSPEC_VERSION = "1.0"

    def _raise(**_kwargs: object) -> None:
        raise RuntimeError("observer bug")

    broken.tdist_work_issued = tdist.hookimpl(lambda info: _raise())
    broken.tdist_work_completed = tdist.hookimpl(lambda info, duration: _raise())
    good = types.ModuleType("good_observer")
    good.TDIST_HOOKSPEC_VERSION = "1.0"
    good.tdist_work_issued = tdist.hookimpl(lambda info: seen.append(("issued", info.op)))
    good.tdist_work_completed = tdist.hookimpl(lambda info, duration: seen.append(("completed", info.op)))
    reset_plugins()
    try:
        plugins().register(good, "good_observer")
        plugins().register(broken, "broken_observer")  # called first (pluggy: last registered, first called)
        tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
        try:
            with caplog.at_level(logging.ERROR, logger="tdist"):
                t = torch.ones(3)
                tdist.all_reduce(t)
                work = tdist.all_reduce(t, async_op=True)
                assert work is not None
                work.wait(timeout=10)
        finally:
            tdist.destroy_process_group()
    finally:
        reset_plugins()
    assert seen == [("issued", "all_reduce"), ("completed", "all_reduce")] * 2, seen
    assert torch.equal(t, torch.ones(3))
    raised = [r for r in caplog.records if r.exc_info and "observer bug" in str(r.exc_info[1])]
    assert len(raised) == 4, caplog.text


def test_a_blocking_call_goes_through_run_blocking_after_the_queued_async_ones():
    from tdist._groups import resolve_group

    tdist.init_process_group("tcp", store=tdist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        backend = resolve_group(None).backend_for("cpu", "all_reduce")  # type: ignore[union-attr]
        seen: list[object] = []
        original = backend.run_blocking

        def spy(call, timeout):
            seen.append(timeout)
            original(call, timeout)

        backend.run_blocking = spy  # type: ignore[method-assign]
        import torch

        queued = tdist.all_reduce(torch.ones(3), async_op=True)  # not through run_blocking
        assert seen == []
        out = torch.ones(2, 3).t()  # non-contiguous: staged, written back after the blocking run
        tdist.all_reduce(out)
        assert seen == [None]
        assert queued.is_completed()  # it was queued first, so it ran first
        assert torch.equal(out, torch.ones(3, 2))
        tdist.barrier()
        assert seen == [None, None]
    finally:
        tdist.destroy_process_group()


def test_the_default_run_blocking_waits_and_refuses_a_non_work():
    from tdist.plugin import Backend, DistError

    class _Stub:  # stands for a backend that does not override run_blocking
        name = "stub"

    done = Work.completed("all_reduce")
    Backend.run_blocking(_Stub(), lambda b: done, None)  # type: ignore[arg-type]
    failed = Work("all_reduce")
    failed.set_exception(RuntimeError("peer lost"))
    with pytest.raises(RuntimeError, match="peer lost"):
        Backend.run_blocking(_Stub(), lambda b: failed, 1.0)  # type: ignore[arg-type]
    with pytest.raises(DistError, match="not a tdist.Work"):
        Backend.run_blocking(_Stub(), lambda b: 42, None)  # type: ignore[arg-type]
