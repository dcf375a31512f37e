"""A bounded fuzz test of the TCPStore protocol (hypothesis): random bytes before the
handshake, random and mutated request frames after it. After every example the server
still serves a legitimate client; at the end nothing is left behind (connections, parked
requests, file descriptors, threads)."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Iterator

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tdist._store import TCPStore, TCPStoreServer, tcp_protocol as P, tcp_store  # noqa: E402

HOST = "127.0.0.1"
TOKEN = "fuzz-token"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

pytestmark = pytest.mark.timeout(120)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest) -> Iterator[dict]:
    """One server with a token (pre-handshake fuzzing) and one without (request fuzzing), and a
    legitimate client of each; at the end, checks that nothing leaked."""
    os.environ.pop(tcp_store.TOKEN_ENV, None)
    fds, threads = _open_fds(), set(threading.enumerate())
    guarded = TCPStoreServer(HOST, 0, token=TOKEN, handshake_timeout=0.5).start()
    open_ = TCPStoreServer(HOST, 0, token="").start()
    clients = {
        "guarded": TCPStore(HOST, guarded.port, timeout=10, token=TOKEN),
        "open": TCPStore(HOST, open_.port, timeout=10, token=""),
    }
    yield {"guarded": guarded, "open": open_, **{f"{k}_client": v for k, v in clients.items()}}
    for server, client in ((guarded, clients["guarded"]), (open_, clients["open"])):
        assert client.ping(b"still here") == b"still here"
        assert server.pending_handshakes == 0 and server.parked_requests == 0 and server.connections == 1
        client.close()
        server.stop()
    assert not set(threading.enumerate()) - threads  # the servers' event-loop threads ended
    assert _open_fds() <= fds  # (other tests' sockets may close meanwhile; none of ours may stay open)


def _send_and_drain(port: int, data: bytes) -> None:
    """Send ``data`` on a new connection, read what comes back for a moment, close."""
    sock = socket.create_connection((HOST, port), timeout=2)
    try:
        sock.sendall(data)
        sock.settimeout(0.02)
        while sock.recv(65536):
            pass
    except OSError:  # timed out waiting, or the server closed/reset the connection
        pass
    finally:
        sock.close()


def _wait_until_idle(server: TCPStoreServer) -> None:
    """The server has seen every fuzz connection close (the legitimate client's stays)."""
    deadline = time.monotonic() + 5
    while (server.connections > 1 or server.parked_requests) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert server.connections == 1 and server.parked_requests == 0


HELLO = P.MAGIC + bytes([P.VERSION])
_key = st.binary(max_size=12)
_timeout = st.sampled_from(
    [P.F64.pack(0.0), P.F64.pack(0.001), P.F64.pack(1e300), P.F64.pack(float("nan")), P.F64.pack(-1.0), b"\x00" * 3]
)


@st.composite
def request_frames(draw: st.DrawFn) -> bytes:
    """A well-formed request of a real command (valid or not in content), or a random one."""
    cmd = draw(st.sampled_from(sorted(P.ARITY)) | st.integers(0, 255))
    if cmd in (P.GET, P.WAIT, P.MULTI_GET):
        args = [draw(_timeout)] + draw(st.lists(_key, min_size=1, max_size=4))
    elif cmd == P.QUEUE_POP:
        args = [draw(st.sampled_from([b"\x00", b"\x01"])), draw(_timeout), draw(_key)]
    elif cmd == P.BARRIER:
        args = [draw(_timeout), draw(_key), draw(st.sampled_from([b"1", b"2", b"x", b"9" * 40]))]
    elif cmd == P.ADD:
        args = [draw(_key), draw(st.sampled_from([b"1", b"-5", b"abc", b"", b"9" * 40]))]
    else:
        args = draw(st.lists(_key, max_size=5))
    return P.encode_request(cmd, args)


@st.composite
def mutated(draw: st.DrawFn, frames: st.SearchStrategy) -> bytes:
    data = bytearray(b"".join(draw(st.lists(frames, min_size=1, max_size=4))))
    for _ in range(draw(st.integers(0, 3))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif action == "cut":
            del data[at:]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@FUZZ
@given(first=st.one_of(st.binary(max_size=120), st.builds(lambda tail: HELLO + tail, st.binary(max_size=80))))
def test_fuzz_before_the_handshake(servers: dict, first: bytes) -> None:
    _send_and_drain(servers["guarded"].port, first)
    assert servers["guarded_client"].set("k", first) is None and servers["guarded_client"].get("k") == first


@FUZZ
@given(frames=mutated(request_frames()))
def test_fuzz_requests(servers: dict, frames: bytes) -> None:
    hello = HELLO + os.urandom(P.NONCE_BYTES)
    _send_and_drain(servers["open"].port, hello + frames)
    client = servers["open_client"]
    client.set("alive", frames)
    assert client.get("alive") == frames


def test_fuzzed_servers_are_idle_afterwards(servers: dict) -> None:
    for name in ("guarded", "open"):
        _wait_until_idle(servers[name])
