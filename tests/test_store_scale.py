"""The store server at scale (issue 32): thousands of connections, parked-request bookkeeping
that costs O(1) per key change (waits on many keys, barriers of many ranks, many blocking
pops), a timer heap bounded by what is pending, and the open-file limit raised at start."""

from __future__ import annotations

import logging
import os
import resource
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from tdist._store import TCPStore, TCPStoreServer, fd_limits, tcp_protocol, tcp_server, tcp_store
from tdist._store.tcp_protocol import (
    BARRIER,
    ERROR,
    F64,
    GET,
    HEAD,
    MAGIC,
    MULTI_GET,
    NONCE_BYTES,
    OK,
    QUEUE_POP,
    QUEUE_PUSH,
    SERVER_HELLO_BYTES,
    SET,
    VERSION,
    WAIT,
    decode_list,
    encode_request,
)

HOST = "127.0.0.1"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tcp_store.TOKEN_ENV, raising=False)


def _connect(port: int) -> socket.socket:
    """A raw client past the handshake (no token): requests can be pipelined on it."""
    sock = socket.create_connection((HOST, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(MAGIC + bytes([VERSION]) + os.urandom(NONCE_BYTES))
    got = b""
    while len(got) < SERVER_HELLO_BYTES:
        got += sock.recv(SERVER_HELLO_BYTES - len(got))
    return sock


def _reply(sock: socket.socket) -> tuple:
    data = b""
    while len(data) < HEAD.size:
        chunk = sock.recv(HEAD.size - len(data))
        assert chunk, "connection closed"
        data += chunk
    status, size = HEAD.unpack(data)
    payload = b""
    while len(payload) < size:
        payload += sock.recv(size - len(payload))
    return status, payload


def _until(condition, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.001)


def _t(seconds: float) -> bytes:
    return F64.pack(seconds)


def test_a_thousand_connections_at_once_are_all_served() -> None:
    with TCPStoreServer(HOST, 0, token="") as server:
        socks = [_connect(server.port) for _ in range(1000)]
        try:
            _until(lambda: server.connections == 1000, "1000 connections")
            for i, sock in enumerate(socks):
                sock.sendall(encode_request(SET, [f"k{i}".encode(), str(i).encode()]))
            for sock in socks:
                assert _reply(sock)[0] == OK
            for i, sock in enumerate(socks):
                sock.sendall(encode_request(GET, [_t(5), f"k{(i + 1) % 1000}".encode()]))
            for i, sock in enumerate(socks):
                assert _reply(sock) == (OK, str((i + 1) % 1000).encode())
        finally:
            for sock in socks:
                sock.close()


def test_a_barrier_of_many_connections_completes_and_a_bad_counter_fails_it() -> None:
    n = 300
    with TCPStoreServer(HOST, 0, token="") as server:
        socks = [_connect(server.port) for _ in range(n)]
        try:
            for sock in socks:
                sock.sendall(encode_request(BARRIER, [_t(30), b"b", str(n).encode()]))
            for sock in socks:
                assert _reply(sock) == (OK, b"")
            assert server.parked_requests == 0
            # two groups waiting on one key with different world sizes; then the key is overwritten
            for sock in socks[:3]:
                sock.sendall(encode_request(BARRIER, [_t(30), b"c", b"10"]))
            socks[3].sendall(encode_request(BARRIER, [_t(30), b"c", b"20"]))
            _until(lambda: server.parked_requests == 4, "4 parked")
            socks[4].sendall(encode_request(SET, [b"c", b"not a number"]))
            assert _reply(socks[4])[0] == OK
            for sock in socks[:4]:
                status, payload = _reply(sock)
                assert status == ERROR and b"non-integer" in payload
            assert server.parked_requests == 0
        finally:
            for sock in socks:
                sock.close()


def test_wait_and_multi_get_on_many_keys_recheck_keys_deleted_meanwhile() -> None:
    with TCPStoreServer(HOST, 0, token="") as server:
        waiter, getter, writer = (_connect(server.port) for _ in range(3))
        keys = [f"key/{i}".encode() for i in range(500)]
        waiter.sendall(encode_request(WAIT, [_t(30), *keys]))
        getter.sendall(encode_request(MULTI_GET, [_t(30), *keys]))
        _until(lambda: server.parked_requests == 2, "2 parked")
        store = TCPStore(HOST, server.port, timeout=10)
        store.set("key/0", b"v0")
        assert store.delete_key("key/0")  # seen once, gone again: the waiters must notice at the end
        store.multi_set([k.decode() for k in keys[1:]], [b"v"] * (len(keys) - 1))
        time.sleep(0.2)
        assert server.parked_requests == 2  # key/0 is missing: both still wait, for it alone
        assert list(server._waiters) == [b"key/0"]
        writer.sendall(encode_request(SET, [b"key/0", b"again"]))
        assert _reply(writer)[0] == OK
        assert _reply(waiter) == (OK, b"")
        status, payload = _reply(getter)
        assert status == OK and decode_list(payload) == [b"again"] + [b"v"] * (len(keys) - 1)
        assert server.parked_requests == 0 and not server._waiters
        store.close()
        for sock in (waiter, getter, writer):
            sock.close()


def test_a_push_wakes_one_blocked_pop() -> None:
    with TCPStoreServer(HOST, 0, token="") as server:
        poppers = [_connect(server.port) for _ in range(5)]
        pusher = _connect(server.port)
        for sock in poppers:
            sock.sendall(encode_request(QUEUE_POP, [b"\x01", _t(30), b"q"]))
        _until(lambda: server.parked_requests == 5, "5 parked")
        for i in range(3):
            pusher.sendall(encode_request(QUEUE_PUSH, [b"q", str(i).encode()]))
            assert _reply(pusher)[0] == OK
        got = sorted(_reply(sock)[1] for sock in poppers[:3])  # the oldest three, one value each
        assert got == [b"0", b"1", b"2"]
        assert server.parked_requests == 2
        for i in range(3, 5):
            pusher.sendall(encode_request(QUEUE_PUSH, [b"q", str(i).encode()]))
            assert _reply(pusher)[0] == OK
        assert sorted(_reply(sock)[1] for sock in poppers[3:]) == [b"3", b"4"]
        assert server.parked_requests == 0 and not server._poppers
        for sock in poppers + [pusher]:
            sock.close()


def test_the_timer_heap_stays_proportional_to_what_is_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_server, "_TIMERS_MIN", 64)
    with TCPStoreServer(HOST, 0, token="") as server:
        getter, setter = _connect(server.port), _connect(server.port)
        for i in range(600):  # each get parks (with a 300 s timer) and completes at once
            key = f"k{i}".encode()
            getter.sendall(encode_request(GET, [_t(300), key]))
            _until(lambda: server.parked_requests == 1, "parked")
            setter.sendall(encode_request(SET, [key, b"v"]))
            assert _reply(setter)[0] == OK and _reply(getter) == (OK, b"v")
        assert len(server._timers) <= 2 * 64 + 1, len(server._timers)
        getter.close()
        setter.close()


def test_the_server_raises_the_open_file_limit_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 512:
        pytest.skip(f"the hard open-file limit ({hard}) leaves nothing to raise")
    code = textwrap.dedent(
        """
        import resource
        from tdist._store import TCPStoreServer
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        with TCPStoreServer("127.0.0.1", 0, token="") as server:
            print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], hard, server._max_pending)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    raised, hard_seen, max_pending = (int(x) for x in out.stdout.split())
    assert raised > 256 and (hard_seen == resource.RLIM_INFINITY or raised == hard_seen)
    assert max_pending == max(16, min(4096, raised // 4))


def test_a_limit_that_cannot_be_raised_is_said_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fd_limits, "_told", False)
    monkeypatch.setattr(fd_limits.resource, "getrlimit", lambda which: (1024, 4096))

    def refuse(which: int, limits: tuple) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(fd_limits.resource, "setrlimit", refuse)
    with caplog.at_level(logging.WARNING, logger="tdist._store.fd_limits"):
        assert fd_limits.raise_descriptor_limit() == (1024, 4096)
        assert fd_limits.raise_descriptor_limit() == (1024, 4096)
    said = [r.getMessage() for r in caplog.records if "open-file limit" in r.getMessage()]
    assert len(said) == 1 and "from 1024 to 4096" in said[0] and "ulimit -n" in said[0], said


def test_public_import_paths_still_work() -> None:
    from tdist._store.tcp_server import HANDSHAKE_TIMEOUT, TCPStoreServer as Server, UnresolvableHostError

    assert Server is TCPStoreServer and HANDSHAKE_TIMEOUT == 10.0 and issubclass(UnresolvableHostError, Exception)
    assert tcp_server.default_max_pending() >= 16
    assert tcp_protocol.MAX_ARGS > 0
    for name in ("tcp_server", "tcp_connections", "tcp_requests", "fd_limits", "tcp_store"):
        path = os.path.join(os.path.dirname(tcp_server.__file__), name + ".py")
        with open(path) as f:
            assert sum(1 for _ in f) <= 650, name
