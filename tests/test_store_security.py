"""The TCPStore against attackers: impostor servers squatting the port (token downgrade,
forged proofs), replayed handshakes, slowloris floods, and timeouts too large to represent."""

from __future__ import annotations

import os
import socket
import threading
import time
from datetime import timedelta
from typing import List

import pytest

import tdist
from tdist._errors import DistStoreError
from tdist._local import free_port
from tdist._store import HashStore, TCPStore, TCPStoreServer, tcp_protocol, tcp_store

HOST = "127.0.0.1"
TOKEN = "s3cret"

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tcp_store.TOKEN_ENV, raising=False)


def _closed_by_peer(sock: socket.socket, within: float = 5.0) -> bool:
    """Whether the peer closed ``sock`` (EOF or reset) within ``within`` seconds, sending nothing."""
    sock.settimeout(within)
    try:
        return sock.recv(4096) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def test_token_holder_refuses_a_server_without_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process without the token squats the port: the client does not join it (no downgrade)."""
    with TCPStoreServer(HOST, 0, token="") as squatter:
        for kwargs in ({"token": TOKEN}, {}):
            if not kwargs:
                monkeypatch.setenv(tcp_store.TOKEN_ENV, TOKEN)
            start = time.monotonic()
            with pytest.raises(DistStoreError, match="does not authenticate"):
                TCPStore(HOST, squatter.port, timeout=10, **kwargs)
            assert time.monotonic() - start < 3.0  # refused at once, not retried until the timeout


def test_client_refuses_an_impostor_that_cannot_prove_the_token() -> None:
    """An impostor claims to authenticate but cannot compute the server proof: the client hangs up
    without ever sending its own proof."""
    listener = socket.create_server((HOST, 0))
    received: List[bytes] = []

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            received.append(conn.recv(tcp_protocol.CLIENT_HELLO_BYTES))
            conn.sendall(tcp_protocol.MAGIC + bytes([tcp_protocol.VERSION, 1]) + os.urandom(64))
            conn.settimeout(5)
            received.append(conn.recv(100))

    thread = threading.Thread(target=impostor)
    thread.start()
    try:
        with pytest.raises(DistStoreError, match="could not prove"):
            TCPStore(HOST, listener.getsockname()[1], timeout=10, token=TOKEN)
    finally:
        thread.join(10)
        listener.close()
    assert len(received[0]) == tcp_protocol.CLIENT_HELLO_BYTES and received[1] == b""


def test_server_and_client_with_different_tokens_refuse_each_other() -> None:
    with TCPStoreServer(HOST, 0, token=TOKEN) as server:
        with pytest.raises(DistStoreError, match="authentication failed"):
            TCPStore(HOST, server.port, timeout=5, token="other")
        with pytest.raises(DistStoreError, match="requires a token"):
            TCPStore(HOST, server.port, timeout=5, token="")
        with TCPStore(HOST, server.port, timeout=5, token=TOKEN) as good:
            good.set("k", "v")
            assert good.get("k") == b"v"


def _recording_relay(upstream_port: int, recorded: bytearray) -> socket.socket:
    """A relay in front of the server that records what the client sends (an eavesdropper)."""
    listener = socket.create_server((HOST, 0))

    def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if record:
                    recorded.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def serve() -> None:
        client, _ = listener.accept()
        server = socket.create_connection((HOST, upstream_port))
        threading.Thread(target=pump, args=(client, server, True), daemon=True).start()
        threading.Thread(target=pump, args=(server, client, False), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_recorded_handshake_cannot_be_replayed() -> None:
    """Each side's proof covers both sides' fresh nonces: an eavesdropper who recorded a whole
    handshake cannot replay it to the server."""
    with TCPStoreServer(HOST, 0, token=TOKEN) as server:
        recorded = bytearray()
        relay = _recording_relay(server.port, recorded)
        with TCPStore(HOST, relay.getsockname()[1], timeout=5, token=TOKEN) as client:
            client.set("k", "v")
        relay.close()
        hello = bytes(recorded[: tcp_protocol.CLIENT_HELLO_BYTES])
        proof = bytes(recorded[tcp_protocol.CLIENT_HELLO_BYTES : tcp_protocol.CLIENT_HELLO_BYTES + 32])
        replay = socket.create_connection((HOST, server.port), timeout=5)
        replay.sendall(hello)
        answer = b""
        while len(answer) < tcp_protocol.SERVER_HELLO_BYTES + tcp_protocol.PROOF_BYTES:
            answer += replay.recv(128)
        replay.sendall(proof)
        assert replay.recv(1) == tcp_protocol.NAK  # refused: the server's nonce is new
        assert _closed_by_peer(replay)
        with TCPStore(HOST, server.port, timeout=5, token=TOKEN) as client:
            assert client.get("k") == b"v"  # and it serves everyone else


def test_slowloris_flood_does_not_lock_out_clients() -> None:
    """Connections that dribble their handshake a byte at a time are cut off at the handshake
    deadline and evicted beyond the cap; authenticated clients are served throughout."""
    threads_before = set(threading.enumerate())
    server = TCPStoreServer(HOST, 0, token=TOKEN, handshake_timeout=1.0, max_pending=32).start()
    hello = tcp_protocol.MAGIC + bytes([tcp_protocol.VERSION]) + os.urandom(32)
    stop = threading.Event()
    attackers: List[list] = []
    most_pending = [0]

    def attack() -> None:
        while not stop.is_set():
            while len(attackers) < 100:
                try:
                    sock = socket.create_connection((HOST, server.port), timeout=1)
                except OSError:
                    break
                sock.setblocking(False)
                attackers.append([sock, 0])
            for entry in list(attackers):
                sock, sent = entry
                try:
                    sock.send(hello[sent : sent + 1])
                    entry[1] = min(sent + 1, len(hello) - 1)
                except OSError:  # cut off by the server: open another
                    sock.close()
                    attackers.remove(entry)
            most_pending[0] = max(most_pending[0], server.pending_handshakes)
            time.sleep(0.1)

    attacker = threading.Thread(target=attack)
    attacker.start()
    try:
        time.sleep(0.5)
        for i in range(5):
            with TCPStore(HOST, server.port, timeout=15, token=TOKEN) as client:
                client.set(f"k{i}", "v")
                assert client.get(f"k{i}") == b"v"
            time.sleep(0.2)
    finally:
        stop.set()
        attacker.join(10)
    assert most_pending[0] <= 32
    leftovers = [entry[0] for entry in attackers]
    for sock in leftovers:
        sock.setblocking(True)
    assert all(_closed_by_peer(sock, within=3.0) for sock in leftovers)  # the deadline cut every one off
    assert server.pending_handshakes == 0
    server.stop()
    assert not set(threading.enumerate()) - threads_before  # one event-loop thread, gone with the server


def test_timeouts_too_large_to_represent_are_value_errors() -> None:
    huge = timedelta(days=999_999_999)
    with pytest.raises(ValueError, match="too large"):
        TCPStore(HOST, free_port(HOST), timeout=huge)
    store = HashStore()
    for call in (
        lambda: store.set_timeout(huge),
        lambda: store.get("k", timeout=1e300),
        lambda: store.wait(["k"], float("inf")),
        lambda: store.set_timeout(float("nan")),
    ):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError, match="too large"):
        tdist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, timeout=huge)
    assert not tdist.is_initialized()


def test_server_clamps_a_huge_timeout_and_drops_a_nan() -> None:
    """A forged request with a 1e300 s timeout waits (clamped) instead of crashing the server;
    a NaN timeout drops only that connection."""
    with TCPStore(HOST, 0, is_master=True, timeout=5) as store:
        waiter = TCPStore(HOST, store.port, timeout=5)
        sock = waiter._sock
        assert sock is not None
        sock.sendall(tcp_protocol.encode_request(tcp_protocol.WAIT, [tcp_protocol.F64.pack(1e300), b"late"]))
        store.set("late", "1")
        assert TCPStore._read_reply(sock) == (tcp_protocol.OK, b"")
        sock.sendall(tcp_protocol.encode_request(tcp_protocol.GET, [tcp_protocol.F64.pack(float("nan")), b"k"]))
        assert _closed_by_peer(sock)
        assert store.ping(b"alive") == b"alive"
