"""Mesh authentication (tdist_tcp.protocol.auth, tdist_tcp.net.mesh): with a secret, a process that read
the store (addresses, group nonce) but does not hold the job's token cannot take a rank's
place, on the TCP or the Unix-domain listener, as a connector or as a listener; ranks
given different tokens fail with errors that say so; random and mutated handshakes
leave the listener serving and leak nothing, as do more silent connections than a
listener holds; and the token reaches the backend through
``init_process_group`` in real processes (file:// rendezvous: the store itself is not
authenticated, the mesh is)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from typing import Optional

import _tcp_jobs as J
import pytest
import torch
from tdist.plugin import HashStore
from _tcp_harness import make_backend, record, run_threads
from hypothesis import given, settings
from hypothesis import strategies as st
from tdist._errors import DistBackendTimeoutError, DistNetworkError
from tdist._reduce_op import ReduceOp, Reduction
from tdist_tcp.net import mesh
from tdist_tcp.protocol.auth import ACCEPTED, HELLO, MAC_SIZE, REFUSED, make_hello
from tdist_tcp.net.connect import Address
from tdist_tcp.net.roster import RECORD_KEY, Record

pytestmark = pytest.mark.timeout(120)
SUM = Reduction(ReduceOp.SUM)
SECRET = b"\x07" * 32


def _rank0(store, out: dict, options: Optional[dict] = None, timeout: float = 60.0) -> threading.Thread:
    """Rank 0 of a world of 2 in a thread: set up, all_reduce ones, record the result."""

    def run() -> None:
        try:
            b = make_backend(store, 0, 2, timeout, options, SECRET)
            try:
                t = torch.ones(3)
                b.all_reduce(t, SUM).wait()
                out["rank0"] = (t.tolist(), b.authenticated)
            finally:
                b.shutdown()
        except BaseException as exc:
            out["rank0"] = exc

    thread = threading.Thread(target=run, name="test-rank-0", daemon=True)
    thread.start()
    return thread


def _rank1(store, options: Optional[dict] = None) -> list:
    b = make_backend(store, 1, 2, 30.0, options, SECRET)
    try:
        t = torch.ones(3)
        b.all_reduce(t, SUM).wait()
        return t.tolist()
    finally:
        b.shutdown()


def _endpoint(store, unix: bool):
    """(family, address) of rank 0's TCP or Unix-domain listener, from the store."""
    where = record(store, 0).address
    if unix:
        return socket.AF_UNIX, "\0" + where.unix
    return socket.AF_INET, (where.host, where.port)


def _exchange(store, unix: bool, data: bytes, half_close: bool = True) -> bytes:
    """Send ``data`` to rank 0's listener as a stranger would; return everything it answers."""
    family, address = _endpoint(store, unix)
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(5.0)
        sock.connect(address)
        sock.sendall(data)
        if not half_close:
            return b""
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        try:
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                reply += chunk
        except ConnectionResetError:
            pass
        return reply


@pytest.mark.parametrize("unix", [False, True], ids=["tcp", "unix"])
def test_impostors_are_refused_and_the_job_completes(unix):
    """Three impostors who read the store try to take rank 1's place: one runs the real
    connector with a wrong key, one with no key, one forges a proof by hand. Each is
    refused with a clear error; then the real rank 1 connects and the job completes."""
    store, out = HashStore(), {}
    options = {"unix": unix}
    thread = _rank0(store, out, options)
    _endpoint(store, unix)  # rank 0 listens
    for key, hint in ((b"\x08" * 32, "different tokens"), (b"", "this one has none")):
        with pytest.raises(DistNetworkError) as info:
            mesh._connect_one(store, 0, 1, 2, key, time.monotonic() + 20, 0, unix)
        text = str(info.value)
        assert "rank 1 cannot authenticate its connection to rank 0" in text, text
        assert "did not prove it knows this group's key" in text and hint in text, text
    nonce = record(store, 0).nonce
    reply = _exchange(store, unix, make_hello(nonce, 1, 2, True) + os.urandom(MAC_SIZE))
    assert len(reply) == HELLO.size + MAC_SIZE + 1 and reply[-1:] == REFUSED, reply
    assert _rank1(store, options) == [2.0, 2.0, 2.0]
    thread.join(30)
    assert out["rank0"] == ([2.0, 2.0, 2.0], True)


def test_listener_that_cannot_prove_the_key_is_refused_at_once():
    """Authentication is mutual: a listener published as rank 0 (e.g. by someone who could
    write the store) that does not know the key is refused by the connecting rank at
    once, not after the timeout."""
    store = HashStore()
    nonce = os.urandom(16)
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        fake_record = Record(Address("127.0.0.1", fake.getsockname()[1], ""), "id:elsewhere", nonce=nonce)
        store.set(RECORD_KEY.format(0), fake_record.encode())

        def answer() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(HELLO.size)
                conn.sendall(make_hello(nonce, 0, 2, True) + os.urandom(MAC_SIZE))
                conn.recv(MAC_SIZE)
                conn.sendall(ACCEPTED)
                time.sleep(1.0)

        threading.Thread(target=answer, daemon=True).start()
        start = time.monotonic()
        with pytest.raises(DistNetworkError, match="rank 0 did not prove it knows this group's key"):
            make_backend(store, 1, 2, 30.0, {"unix": False}, SECRET)
        assert time.monotonic() - start < 10


def test_ranks_with_different_tokens_say_so():
    """Rank 1 fails at once (rank 0's proof does not match); rank 0 times out and reports
    that a connection claiming rank 1 had a wrong proof."""
    results = run_threads(
        2, lambda b, r: None, backend_timeout=2.0, raise_errors=False, timeout=30, secret=[SECRET, b"\x09" * 32]
    )
    assert isinstance(results[1], DistNetworkError), repr(results[1])
    assert "different tokens" in str(results[1])
    assert isinstance(results[0], DistBackendTimeoutError), repr(results[0])
    text = str(results[0])
    assert "a connection claiming rank 1: its proof of the token is wrong (the ranks hold different tokens)" in text


def test_silent_connections_do_not_lock_a_rank_out():
    """More connections that say nothing than a listener holds (MAX_PENDING): the oldest are
    dropped, and the real rank 1 still connects and the job completes."""
    store, out = HashStore(), {}
    thread = _rank0(store, out, {"unix": False})
    family, address = _endpoint(store, False)
    silent = []
    try:
        for _ in range(mesh.MAX_PENDING + 20):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.connect(address)
            silent.append(sock)
        silent[0].settimeout(10)
        assert silent[0].recv(1) == b""  # the oldest was dropped
        assert _rank1(store, {"unix": False}) == [2.0, 2.0, 2.0]
    finally:
        for sock in silent:
            sock.close()
    thread.join(30)
    assert out["rank0"] == ([2.0, 2.0, 2.0], True)


def _xor(data: bytes, flips: list) -> bytes:
    out = bytearray(data)
    for at, mask in flips:
        out[at] ^= mask
    return bytes(out)


def _open_fds() -> set:
    return set(os.listdir("/proc/self/fd"))


def test_fuzzed_handshakes_leave_the_listener_serving_and_leak_nothing():
    """Random bytes and mutations of a valid HELLO (flipped bytes, truncations, forged
    proofs), on the TCP and the Unix-domain listener: none is accepted, the listener keeps
    serving (the real rank 1 connects afterwards), and no descriptor, thread or segment
    is left once the group is destroyed."""
    fds, threads = _open_fds(), set(threading.enumerate())
    store, out = HashStore(), {}
    thread = _rank0(store, out, timeout=90.0)
    _endpoint(store, True)
    valid = make_hello(record(store, 0).nonce, 1, 2, True)
    frames = st.one_of(
        st.binary(max_size=2 * HELLO.size),
        st.lists(st.tuples(st.integers(0, len(valid) - 1), st.integers(1, 255)), min_size=1, max_size=4).map(
            lambda flips: _xor(valid, flips)
        ),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),
        st.binary(max_size=2 * MAC_SIZE).map(lambda tail: valid + tail),  # forged proofs
    )
    answers = []

    @settings(max_examples=120, deadline=None, database=None)
    @given(data=frames, unix=st.booleans(), half_close=st.booleans())
    def attack(data: bytes, unix: bool, half_close: bool) -> None:
        reply = _exchange(store, unix, data, half_close)
        assert reply[HELLO.size + MAC_SIZE : HELLO.size + MAC_SIZE + 1] != ACCEPTED, (data, reply)
        answers.append(len(reply))

    attack()
    assert any(answers), "no fuzzed HELLO got as far as an answer: the mutations are too coarse"
    assert _rank1(store) == [2.0, 2.0, 2.0]
    thread.join(30)
    assert out["rank0"] == ([2.0, 2.0, 2.0], True)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (_open_fds() - fds or set(threading.enumerate()) - threads):
        time.sleep(0.05)
    assert _open_fds() - fds == set(), "descriptors left open"
    assert {t.name for t in set(threading.enumerate()) - threads} == set()
    assert J.shm_mapped() == set() and J.shm_fds() == set() and J.shm_files([os.getpid()]) == []


_RANK_PROGRAM = """
import sys
from datetime import timedelta
import torch
import tdist as dist
from tdist._groups import STATE

rank, path = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("tcp", init_method="file://" + path, rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
t = torch.ones(4) * (rank + 1)
dist.all_reduce(t)
print("RESULT", t.tolist(), STATE.world.backend_for("cpu", "all_reduce").authenticated, flush=True)
dist.destroy_process_group()
"""


def test_token_from_the_environment_protects_a_file_rendezvous(tmp_path):
    """Real processes, file:// rendezvous (a store anyone who can open the file can read and
    write), TDIST_STORE_TOKEN set: an impostor who joins the rendezvous as rank 1 through
    the file cannot connect to rank 0 as rank 1; the real rank 1 then can."""
    from tdist import FileStore, PrefixStore

    path = str(tmp_path / "rendezvous")
    env = {**os.environ, "TDIST_STORE_TOKEN": "job-secret", "TDIST_TCP_SHM": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_PROGRAM, "0", path],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    ]
    try:
        shared = FileStore(path, -1, timeout=60)
        world = PrefixStore("tdist/world/" + shared.get("tdist/incarnation", timeout=60).decode().split()[0], shared)
        world.wait(["tdist/init/joined/0"], timeout=60)
        # rank 0 now believes rank 1 arrived, and named the same backend
        world.set("tdist/init/joined/1", world.get("tdist/init/joined/0"))
        store = PrefixStore("tcp", PrefixStore("pg0", world))
        store.wait([RECORD_KEY.format(0)], timeout=60)
        with pytest.raises(DistNetworkError, match="did not prove it knows this group's key"):
            mesh._connect_one(store, 0, 1, 2, b"\x01" * 32, time.monotonic() + 20, 0, True)
        world.delete_key("tdist/init/joined/1")  # else the real rank 1 is refused as a second rank 1
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", _RANK_PROGRAM, "1", path],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
        outputs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for rank, (p, output) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {rank}:\n{output}"
        assert "RESULT [3.0, 3.0, 3.0, 3.0] True" in output, output
