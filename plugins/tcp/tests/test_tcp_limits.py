"""What an authenticated peer can put into this rank's errors is bounded: a 1 MiB ABORT
reason is cut to about 1 KiB, saying how much was left out (real sockets, ranks as threads)."""

from __future__ import annotations

import json

import _tcp_jobs as J
import pytest
import torch
from tdist.plugin import HashStore
from _tcp_harness import run_threads
from tdist_tcp.net.transport import ABORT_REASON_CHARS, clip_reason

pytestmark = pytest.mark.timeout(60)


def test_clip_reason_keeps_short_text_and_counts_what_it_cuts():
    assert clip_reason("short") == "short"
    assert clip_reason("é" * 10, limit=4) == "éééé… (12 bytes omitted)"


def test_a_megabyte_abort_reason_is_cut_to_a_kilobyte():
    store = HashStore()
    reason = "x" * ((1 << 20) - 100)

    def body(b, rank):
        if rank == 0:  # an authenticated peer sends an ABORT frame of (almost) the 1 MiB limit
            payload = json.dumps({"reason": reason, "timeout": True, "missing": [1] * 10}).encode()
            assert len(payload) <= 1 << 20
            b._tr._send_aborts(payload)
            store.wait(["seen"])  # until rank 1 has it: its BYE must not come first
            return None
        try:
            return J.describe_error(lambda: b.recv(torch.ones(1), 0, 0).wait())
        finally:
            store.set("seen", "1")

    _, (name, text, _elapsed) = run_threads(2, body, store=store, backend_timeout=20)
    assert name == "DistBackendTimeoutError", text
    assert len(text) < ABORT_REASON_CHARS + 300, len(text)
    assert f"… ({len(reason) - ABORT_REASON_CHARS} bytes omitted)" in text, text[-200:]
    assert text.count("x") == ABORT_REASON_CHARS
