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
from tdist._store import FileStore, HashStore, PrefixStore, Store, TCPStore, TorchStore
from tdist._local import free_port
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
        opener = lambda: TorchStore(  # noqa: E731
            torch_dist.TCPStore(HOST, server.port, is_master=False, timeout=timedelta(seconds=5))
        )
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
        assert "timeout" in str(info.value) and "/missing" in str(info.value)
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
def test_append_multi_get_multi_set_list_keys(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    assert store.has_extended_api()
    store.append("ap", "po")
    store.append("ap", b"tato")
    assert opener().get("ap") == b"potato"
    store.multi_set(["m1", "m2"], ["one", b"two"])
    assert opener().multi_get(["m2", "m1", "ap"]) == [b"two", b"one", b"potato"]
    assert store.multi_get([]) == []
    assert {"ap", "m1", "m2"} <= set(store.list_keys())
    with pytest.raises(ValueError):
        store.multi_set(["a"], [])
    start = time.monotonic()
    with pytest.raises(DistStoreTimeoutError, match="timeout"):
        store.set_timeout(0.3)
        store.multi_get(["m1", "never"])
    assert time.monotonic() - start < 2.5


@pytest.mark.timeout(20)
def test_queues(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    other = opener()
    assert store.queue_len("q") == 0 and not store.check(["q"])
    with pytest.raises(tdist.QueueEmptyError, match="empty"):
        store.queue_pop("q", block=False)
    store.queue_push("q", "1")
    other.queue_push("q", b"2")
    assert store.check(["q"]) and store.queue_len("q") == 2
    store.wait(["q"])
    assert other.queue_pop("q") == b"1" and store.queue_pop("q", block=False) == b"2"
    assert not store.check(["q"])
    timer = threading.Timer(0.2, lambda: other.queue_push("q", "late"))
    timer.start()
    try:
        assert store.queue_pop("q") == b"late"  # a blocking pop wakes when another handle pushes
    finally:
        timer.join()
    store.set_timeout(0.2)
    with pytest.raises(DistStoreTimeoutError, match="timeout"):
        store.queue_pop("q")


@pytest.mark.timeout(20)
def test_barrier_and_clone(stores: Tuple[Store, Opener]) -> None:
    store, opener = stores
    store.barrier("b1", 1)
    clone = store.clone()
    assert isinstance(clone, Store)
    store.set("c", "x")
    assert clone.get("c") == b"x"
    others = [opener() for _ in range(2)]
    threads = [threading.Thread(target=s.barrier, args=("b3", 3, timedelta(seconds=10))) for s in others]
    for t in threads:
        t.start()
    store.barrier("b3", 3, timedelta(seconds=10))
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(DistStoreTimeoutError, match="timeout"):
        store.barrier("b2", 2, timedelta(seconds=0.2))


class DictStore(Store):
    """A third-party store: only the basic operations, over a dict."""

    def __init__(self) -> None:
        super().__init__(timeout=2)
        self.data: dict = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: object) -> None:
        with self.cond:
            self.data[key] = bytes(value) if not isinstance(value, str) else value.encode()
            self.cond.notify_all()

    def get(self, key: str, timeout: object = None) -> bytes:
        self.wait([key], timeout)
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        with self.cond:
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self.data[key] = desired  # type: ignore[assignment]
                self.cond.notify_all()
                return desired  # type: ignore[return-value]
            return expected if current is None else current  # type: ignore[return-value]

    def wait(self, keys: object, timeout: object = None) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), self._limit(timeout)):  # type: ignore
                raise DistStoreTimeoutError(f"DictStore: timeout waiting for {keys}")

    def check(self, keys: object) -> bool:
        return all(k in self.data for k in keys)  # type: ignore[attr-defined]

    def delete_key(self, key: str) -> bool:
        return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self.data)


@pytest.mark.timeout(20)
def test_base_class_defaults_for_third_party_stores() -> None:
    """A store implementing only the basics gets append/multi_get/multi_set/barrier/clone;
    list_keys and queues say clearly that they are not implemented."""
    store = DictStore()
    assert not store.has_extended_api()
    store.append("a", "po")
    store.append("a", "tato")
    assert store.get("a") == b"potato"
    store.multi_set(["x", "y"], ["1", b"2"])
    assert store.multi_get(["x", "y", "a"]) == [b"1", b"2", b"potato"]
    threads = [threading.Thread(target=store.barrier, args=("b", 3)) for _ in range(2)]
    for t in threads:
        t.start()
    store.barrier("b", 3)
    for t in threads:
        t.join(5)
    with pytest.raises(DistStoreTimeoutError, match="barrier timeout"):
        store.barrier("lonely", 2, 0.2)
    assert store.clone() is store
    prefixed = PrefixStore("p", store)
    prefixed.append("k", "v")
    assert store.get("p/k") == b"v" and not prefixed.has_extended_api()
    for call in (store.list_keys, lambda: store.queue_push("q", "v"), lambda: store.queue_len("q")):
        with pytest.raises(NotImplementedError):
            call()
    bare = Store()
    with pytest.raises(NotImplementedError, match="Not implemented"):
        bare.set("k", "v")


@pytest.mark.timeout(20)
def test_tcp_extended_operations_are_one_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: List[int] = []
    real = TCPStore._request

    def counting(self: TCPStore, cmd: int, args: object, wait: object = None) -> object:
        calls.append(cmd)
        return real(self, cmd, args, wait)  # type: ignore[arg-type]

    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        monkeypatch.setattr(TCPStore, "_request", counting)
        keys = [f"k{i}" for i in range(100)]
        for op in (
            lambda: store.multi_set(keys, keys),
            lambda: store.multi_get(keys),
            lambda: store.append("a", "b"),
            lambda: store.queue_push("q", "v"),
            lambda: store.queue_pop("q"),
            lambda: store.queue_len("q"),
            lambda: store.list_keys(),
            lambda: store.barrier("b", 1),
        ):
            calls.clear()
            op()
            assert len(calls) == 1, calls


@pytest.mark.timeout(30)
def test_tcp_concurrent_queue_and_append_are_atomic() -> None:
    with TCPStore(HOST, 0, is_master=True, timeout=10) as store:
        for i in range(200):
            store.queue_push("work", str(i))
        clones = [store.clone() for _ in range(4)]
        popped: List[bytes] = []

        def consume(s: TCPStore) -> None:
            for _ in range(50):
                popped.append(s.queue_pop("work"))
                s.append("log", "x")

        threads = [threading.Thread(target=consume, args=(c,)) for c in clones]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert sorted(int(v) for v in popped) == list(range(200))  # every item exactly once
        assert store.get("log") == b"x" * 200 and store.queue_len("work") == 0
        for c in clones:
            c.close()
        server = store.server
        assert server is not None
        deadline = time.monotonic() + 5
        while server.connections > 1 and time.monotonic() < deadline:  # the server sees the hang-ups
            time.sleep(0.01)
        assert server.connections == 1


@pytest.mark.timeout(20)
def test_tcp_store_torch_constructor_semantics() -> None:
    with pytest.raises(ValueError, match="world size cannot be 0"):
        TCPStore(HOST, 0, world_size=0, is_master=True)
    master = TCPStore(HOST, 0, world_size=1, is_master=True, timeout=5, use_libuv=False)
    assert master.num_keys() == 1 and master.list_keys() == []  # the worker counter, as torch counts it
    assert master.libuvBackend is False and master.host == HOST
    with pytest.raises(DistNetworkError, match=f"^The server socket has failed to listen.*{master.port}"):
        TCPStore(HOST, master.port, 1, True, timeout=5)  # not multi-tenant: the port is taken
    master.close()


@pytest.mark.timeout(20)
def test_multi_tenant_and_listen_fd() -> None:
    port = free_port(HOST)
    a = TCPStore(HOST, port, 1, True, multi_tenant=True, timeout=5)
    b = TCPStore(HOST, port, 1, True, multi_tenant=True, timeout=5)
    assert a.server is b.server
    a.set("k", "v")
    a.close()
    assert b.get("k") == b"v"  # the server lives while a tenant uses it
    with pytest.raises(DistStoreError, match="another token"):
        TCPStore(HOST, port, 1, True, multi_tenant=True, timeout=5, token="other")
    b.close()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    adopted = TCPStore(HOST, listener.getsockname()[1], 1, True, master_listen_fd=listener.detach(), timeout=5)
    adopted.set("k", "v")
    assert adopted.get("k") == b"v"
    adopted.close()


@pytest.mark.timeout(20)
def test_rendezvous_iterator(tmp_path: Path) -> None:
    gen = tdist.rendezvous(f"file://{tmp_path}/rdv?world_size=1&rank=0", timeout=timedelta(seconds=5))
    store, rank, world_size = next(gen)
    assert (rank, world_size) == (0, 1)
    store.set("k", "v")
    with pytest.raises(RuntimeError, match="re-rendezvous"):
        next(gen)
    with pytest.raises(RuntimeError, match="^No rendezvous handler for nope://"):
        tdist.rendezvous("nope://x")
    with pytest.raises(AssertionError, match="node-specific"):
        tdist.rendezvous("tcp://127.0.0.1:1?rank=0&world_size=1", 0, 1)
    store.close()


@pytest.mark.timeout(20)
def test_prefix_store_namespaces(tmp_path: Path) -> None:
    base = FileStore(tmp_path / "f", timeout=2)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("k", "A")
    b.set("k", "B")
    assert (a.get("k"), b.get("k"), base.get("a/k"), base.get("b/k")) == (b"A", b"B", b"A", b"B")
    assert a.underlying_store is base and a.prefix == "a"
    assert a.num_keys() == 3  # every key of the underlying store, its reference counter included (as torch)
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
def test_tcp_many_keys_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """More keys than one request carries: wait/check/multi_get/multi_set split them."""
    monkeypatch.setattr(tcp_store, "MAX_ARGS", 64)
    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        keys = [f"k{i}" for i in range(200)]
        store.multi_set(keys, [k.encode() for k in keys])
        assert store.check(keys)
        store.wait(keys)
        assert store.multi_get(keys) == [k.encode() for k in keys]
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
        children = [subprocess.Popen([sys.executable, "-c", _CHILD, str(master.port), path], env=env) for _ in range(8)]
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
        assert fresh.list_keys() == [] and fresh.num_keys() == 1  # torch counts its reference counter
    assert not path.exists()


@pytest.mark.timeout(20)
def test_file_store_refuses_a_device_and_never_removes_it() -> None:
    with pytest.raises(DistStoreError, match="not a regular file"):
        FileStore("/dev/null", world_size=1, timeout=1)
    assert os.path.exists("/dev/null")


@pytest.mark.timeout(20)
def test_file_store_rejects_foreign_file(tmp_path: Path) -> None:
    path = tmp_path / "foreign"
    path.write_bytes(b"this is not a store file")
    with pytest.raises(DistStoreError, match="not a tdist FileStore"):
        FileStore(path, timeout=1)
