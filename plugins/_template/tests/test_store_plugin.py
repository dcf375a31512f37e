"""Registration through the entry point, the hook contract version, the spec, and
the backend itself in one process (two ranks on threads over a HashStore)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import tdist

pytest.importorskip("tdist_template", reason="tdist-template is not installed: pip install -e <this folder> first")

from tdist_template import BACKEND_NAME, SCHEME, plugin


def test_entry_point_names_the_plugin_module():
    eps = [ep for ep in importlib.metadata.entry_points(group="tdist") if ep.name == BACKEND_NAME]
    assert [ep.value for ep in eps] == ["tdist_template.plugin"]


def test_hook_contract_version_fits_this_tdist():
    major, minor = (int(x) for x in plugin.TDIST_HOOKSPEC_VERSION.split("."))
    assert major == tdist.HOOKSPEC_VERSION[0] and minor <= tdist.HOOKSPEC_VERSION[1]


def test_registered_through_tdist():
    assert tdist.is_backend_available(BACKEND_NAME)
    spec = tdist.get_backend_spec(BACKEND_NAME)
    assert spec.distribution == "tdist-template"
    assert spec.operations["cpu"] == frozenset(tdist.OPERATIONS) | {tdist.ANY_SOURCE_OP}
    from tdist._plugins import plugins

    assert plugins().rendezvous.get(SCHEME) is not None


def test_importing_the_plugin_imports_no_torch():
    code = (
        "import sys, tdist_template.plugin; print([m for m in ('torch', 'tdist_template.backend') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# ----------------------------------------------------- the backend on threads
def _pair(store=None, timeout=10.0):
    from tdist_template.backend import StoreBackend

    store = store or tdist.HashStore()
    return store, [StoreBackend(store, r, 2, timedelta(seconds=timeout)) for r in range(2)]


def _on_both(backends, fn):
    """Run fn(backend) on two threads (one per rank); return their results."""
    results, errors = [None, None], []

    def go(r):
        try:
            results[r] = fn(backends[r])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


def test_all_reduce_leaves_no_key_behind():
    import torch

    store, backends = _pair()
    before = store.num_keys()

    def body(b):
        t = torch.full((3,), float(b.rank + 1))
        b.all_reduce(t, tdist.Reduction(tdist.ReduceOp.SUM)).wait()
        b.barrier().wait()
        return t.tolist()

    assert _on_both(backends, body) == [[3.0] * 3, [3.0] * 3]
    for b in backends:
        b.shutdown()
    assert store.num_keys() - before <= 1  # at most the last collective's "done" counter in flight


def test_mismatch_raises_on_every_rank():
    import torch

    _, backends = _pair()

    def body(b):
        t = torch.ones(4 if b.rank == 0 else 8)
        with pytest.raises(tdist.DistBackendError, match="different collectives"):
            b.all_reduce(t, tdist.Reduction(tdist.ReduceOp.SUM)).wait()
        t = torch.ones(2)
        b.all_reduce(t, tdist.Reduction(tdist.ReduceOp.SUM)).wait()  # the group still works
        return t.tolist()

    assert _on_both(backends, body) == [[2.0, 2.0], [2.0, 2.0]]


def test_receives_match_in_posting_order():
    import torch

    _, backends = _pair()
    b0, b1 = backends
    for value in (1.0, 2.0, 3.0):
        b1.send(torch.full((1,), value), 0, 0).wait()
    first, second, third = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    w1 = b0.recv(first, None, 0)  # any source
    w2 = b0.recv(second, 1, 0)
    w3 = b0.recv(third, None, 0)
    assert [w.source_rank() for w in (w1, w2, w3)] == [1, 1, 1]
    assert [first.item(), second.item(), third.item()] == [1.0, 2.0, 3.0]  # messages from one rank stay in order


def test_a_later_receive_completes_first_whatever_the_shapes():
    """Receives of different shapes pending at once: the one whose message is there
    completes while an earlier one still waits (pending receives are told apart by
    identity, never by comparing their tensors)."""
    import torch

    _, (b0, b1) = _pair()
    early, late = torch.zeros(3), torch.zeros(4)
    w_early = b1.recv(early, 0, 1)
    w_late = b1.recv(late, 0, 2)
    b0.send(torch.full((4,), 2.0), 1, 2).wait()
    w_late.wait(10)
    assert late.tolist() == [2.0] * 4 and not w_early.is_completed()
    b0.send(torch.full((3,), 1.0), 1, 1).wait()
    w_early.wait(10)
    assert early.tolist() == [1.0] * 3


def test_large_payloads_are_split(monkeypatch):
    import torch
    from tdist_template import backend

    monkeypatch.setattr(backend, "CHUNK_BYTES", 1000)
    store, (b0, b1) = _pair()
    t = torch.arange(1000, dtype=torch.float32)
    b0.send(t, 1, 7).wait()
    assert store.num_keys() > 2  # 4000 bytes in 1000-byte parts
    out = torch.zeros(1000)
    b1.recv(out, 0, 7).wait()
    assert torch.equal(out, t) and store.num_keys() == 0


def test_recv_times_out_naming_the_peer():
    import torch

    _, (b0, _b1) = _pair(timeout=0.5)
    with pytest.raises(tdist.DistBackendTimeoutError, match="rank 1"):
        b0.recv(torch.zeros(1), 1, 0).wait()


def test_unreducible_dtype_rejected_before_communicating():
    import torch

    _, (b0, _b1) = _pair()
    with pytest.raises(TypeError, match="cannot reduce"):
        b0.all_reduce(torch.zeros(2, dtype=torch.uint16), tdist.Reduction(tdist.ReduceOp.SUM))  # no uint16 add in torch
