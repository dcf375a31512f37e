"""Network probes for tests/test_multihost.py, run on the hosts of a simulated cluster.

    python multihost_net.py serve ADDRESS PORT          # echo one byte, count the rest; prints "ready", then the count
    python multihost_net.py client ADDRESS PORT NBYTES  # JSON: best round trip of 10, seconds to send NBYTES
    python multihost_net.py mcast-recv GROUP PORT [S]   # prints "ready", then the first datagram's text
                                                        # ("nothing" if none came within S seconds, default 30)
    python multihost_net.py mcast-send GROUP PORT TEXT  # sends TEXT to GROUP 20 times, 10 ms apart
    python multihost_net.py whoami                      # JSON: host name, its address, /dev/shm contents
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import time


def _family(address: str) -> int:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def serve(address: str, port: int) -> None:
    with socket.socket(_family(address), socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1)
        listener.settimeout(30)
        print("ready", flush=True)
        conn, _ = listener.accept()
        conn.settimeout(30)
        received = 0
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            if data == b"p" and received == 0:
                conn.sendall(b"p")
            else:
                received += len(data)
        conn.sendall(b"d")
        print(received, flush=True)


def client(address: str, port: int, nbytes: int) -> None:
    sock = socket.create_connection((address, port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(10):
        start = time.perf_counter()
        sock.sendall(b"p")
        sock.recv(1)
        rtts.append(time.perf_counter() - start)
    start = time.perf_counter()
    sock.sendall(b"\1" * nbytes)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)  # the server has counted everything
    print(json.dumps({"rtt": min(rtts), "send_seconds": time.perf_counter() - start}), flush=True)


def mcast_recv(group: str, port: int, timeout: float) -> None:
    sock = socket.socket(_family(group), socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    if ":" in group:
        mreq = socket.inet_pton(socket.AF_INET6, group) + struct.pack("@I", socket.if_nametoindex("eth0"))
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_JOIN_GROUP, mreq)
    else:
        mreq = socket.inet_aton(group) + socket.inet_aton("0.0.0.0")
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
    sock.settimeout(timeout)
    print("ready", flush=True)
    try:
        data, _ = sock.recvfrom(1024)
    except socket.timeout:
        data = b"nothing"
    print(data.decode(), flush=True)


def mcast_send(group: str, port: int, text: str) -> None:
    sock = socket.socket(_family(group), socket.SOCK_DGRAM)
    for _ in range(20):
        sock.sendto(text.encode(), (group, port))
        time.sleep(0.01)


def whoami() -> None:
    name = socket.gethostname()
    print(json.dumps({"hostname": name, "address": socket.gethostbyname(name), "shm": sorted(os.listdir("/dev/shm"))}))


def main(argv: list[str]) -> int:
    mode, args = argv[0], argv[1:]
    if mode == "serve":
        serve(args[0], int(args[1]))
    elif mode == "client":
        client(args[0], int(args[1]), int(args[2]))
    elif mode == "mcast-recv":
        mcast_recv(args[0], int(args[1]), float(args[2]) if len(args) > 2 else 30.0)
    elif mode == "mcast-send":
        mcast_send(args[0], int(args[1]), args[2])
    elif mode == "whoami":
        whoami()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
