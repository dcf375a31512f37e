"""Network probes for tests/test_multihost.py, run on the hosts of a simulated cluster.

python multihost_net.py serve ADDRESS PORT          # echo one byte, count the rest; prints "ready", then the count
python multihost_net.py client ADDRESS PORT NBYTES  # JSON: best round trip of 10, seconds to send NBYTES
python multihost_net.py mcast-recv GROUP PORT [S]   # prints "ready", then the first datagram's text
                                                    # ("nothing" if none came within S seconds, default 30)
python multihost_net.py mcast-send GROUP PORT TEXT  # sends TEXT to GROUP 20 times, 10 ms apart
python multihost_net.py whoami                      # JSON: host name, its address, /dev/shm contents
python multihost_net.py mcast-forge GROUP PORT S NAME...  # an attacker on the multicast rendezvous of
                                                    # group_name NAME...: prints "ready", then JSON
                                                    # {NAME: offers sent} after S seconds or SIGTERM
python multihost_net.py mcast-ghost GROUP PORT NAME N   # a process of job NAME (world size N) that
                                                    # announces itself until offered a rank, prints
                                                    # "offered RANK" and dies without taking it
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


def mcast_forge(group: str, port: int, seconds: float, names: list[str]) -> None:
    """For ``seconds`` (or until SIGTERM): announce a fake process in each job ``names`` (lowest id, to win the
    election) and answer every real process's announcement with an offer of rank 0's place
    in a store this process serves (no token). Each datagram twice: without authentication,
    and with a MAC under a wrong token. Also replay, every 50 ms, every authenticated
    announcement heard (a copy of a real process's, MAC and all, from this host). Uses
    tdist's datagram layout, as an attacker reading the traffic would."""
    import dataclasses
    import select
    import signal

    from tdist._rendezvous.multicast_socket import MulticastOptions, open_multicast_socket
    from tdist._rendezvous.multicast_wire import _HEAD, ANNOUNCE, OFFER, Datagram, job_tag, pack, source_of
    from tdist._store.tcp_server import TCPStoreServer

    address = socket.gethostbyname(socket.gethostname())
    fake = TCPStoreServer(address, 0, token=b"").start()
    sock = open_multicast_socket(MulticastOptions(group, port))
    tags = {job_tag(name): name for name in names}
    world_sizes = {tag: 2 for tag in tags}
    offers = {name: 0 for name in names}
    me = bytes(16)
    source, source_port = source_of((address, port))  # where its datagrams come from, named as a real one would
    captured: set[bytes] = set()

    def send(datagram, tag):
        datagram = dataclasses.replace(datagram, source=source, source_port=source_port)
        for token in (b"", b"not the job's token"):
            sock.sendto(pack(datagram, tag, token), (group, port))

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    announce_at = 0.0
    while time.monotonic() < deadline and not stop:
        if time.monotonic() >= announce_at:
            for tag, world_size in world_sizes.items():
                send(Datagram(ANNOUNCE, me, world_size, -1, text="forger"), tag)
            for data in list(captured):
                sock.sendto(data, (group, port))
            announce_at = time.monotonic() + 0.05
        if not select.select([sock], [], [], 0.05)[0]:
            continue
        data = sock.recv(4096)
        if len(data) < _HEAD.size:
            continue
        _, _, kind, authenticated, tag, sender, world_size, rank, *_ = _HEAD.unpack_from(data)
        if kind == ANNOUNCE and tag in tags and authenticated:
            captured.add(data)
        if kind == ANNOUNCE and tag in tags and sender != me:
            world_sizes[tag] = world_size
            send(Datagram(OFFER, me, world_size, max(rank, 0), sender, fake.port, address), tag)
            offers[tags[tag]] += 1
    sock.close()
    fake.stop()
    print(json.dumps(offers), flush=True)


def mcast_ghost(group: str, port: int, name: str, world_size: int) -> None:
    """A process of the multicast rendezvous of job ``name`` that crashes once the job has
    counted it in: it announces itself (id ff..ff: the last rank of its host) until the
    store's host offers it a rank."""
    import select

    from tdist._rendezvous.multicast_socket import MulticastOptions, open_multicast_socket
    from tdist._rendezvous.multicast_wire import ANNOUNCE, OFFER, Datagram, job_tag, pack, source_of, unpack

    sock, tag, me = open_multicast_socket(MulticastOptions(group, port)), job_tag(name), b"\xff" * 16
    source, source_port = bytes(16), 0  # learned from its own first datagram, as a real process does
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        announce = Datagram(ANNOUNCE, me, world_size, -1, text="ghost", source=source, source_port=source_port)
        sock.sendto(pack(announce, tag, b""), (group, port))
        while select.select([sock], [], [], 0.05)[0]:
            data, origin = sock.recvfrom(4096)
            got = unpack(data, tag, b"")
            if isinstance(got, Datagram) and got.sender == me and not source_port:
                source, source_port = source_of(origin)
            if isinstance(got, Datagram) and got.kind == OFFER and got.recipient == me:
                print(f"offered {got.rank}", flush=True)
                return
    print("never offered", flush=True)


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
    elif mode == "mcast-forge":
        mcast_forge(args[0], int(args[1]), float(args[2]), args[3:])
    elif mode == "mcast-ghost":
        mcast_ghost(args[0], int(args[1]), args[2], int(args[3]))
    elif mode == "whoami":
        whoami()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
