"""The switch of a :class:`~tdist.testing.cluster.Cluster` when its links have a delay:
a user-space Ethernet switch with a bounded delay line (this kernel has ``tbf`` but no
``netem``).

Run inside the cluster's switch namespace as
``python -m tdist.testing._delayline PORT...`` (PORT: an interface name there, the
switch end of one host's link). It forwards frames between the ports like a learning
switch (broadcast, multicast and unknown destinations go to every other port) and holds
each frame that host *i* sent for ``delays[i]`` seconds first, as ``netem delay`` on
host *i*'s interface would. Frames of one host leave in the order they came.

Bounded: at most :data:`MAX_QUEUED_BYTES` wait per port; a frame beyond that is dropped,
as by a full switch queue (TCP retransmits it). Frames travel with their virtio-net
header (``PACKET_VNET_HDR``), so segmentation and checksum offload keep working: a 64 KiB
TCP segment crosses as one frame.

Control on stdin, one command a line: ``delay PORT_INDEX SECONDS``, ``multicast 0`` (drop
multicast frames; broadcast still passes) or ``multicast 1``; the switch exits when stdin
closes (its owner is gone). It prints ``ready`` once every port is open.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import sys
import time
from typing import Deque, Optional

__all__ = ["MAX_QUEUED_BYTES", "DelayLine", "main"]

#: Bytes a port may hold in its delay line before frames are dropped.
MAX_QUEUED_BYTES = 32 << 20
_ETH_P_ALL = 0x0003
_SOL_PACKET = 263
_PACKET_VNET_HDR = 15
_PACKET_IGNORE_OUTGOING = 23
_VNET_HDR_LEN = 10
_MAX_FRAME = 256 << 10  # a GSO frame (64 KiB, more with BIG TCP) and its headers
_DRAIN = 64  # frames read from one port before looking at the others
_BROADCAST = b"\xff" * 6


class DelayLine:
    """The switch over ``ports`` (interface names); ``delays[i]``: seconds added to the
    frames received on port i (sent by host i)."""

    def __init__(self, ports: list[str], delays: Optional[list[float]] = None) -> None:
        self.ports = list(ports)
        self.delays = list(delays or [0.0] * len(ports))
        self.socks = [self._open(name) for name in self.ports]
        self.queues: list[Deque[tuple[float, bytes]]] = [collections.deque() for _ in self.ports]
        self.queued = [0] * len(self.ports)
        self.macs: dict[bytes, int] = {}
        self.multicast = True
        self.dropped = 0

    @staticmethod
    def _open(ifname: str) -> socket.socket:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        sock.setsockopt(_SOL_PACKET, _PACKET_VNET_HDR, 1)
        sock.setsockopt(_SOL_PACKET, _PACKET_IGNORE_OUTGOING, 1)  # not the frames we send
        for opt in (getattr(socket, "SO_RCVBUFFORCE", 33), getattr(socket, "SO_SNDBUFFORCE", 32)):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
            except OSError:
                pass
        sock.bind((ifname, _ETH_P_ALL))
        sock.setblocking(False)
        return sock

    # ------------------------------------------------------------------ frames
    def receive(self, port: int, now: float) -> None:
        """Read what port ``port`` has (up to :data:`_DRAIN` frames) into its delay line."""
        sock, queue, delay = self.socks[port], self.queues[port], self.delays[port]
        for _ in range(_DRAIN):
            try:
                frame = sock.recv(_MAX_FRAME)
            except (BlockingIOError, InterruptedError):
                return
            if len(frame) < _VNET_HDR_LEN + 14:
                continue
            if delay <= 0 and not queue:
                self.forward(port, frame)
            elif self.queued[port] + len(frame) > MAX_QUEUED_BYTES:
                self.dropped += 1
            else:
                queue.append((now + delay, frame))
                self.queued[port] += len(frame)

    def release(self, now: float) -> Optional[float]:
        """Forward every frame whose time has come; the time the next one is due (or None)."""
        due: Optional[float] = None
        for port, queue in enumerate(self.queues):
            while queue and queue[0][0] <= now:
                _, frame = queue.popleft()
                self.queued[port] -= len(frame)
                self.forward(port, frame)
            if queue and (due is None or queue[0][0] < due):
                due = queue[0][0]
        return due

    def forward(self, port: int, frame: bytes) -> None:
        """Send ``frame`` (vnet header + Ethernet frame) from ``port`` on to its destination."""
        dst = frame[_VNET_HDR_LEN : _VNET_HDR_LEN + 6]
        src = frame[_VNET_HDR_LEN + 6 : _VNET_HDR_LEN + 12]
        if not src[0] & 1:
            self.macs[src] = port
        if dst[0] & 1 and not self.multicast and dst != _BROADCAST:
            self.dropped += 1
            return
        out = self.macs.get(dst) if not dst[0] & 1 else None
        targets = [out] if out is not None and out != port else [p for p in range(len(self.socks)) if p != port]
        for target in targets:
            try:
                self.socks[target].send(frame)
            except OSError:  # queue of the link full (tbf), or the link went away
                self.dropped += 1

    # ----------------------------------------------------------------- control
    def command(self, line: str) -> None:
        words = line.split()
        if len(words) == 3 and words[0] == "delay":
            self.delays[int(words[1])] = max(0.0, float(words[2]))
        elif len(words) == 2 and words[0] == "multicast":
            self.multicast = words[1] == "1"
        elif words:
            print(f"delayline: unknown command {line.strip()!r}", file=sys.stderr, flush=True)

    def run(self, control: int) -> None:
        """Switch frames until ``control`` (a readable fd of commands) reaches end of file."""
        fds = [s.fileno() for s in self.socks]
        by_fd = {fd: i for i, fd in enumerate(fds)}
        pending = b""
        due: Optional[float] = None
        while True:
            timeout = None if due is None else max(0.0, due - time.monotonic())
            readable, _, _ = select.select(fds + [control], [], [], timeout)
            now = time.monotonic()
            for fd in readable:
                if fd == control:
                    data = os.read(control, 4096)
                    if not data:
                        return
                    pending += data
                    while b"\n" in pending:
                        line, pending = pending.split(b"\n", 1)
                        self.command(line.decode(errors="replace"))
                else:
                    self.receive(by_fd[fd], now)
            due = self.release(time.monotonic())


def main(argv: Optional[list[str]] = None) -> int:
    ports = list(sys.argv[1:] if argv is None else argv)
    if not ports:
        print("usage: python -m tdist.testing._delayline PORT...", file=sys.stderr)
        return 2
    line = DelayLine(ports)
    print("ready", flush=True)
    try:
        line.run(sys.stdin.fileno())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
