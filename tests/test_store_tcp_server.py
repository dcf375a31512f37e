"""Tests of tdist's TCPStore server and client under bad input and lost peers: garbage and
bad handshakes dropped, token authentication, bound addresses, connect retries and
timeouts, a server that goes away or stops answering; and torch's TCPStore API served."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import List

import pytest

import tdist

from tdist._errors import DistNetworkError, DistStoreError, DistStoreTimeoutError
from tdist._store import TCPStore, TCPStoreServer, TorchStore, as_torch_store
from tdist._local import free_port
from tdist._store import tcp_protocol, tcp_store

SRC = str(Path(tcp_store.__file__).resolve().parents[2])  # core/src, for child processes
HOST = "127.0.0.1"


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tcp_store.TOKEN_ENV, raising=False)


# --------------------------------------------------------------------------- TCP server robustness
def _raw(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=5)


def _raw_handshake(port: int) -> socket.socket:
    """A raw connection past the handshake of a server without a token."""
    sock = _raw(port)
    sock.sendall(tcp_protocol.MAGIC + bytes([tcp_protocol.VERSION]) + os.urandom(tcp_protocol.NONCE_BYTES))
    hello = b""
    while len(hello) < tcp_protocol.SERVER_HELLO_BYTES:
        hello += sock.recv(64)
    assert hello.startswith(tcp_protocol.MAGIC)
    return sock


def _assert_dropped(sock: socket.socket) -> None:
    """The server closed the connection (EOF or reset) without answering."""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                break
            assert not data.startswith(bytes([tcp_protocol.OK])), "the server answered garbage"
    except ConnectionResetError:
        pass
    finally:
        sock.close()


@pytest.mark.timeout(20)
def test_garbage_and_bad_handshakes_are_dropped() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        good = TCPStore(HOST, store.port, timeout=5)
        port = store.port
        bad_magic = _raw(port)
        bad_magic.sendall(b"XXSTORE\x01")
        _assert_dropped(bad_magic)
        bad_version = _raw(port)
        bad_version.sendall(tcp_protocol.MAGIC + b"\x63" + bytes(32))
        _assert_dropped(bad_version)
        noise = _raw(port)
        noise.sendall(os.urandom(4096))
        _assert_dropped(noise)
        # after a valid handshake: unknown command, too many arguments, an oversized argument, wrong arity
        for frame in (
            b"\xff\x00\x00\x00\x00",
            bytes([tcp_protocol.SET]) + b"\x00\x01\x00\x00",
            bytes([tcp_protocol.SET]) + b"\x00\x00\x00\x02" + b"\x7f\xff\xff\xff",
            bytes([tcp_protocol.GET]) + b"\x00\x00\x00\x00",
            bytes([tcp_protocol.GET]) + b"\x00\x00\x00\x02\x00\x00\x00\x01x\x00\x00\x00\x01k",
        ):
            sock = _raw_handshake(port)
            sock.sendall(frame + os.urandom(64))
            _assert_dropped(sock)
        half = _raw_handshake(port)  # a truncated request, then hang up
        half.sendall(bytes([tcp_protocol.SET]) + b"\x00\x00\x00\x02\x00\x00\x00\x10ab")
        half.close()
        # the well-behaved client never noticed
        good.set("still", "alive")
        assert store.get("still") == b"alive" and good.ping(b"hi") == b"hi"
        good.close()


@pytest.mark.timeout(20)
def test_token_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    with TCPStoreServer(HOST, 0, token="s3cret") as server:
        good = TCPStore(HOST, server.port, timeout=5, token="s3cret")
        good.set("k", "v")
        for token in ("wrong", ""):
            start = time.monotonic()
            with pytest.raises(DistStoreError, match="authentication failed"):
                TCPStore(HOST, server.port, timeout=10, token=token)
            assert time.monotonic() - start < 3.0  # refused at once, not retried until the timeout
        monkeypatch.setenv(tcp_store.TOKEN_ENV, "s3cret")
        from_env = TCPStore(HOST, server.port, timeout=5)
        assert from_env.get("k") == b"v"
        from_env.close()
        assert good.get("k") == b"v"  # other clients keep working
        good.close()


@pytest.mark.timeout(20)
def test_master_uses_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tcp_store.TOKEN_ENV, "from-env")
    with TCPStore(HOST, 0, is_master=True, timeout=5) as master:
        master.set("k", "v")
        monkeypatch.delenv(tcp_store.TOKEN_ENV)
        with pytest.raises(DistStoreError, match="authentication failed"):
            TCPStore(HOST, master.port, timeout=5)


@pytest.mark.timeout(20)
def test_server_binds_only_the_given_address() -> None:
    with TCPStoreServer(HOST, 0) as server:
        assert server.sockname[0] == HOST
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.2", server.port), timeout=2).close()
        start = time.monotonic()
        with pytest.raises(DistStoreTimeoutError, match=f"127.0.0.2:{server.port}"):
            TCPStore("127.0.0.2", server.port, timeout=0.3)
        assert time.monotonic() - start < 2.0


@pytest.mark.timeout(20)
def test_connect_retries_until_server_starts() -> None:
    port = free_port(HOST)
    server = TCPStoreServer(HOST, port)
    timer = threading.Timer(0.3, server.start)
    timer.start()
    try:
        with TCPStore(HOST, port, timeout=5) as client:
            client.set("k", "v")
    finally:
        timer.join()
        server.stop()


@pytest.mark.timeout(20)
def test_connect_timeout_names_address() -> None:
    port = free_port(HOST)
    start = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=f"{HOST}:{port}") as info:
        TCPStore(HOST, port, timeout=0.4)
    assert isinstance(info.value, TimeoutError)
    assert 0.35 <= time.monotonic() - start < 2.5


@pytest.mark.timeout(20)
def test_wait_for_workers() -> None:
    port = free_port(HOST)
    result: List[object] = []
    master_thread = threading.Thread(
        target=lambda: result.append(TCPStore(HOST, port, world_size=3, is_master=True, timeout=5))
    )
    master_thread.start()
    workers = [TCPStore(HOST, port, world_size=3, timeout=5) for _ in range(2)]
    master_thread.join(5)
    assert result and isinstance(result[0], TCPStore)
    master = result[0]
    workers[0].set("k", "v")
    assert master.get("k") == b"v"
    for store in workers + [master]:
        store.close()
    start = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="1/2 clients joined"):
        TCPStore(HOST, 0, world_size=2, is_master=True, timeout=0.3)
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(20)
def test_client_raises_when_server_gone() -> None:
    master = TCPStore(HOST, 0, is_master=True, timeout=5)
    client = TCPStore(HOST, master.port, timeout=5)
    client.set("k", "v")
    blocked: List[BaseException] = []

    def blocked_get() -> None:
        try:
            client.get("never", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            blocked.append(exc)

    waiter = threading.Thread(target=blocked_get)
    waiter.start()
    time.sleep(0.2)
    master.close()  # stops the server: the pending GET fails at once
    waiter.join(3)
    assert not waiter.is_alive()
    assert blocked and isinstance(blocked[0], DistStoreError) and isinstance(blocked[0], DistNetworkError)
    assert f"{HOST}:{master.port}" in str(blocked[0])
    start = time.monotonic()
    with pytest.raises(DistNetworkError, match=f"{HOST}:{master.port}"):
        client.get("k")  # the one reconnection attempt is refused
    assert time.monotonic() - start < 2.0
    assert not [t for t in threading.enumerate() if t.name.endswith(f":{master.port}")]  # server threads ended
    client.close()
    with pytest.raises(DistStoreError, match="closed"):
        client.get("k")


@pytest.mark.timeout(20)
def test_client_does_not_hang_on_silent_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that completes the handshake and then never answers: the socket timeout fires."""
    monkeypatch.setattr(tcp_store, "_SOCKET_MARGIN", 0.3)
    listener = socket.create_server((HOST, 0))
    port = listener.getsockname()[1]
    conns: List[socket.socket] = []

    def fake_server() -> None:
        conn, _ = listener.accept()
        conns.append(conn)
        conn.recv(tcp_protocol.CLIENT_HELLO_BYTES)
        conn.sendall(tcp_protocol.MAGIC + bytes([tcp_protocol.VERSION, 0]) + bytes(32))  # then never answers

    thread = threading.Thread(target=fake_server)
    thread.start()
    client = TCPStore(HOST, port, timeout=5)
    thread.join()
    start = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="no reply"):
        client.get("k", timeout=0.2)
    assert time.monotonic() - start < 2.0
    client.close()
    for conn in conns:
        conn.close()
    listener.close()


@pytest.mark.timeout(30)
def test_tdist_store_serves_torch() -> None:
    """A tdist store handed to torch: torch's PrefixStore and torch's own gloo group run over it,
    and the adapters unwrap instead of stacking."""
    import torch
    import torch.distributed as torch_dist

    server = TCPStore(HOST, 0, world_size=1, is_master=True, timeout=5)
    try:
        wrapped = as_torch_store(server)
        assert isinstance(wrapped, torch_dist.Store) and TorchStore(wrapped) is not server
        assert tdist.from_torch_store(wrapped) is server and as_torch_store(TorchStore(wrapped)) is wrapped
        prefixed = torch_dist.PrefixStore("job", wrapped)
        prefixed.set("k", b"v")
        assert server.get("job/k") == b"v"
        assert prefixed.add("n", 2) == 2 and prefixed.compare_set("k", b"v", b"w") == b"w"
        with pytest.raises(torch_dist.DistStoreError, match="(?i)timeout"):
            prefixed.wait(["never"], timedelta(seconds=0.2))
        torch_dist.init_process_group("gloo", store=prefixed, rank=0, world_size=1)
        try:
            t = torch.ones(3)
            torch_dist.all_reduce(t)
            assert t.tolist() == [1.0, 1.0, 1.0]
        finally:
            torch_dist.destroy_process_group()
    finally:
        server.close()
