"""Tests of the key-value stores: HashStore, FileStore, TCPStore (+ server) and PrefixStore."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, List, Tuple

import pytest

import tdist

from tdist._errors import DistError, DistNetworkError, DistStoreError, DistStoreTimeoutError
from tdist._store import FileStore, HashStore, PrefixStore, Store, TCPStore, TCPStoreServer, TorchStore, as_torch_store
from tdist._store import tcp_store

SRC = str(Path(tcp_store.__file__).resolve().parents[2])  # core/src, for child processes
HOST = "127.0.0.1"

Opener = Callable[[], Store]


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tcp_store.TOKEN_ENV, raising=False)


@pytest.fixture(params=["hash", "file", "tcp", "prefix", "torch"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Tuple[Store, Opener]]:
    """A store and a function that opens another handle onto the same data."""
    opened: List[Store] = []

    def track(store: Store) -> Store:
        opened.append(store)
        return store

    kind = request.param
    if kind == "hash":
        hash_store = HashStore(timeout=5)
        store, opener = hash_store, (lambda: hash_store)
    elif kind == "file":
        path = tmp_path / "store"
        store = track(FileStore(path, timeout=5))
        opener = lambda: track(FileStore(path, timeout=5))  # noqa: E731
    elif kind == "tcp":
        store = track(TCPStore(HOST, 0, world_size=1, is_master=True, timeout=5))
        port = store.port  # type: ignore[attr-defined]
        opener = lambda: track(TCPStore(HOST, port, timeout=5))  # noqa: E731
    elif kind == "torch":  # a torch.distributed.TCPStore used through tdist's Store interface
        import torch.distributed as torch_dist

        server = torch_dist.TCPStore(HOST, 0, 1, True, timeout=timedelta(seconds=5))
        store = TorchStore(server)
        opener = lambda: TorchStore(torch_dist.TCPStore(HOST, server.port, is_master=False, timeout=timedelta(seconds=5)))  # noqa: E731
    else:
        base = HashStore(timeout=5)
        base.set("unrelated", b"1")
        store, opener = PrefixStore("pg0", base), (lambda: PrefixStore("pg0", base))
    yield store, opener
    for handle in reversed(opened):
        handle.close()


# --------------------------------------------------------------------------- semantics
@pytest.mark.timeout(20)
def test_set_get(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    store.set("k", "value")
    assert store.get("k") == b"value"
    store.set("k", b"\x00binary\xff")
    assert store.get("k") == b"\x00binary\xff"
    store.set("empty", b"")
    assert store.get("empty") == b""
    store.set("mv", memoryview(b"abc"))
    assert opener().get("mv") == b"abc"
    big = os.urandom(1 << 20)
    store.set("big", big)
    assert opener().get("big") == big


@pytest.mark.timeout(20)
def test_add(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    assert store.add("c", 5) == 5
    assert store.add("c", -2) == 3
    assert opener().add("c", 0) == 3
    assert store.get("c") == b"3"
    store.set("s", "12")
    assert store.add("s", 1) == 13
    store.set("text", "not a number")
    # torch's own TCPStore server drops the client instead of answering: the error is still a DistStoreError
    with pytest.raises(DistStoreError, match="failed" if isinstance(store, TorchStore) else "not an integer"):
        store.add("text", 1)


@pytest.mark.timeout(20)
def test_compare_set(stores: Tuple[Store, Opener]) -> None:
    store, _ = stores
    # unset key, non-empty expected: nothing is set, expected comes back (torch's rule)
    assert store.compare_set("cs", "x", "y") == b"x"
    assert not store.check(["cs"])
    # unset key, empty expected: set
    assert store.compare_set("cs", "", "first") == b"first"
    assert store.get("cs") == b"first"
    # mismatch: unchanged, current value returned
    assert store.compare_set("cs", "wrong", "second") == b"first"
    assert store.get("cs") == b"first"
    # match: swapped
    assert store.compare_set("cs", b"first", b"second") == b"second"
    assert store.get("cs") == b"second"


@pytest.mark.timeout(20)
def test_check_wait_delete_num_keys(stores: Tuple[Store, Opener]) -> None:
    store, _ = stores
    base = store.num_keys()
    assert not store.check(["a"])
    store.set("a", "1")
    store.set("b", "2")
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    store.wait(["a", "b"])
    store.wait([])
    assert store.num_keys() == base + 2
    assert store.delete_key("a") is True
    assert store.delete_key("a") is False
    assert not store.check(["a"])
    assert store.num_keys() == base + 1
    store.set("a", "again")
    assert store.get("a") == b"again"


@pytest.mark.timeout(20)
def test_get_and_wait_time_out(stores: Tuple[Store, Opener]) -> None:
    store, _ = stores
    for call in (lambda: store.get("missing", timeout=0.3), lambda: store.wait(["a1", "missing"], 0.3)):
        start = time.monotonic()
        with pytest.raises(DistStoreTimeoutError, match="missing") as info:
            call()
        elapsed = time.monotonic() - start
        assert 0.25 <= elapsed < 2.0
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, DistError)
        assert "0.3 s" in str(info.value)
    store.set_timeout(0.2)  # the default applies when no timeout is passed
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        store.get("missing")
    assert time.monotonic() - start < 2.0


@pytest.mark.timeout(20)
def test_blocking_get_wakes_when_set(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    writer = opener()
    timer = threading.Timer(0.1, lambda: writer.set("late", "here"))
    timer.start()
    try:
        start = time.monotonic()
        assert store.get("late", timeout=5) == b"here"
        assert time.monotonic() - start < 2.0
    finally:
        timer.join()


@pytest.mark.timeout(20)
def test_prefix_store_namespaces(tmp_path: Path) -> None:
    base = FileStore(tmp_path / "f", timeout=2)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", "A")
    b.set("k", "B")
    assert (a.get("k"), b.get("k"), base.get("a/k"), base.get("b/k")) == (b"A", b"B", b"A", b"B")
    assert a.underlying_store is base and a.prefix == "a"
    assert a.num_keys() == 2  # counts every key of the underlying store
    nested = PrefixStore("inner", a)
    nested.set("x", "1")
    assert base.get("a/inner/x") == b"1"
    assert a.timeout == base.timeout
    a.set_timeout(0.1)
    assert base.timeout.total_seconds() == pytest.approx(0.1)
    with pytest.raises(DistStoreTimeoutError, match="b/missing"):
        b.get("missing")
    a.close()  # does not close the underlying store
    assert base.get("a/k") == b"A"
    base.close()


@pytest.mark.timeout(20)
def test_tcp_client_is_thread_safe() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        threads = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(100)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert store.get("n") == b"400"


@pytest.mark.timeout(20)
def test_tcp_wait_many_keys() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        keys = [f"k{i}" for i in range(tcp_store.MAX_ARGS + 100)]
        for key in keys:
            store.set(key, b"")
        assert store.check(keys)
        store.wait(keys)
        assert store.num_keys() == len(keys)


# --------------------------------------------------------------------------- processes
_CHILD = r"""
import sys
from tdist._store import FileStore, TCPStore
port, path = int(sys.argv[1]), sys.argv[2]
tcp = TCPStore("127.0.0.1", port, timeout=30)
files = FileStore(path, world_size=9, timeout=30)
tcp.wait(["go"])
for _ in range(500):
    tcp.add("count", 1)
    files.add("count", 1)
tcp.add("done", 1)
files.close()
tcp.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_eight_processes_add_exactly(tmp_path: Path) -> None:
    """8 client processes x 500 adds, against one TCPStore and one FileStore at the same time."""
    path = str(tmp_path / "shared")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), SRC])))
    with TCPStore(HOST, 0, world_size=9, is_master=True, timeout=30, wait_for_workers=False) as master:
        files = FileStore(path, world_size=9, timeout=30)
        children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(master.port), path], env=env)
                    for _ in range(8)]
        try:
            master.set("go", "1")
            for child in children:
                assert child.wait(timeout=50) == 0
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
        assert master.get("count") == b"4000"
        assert master.get("done") == b"8"
        assert files.get("count") == b"4000"
        assert os.path.exists(path)  # 8 of 9 users closed
        files.close()
        assert not os.path.exists(path)  # the ninth deletes it


# --------------------------------------------------------------------------- FileStore
@pytest.mark.timeout(20)
def test_file_store_deleted_by_last_user(tmp_path: Path) -> None:
    path = tmp_path / "job"
    users = [FileStore(path, world_size=3, timeout=1) for _ in range(3)]
    users[0].set("k", "v")
    users[0].close()
    users[1].close()
    assert path.exists() and users[2].get("k") == b"v"
    users[2].close()
    assert not path.exists()
    users[2].close()  # idempotent
    with pytest.raises(DistStoreError, match="closed"):
        users[2].get("k")
    with FileStore(path, world_size=1, timeout=0.2) as fresh:  # the path is reusable, and empty
        assert fresh.num_keys() == 0
    assert not path.exists()


@pytest.mark.timeout(20)
def test_file_store_rejects_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store file")
    with FileStore(path, timeout=1) as store, pytest.raises(DistStoreError, match="not a tdist FileStore"):
        store.get("k")


# --------------------------------------------------------------------------- TCP server robustness
def _raw(port: int) -> socket.socket:
    return socket.create_connection((HOST, port), timeout=5)


def _raw_handshake(port: int) -> socket.socket:
    sock = _raw(port)
    sock.sendall(tcp_store.MAGIC + bytes([tcp_store.VERSION]))
    hello = b""
    while len(hello) < len(tcp_store.MAGIC) + 2 + 32:
        hello += sock.recv(64)
    assert hello.startswith(tcp_store.MAGIC)
    return sock


def _assert_dropped(sock: socket.socket) -> None:
    """The server closed the connection (EOF or reset) without answering."""
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                break
            assert not data.startswith(bytes([tcp_store.OK])), "the server answered garbage"
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
        bad_version.sendall(tcp_store.MAGIC + b"\x63")
        _assert_dropped(bad_version)
        noise = _raw(port)
        noise.sendall(os.urandom(4096))
        _assert_dropped(noise)
        # after a valid handshake: unknown command, too many arguments, an oversized argument, wrong arity
        for frame in (b"\xff\x00\x00\x00\x00", bytes([tcp_store.SET]) + b"\x00\x01\x00\x00",
                      bytes([tcp_store.SET]) + b"\x00\x00\x00\x02" + b"\x7f\xff\xff\xff",
                      bytes([tcp_store.GET]) + b"\x00\x00\x00\x00",
                      bytes([tcp_store.GET]) + b"\x00\x00\x00\x02\x00\x00\x00\x01x\x00\x00\x00\x01k"):
            sock = _raw_handshake(port)
            sock.sendall(frame + os.urandom(64))
            _assert_dropped(sock)
        half = _raw_handshake(port)  # a truncated request, then hang up
        half.sendall(bytes([tcp_store.SET]) + b"\x00\x00\x00\x02\x00\x00\x00\x10ab")
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
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
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
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match=f"{HOST}:{port}") as info:
        TCPStore(HOST, port, timeout=0.4)
    assert isinstance(info.value, TimeoutError)
    assert 0.35 <= time.monotonic() - start < 2.5


@pytest.mark.timeout(20)
def test_wait_for_workers() -> None:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    result: List[object] = []
    master_thread = threading.Thread(
        target=lambda: result.append(TCPStore(HOST, port, world_size=3, is_master=True, timeout=5)))
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
    with pytest.raises(DistStoreTimeoutError, match="1 of 2 arrived"):
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
        conn.recv(8)
        conn.sendall(tcp_store.MAGIC + bytes([tcp_store.VERSION, 0]) + bytes(32))
        conn.recv(4096)  # the constructor's worker-counter ADD gets an answer; nothing after that does
        conn.sendall(bytes([tcp_store.OK]) + b"\x00\x00\x00\x011")

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
