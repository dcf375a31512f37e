"""The store server parses a request that arrives in pieces incrementally: every header is
read once however many pieces the request comes in (O(its bytes) in all, not O(bytes x
pieces)), and other clients are served while it trickles in."""

from __future__ import annotations

import os
import socket
import time

import pytest

from tdist._store import TCPStore, TCPStoreServer, tcp_protocol, tcp_store

HOST = "127.0.0.1"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tcp_store.TOKEN_ENV, raising=False)


def test_parse_request_resumes_where_it_stopped() -> None:
    args = [tcp_protocol.F64.pack(1.0)] + [f"key{i}".encode() for i in range(50)]
    wire = tcp_protocol.encode_request(tcp_protocol.WAIT, args) + tcp_protocol.encode_request(tcp_protocol.PING, [])
    scan = tcp_protocol.RequestScan()
    buf = bytearray(b"junk")  # the request starts at pos 4
    for i in range(len(wire)):
        buf.append(wire[i])
        request = tcp_protocol.parse_request(buf, 4, scan)
        if request is not None:
            break
    assert request == (tcp_protocol.WAIT, args, 4 + len(wire) - 5) and i == len(wire) - 6
    assert scan.steps == 1 + len(args)  # the head and each argument's length, once each
    assert tcp_protocol.parse_request(buf + wire[-5:], request[2], scan) == (tcp_protocol.PING, [], 4 + len(wire))


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.0005)


def test_a_request_trickled_in_pieces_is_parsed_once_and_others_are_served() -> None:
    count = tcp_protocol.MAX_ARGS  # 65,536 arguments: 32,768 keys and values
    args = [f"{'kv'[i % 2]}{i // 2}".encode() for i in range(count)]
    wire = tcp_protocol.encode_request(tcp_protocol.MULTI_SET, args)
    with TCPStoreServer(HOST, 0, token="") as server:
        slow = TCPStore(HOST, server.port, timeout=20)
        other = TCPStore(HOST, server.port, timeout=20)
        sock = slow._sock
        assert sock is not None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        [conn] = [c for c in list(server._conns.values()) if c.sock.getpeername() == sock.getsockname()]
        before = conn.scan.steps
        pieces = 400
        size = -(-len(wire) // pieces)
        for n, start in enumerate(range(0, len(wire) - size, size)):
            sock.sendall(wire[start : start + size])
            # each piece is read (and parsed) on its own before the next is sent
            _until(lambda end=start + size: len(conn.buf) == end, f"the server read piece {n}")
            if n % 50 == 0:
                other.set(f"other{n}", b"x")  # served while the request is incomplete
                assert other.get(f"other{n}") == b"x"
        assert conn.scan.offset > 0  # parsed up to the last piece, kept
        sock.sendall(wire[start + size :])
        assert TCPStore._read_reply(sock) == (tcp_protocol.OK, b"")
        assert conn.scan.steps - before == 1 + count  # each header read once: linear, not per piece
        assert other.get("k32767") == b"v32767" and other.get("k0") == b"v0"
        slow.close()
        other.close()


def test_store_clients_still_work_with_pieces_of_ordinary_requests() -> None:
    with TCPStoreServer(HOST, 0, token="") as server, TCPStore(HOST, server.port, timeout=10) as store:
        sock = store._sock
        assert sock is not None
        wire = b"".join(
            tcp_protocol.encode_request(tcp_protocol.SET, [f"k{i}".encode(), os.urandom(i)]) for i in range(30)
        ) + tcp_protocol.encode_request(tcp_protocol.GET, [tcp_protocol.F64.pack(1.0), b"k7"])
        for i in range(0, len(wire), 7):
            sock.sendall(wire[i : i + 7])
        data, replies = b"", []
        while len(replies) < 31:  # the replies come back to back: split them here
            data += sock.recv(65536)
            while len(data) >= 5 and len(data) >= 5 + tcp_protocol.HEAD.unpack_from(data)[1]:
                status, size = tcp_protocol.HEAD.unpack_from(data)
                replies.append((status, data[5 : 5 + size]))
                data = data[5 + size :]
        assert replies[:30] == [(tcp_protocol.OK, b"")] * 30 and replies[30][0] == tcp_protocol.OK
        assert len(replies[30][1]) == 7
