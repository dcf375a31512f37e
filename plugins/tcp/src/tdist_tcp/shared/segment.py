"""The shared-memory segment of a same-host group: create, locate, attach, authenticate.

A segment is an anonymous memory file (``memfd_create(2)``), never a name in
``/dev/shm``: rank 0 creates it and keeps its descriptor open while the group is
being set up; the other ranks open it through ``/proc/<rank 0's pid>/fd/<fd>`` (the
kernel lets a process do so only if it could trace rank 0: same user, same pid
namespace) and map it. Ranks share a segment only within one *shared-memory scope*
(same boot of the same kernel and same IPC namespace: where POSIX shared memory would
be shared too; containers or simulated hosts with their own IPC namespace keep to
their sockets). Once every rank has answered, rank 0 closes its descriptor
and only the mappings hold the memory, so it is freed when the last rank unmaps it
(:meth:`Segment.close`, at ``destroy_process_group``) or dies, however it dies:
there is nothing to unlink and nothing to reclaim after a crash.

The header holds a magic string, the group nonce, the layout and
``HMAC(group key, "S" || header || name)``, so a rank maps only a segment created
by a rank that knows the group's key (see :mod:`tdist_tcp.protocol.auth`).
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import re
import stat
import struct
from typing import Optional

from tdist.plugin import descriptor_shortage

from ..protocol.auth import MAC_SIZE, mac

__all__ = ["NAME_PREFIX", "layout", "create", "scope", "locator", "attach", "close_fd"]

NAME_PREFIX = "tdist-tcp-"
_MAGIC = b"TDSHM002"
_HEADER = struct.Struct("<8s16sIIQ")  # magic, group nonce, group size, pad, slot bytes
_NAME = re.compile(r"tdist-tcp-[0-9a-f]{16}-[0-9a-f]{8}")


def layout(size: int, slot: int, ctrl_bytes: int) -> tuple[int, int, int]:
    """(control offset, data offset, total bytes) of a segment for ``size`` ranks with
    ``ctrl_bytes`` of control block each and two ``slot``-byte buffers each."""
    ctrl = 4096
    data = ctrl + ((size * ctrl_bytes + 4095) // 4096) * 4096
    return ctrl, data, data + 2 * size * slot


def _proof(key: bytes, header: bytes, name: str) -> bytes:
    return mac(key, b"S", header, name.encode())


def create(total: int, size: int, slot: int, nonce: bytes, key: bytes) -> tuple[str, int, mmap.mmap]:
    """A new segment of ``total`` bytes with its header written: (name, descriptor, mapping).
    The caller closes the descriptor once every rank has attached."""
    name = f"{NAME_PREFIX}{nonce.hex()[:16]}-{os.urandom(4).hex()}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        mm = mmap.mmap(fd, total)
    except BaseException:
        os.close(fd)
        raise
    header = _HEADER.pack(_MAGIC, nonce, size, 0, slot)
    mm[: _HEADER.size] = header
    mm[_HEADER.size : _HEADER.size + MAC_SIZE] = _proof(key, header, name)
    return name, fd, mm


def scope() -> str:
    """This process's shared-memory scope (processes of one scope can share memory): a digest
    of the kernel's boot id and the IPC namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        ipc = os.readlink("/proc/self/ns/ipc")
    except OSError:
        ipc = "?"
    return hashlib.sha256(f"{boot}/{ipc}".encode()).hexdigest()[:16]


def locator(name: str, fd: int) -> str:
    """What rank 0 publishes for the others to find the segment: ``pid:fd:scope:name``."""
    return f"{os.getpid()}:{fd}:{scope()}:{name}"


def attach(where: str, total: int, size: int, slot: int, nonce: bytes, key: bytes) -> Optional[mmap.mmap]:
    """Map the segment ``where`` (a :func:`locator`) if it is this group's, on this host,
    of the expected size and proved with ``key``; None otherwise."""
    try:
        pid_text, fd_text, their_scope, name = where.split(":", 3)
        path = f"/proc/{int(pid_text)}/fd/{int(fd_text)}"
    except ValueError:
        return None
    if not _NAME.fullmatch(name) or their_scope != scope():
        return None
    try:  # another process, or another host's pid: the descriptor is not this memory file
        if os.readlink(path) != f"/memfd:{name} (deleted)":
            return None
        fd = os.open(path, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if descriptor_shortage(exc) is not None:
            raise  # the caller says so
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != total:
            return None
        mm = mmap.mmap(fd, total)
    except OSError:
        return None
    finally:
        os.close(fd)
    header = bytes(mm[: _HEADER.size])
    proof = bytes(mm[_HEADER.size : _HEADER.size + MAC_SIZE])
    if header != _HEADER.pack(_MAGIC, nonce, size, 0, slot) or not hmac.compare_digest(
        proof, _proof(key, header, name)
    ):
        mm.close()
        return None
    return mm


def close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
