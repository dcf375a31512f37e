"""Optional TLS for the mesh's TCP connections (between hosts); Unix sockets and shared memory stay as they are.

Configured like the store (the ``TDIST_TLS_*`` variables of :mod:`tdist._store.tls`) or by
``pg_options`` keys ``tls_cert``, ``tls_key``, ``tls_ca``, ``tls_check_hostname`` and
``tls_client_auth`` (the same on every rank; options win over the variables). The
connecting rank is the TLS client, the accepting rank the TLS server; the mesh's HMAC
handshake then runs inside TLS.

:class:`TlsStream` presents a TLS connection as the few socket calls the transport makes.
A blocking TLS socket retries a stalled write inside OpenSSL forever (``SO_SNDTIMEO`` is
not seen) and one TLS connection must not be used by two threads at once, so the stream
runs the socket non-blocking under a lock (see :class:`TlsStream`). ``sendmsg`` sends the
first buffer only (no copy of joined buffers: the caller sends the rest), and
``MSG_WAITALL`` is done by looping.
"""

from __future__ import annotations

import select
import socket
import ssl
import struct
import threading
import time
from typing import Any, Mapping, Optional, Sequence

from tdist.plugin import TLS_RECORD_TYPE, WOULD_BLOCK, TlsConfig, describe_ssl_error

__all__ = ["MeshTls", "TlsStream", "TlsRefused", "mesh_tls", "TLS_RECORD_TYPE", "WOULD_BLOCK", "TLS_REQUIRED"]

#: what a TLS rank answers (in plaintext) to a connection that sends a plaintext HELLO, so that
#: the connecting rank can say why instead of retrying until its timeout
TLS_REQUIRED = b"TDIST-TCP/TLS-REQUIRED"

_OPTION_KEYS = ("cert", "key", "ca", "check_hostname", "client_auth")
_WAITALL = getattr(socket, "MSG_WAITALL", 0)


class TlsRefused(Exception):
    """A TLS handshake failed in a way retrying cannot fix (a certificate, or a peer without TLS)."""


def mesh_tls(options: Mapping[str, Any], where: str) -> Optional["MeshTls"]:
    """The mesh's TLS from ``options`` (``tls_*`` keys), else the ``TDIST_TLS_*`` variables; None: off."""
    given = {k: options.get("tls_" + k) for k in _OPTION_KEYS}
    config = TlsConfig.from_mapping(given) if any(v not in (None, "") for v in given.values()) else TlsConfig.from_env()
    return None if config is None else MeshTls(config, where)


class MeshTls:
    """The two TLS contexts of one rank's mesh: accepting (server) and connecting (client)."""

    def __init__(self, config: TlsConfig, where: str) -> None:
        self.config = config
        self.server = config.server_context(where)
        self.server.num_tickets = 0  # no session tickets after the handshake: mesh connections are never resumed
        self.client = config.client_context(where)

    def connect(self, sock: socket.socket, host: str, limit: float) -> ssl.SSLSocket:
        """Wrap a connected ``sock`` and shake hands within ``limit`` s (raises TlsRefused or OSError)."""
        sock.settimeout(limit)
        try:
            return self.client.wrap_socket(sock, server_hostname=host)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as exc:
            raise ConnectionError(
                f"TLS handshake: the peer closed the connection ({exc}); a peer without TLS does this"
            ) from None
        except ssl.SSLError as exc:
            raise TlsRefused(describe_ssl_error(exc)) from None

    def accept(self, sock: socket.socket) -> ssl.SSLSocket:
        """Wrap an accepted non-blocking ``sock``; the caller drives :func:`shake` until it returns True."""
        return self.server.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def shake(sock: ssl.SSLSocket) -> bool:
    """One non-blocking step of a server-side handshake: True once done, False while it waits
    for the peer; raises ssl.SSLError/OSError when it fails."""
    try:
        sock.do_handshake()
    except WOULD_BLOCK:
        return False
    return True


class TlsStream:
    """A connected TLS socket with the plain socket's calls that the transport uses.

    The I/O loop reads a peer's socket (:meth:`recv_nowait`) while another thread sends on it, but one
    OpenSSL connection must not be used by two threads at once. So the TLS socket is
    non-blocking, every TLS call is made holding :attr:`lock` (never while waiting), and
    waiting is done outside it with ``select``. A send that makes no progress for one send
    slice (the transport's ``SO_SNDTIMEO``) raises BlockingIOError, as a plain socket does,
    and is retried by the transport with the same bytes, as OpenSSL requires.
    """

    __slots__ = ("tls", "lock", "slice")

    def __init__(self, tls: ssl.SSLSocket) -> None:
        self.tls = tls
        self.lock = threading.Lock()
        self.slice = 0.5
        tls.settimeout(0.0)

    def setsockopt(self, level: int, option: int, value: Any) -> None:
        if level == socket.SOL_SOCKET and option == socket.SO_SNDTIMEO and isinstance(value, bytes):
            sec, usec = struct.unpack("ll", value)
            self.slice = max(0.001, sec + usec / 1e6)
        else:
            self.tls.setsockopt(level, option, value)

    def send(self, data: Any, flags: int = 0) -> int:
        deadline = time.monotonic() + self.slice
        while True:
            with self.lock:
                try:
                    return self.tls.send(data)
                except ssl.SSLWantReadError:
                    want = 0
                except ssl.SSLWantWriteError:
                    want = 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlockingIOError("TLS send: no progress within the send slice")
            _wait(self.tls, want, left)

    def sendmsg(self, parts: Sequence[Any]) -> int:
        for part in parts:
            if len(part):
                return self.send(part)
        return 0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        nbytes = nbytes or len(view)
        got = 0
        while got < nbytes:
            with self.lock:
                try:
                    n = self.tls.recv_into(view[got:], nbytes - got)
                    want = -1
                except ssl.SSLWantReadError:
                    want = 0
                except ssl.SSLWantWriteError:
                    want = 1
            if want >= 0:  # a blocking read: wait as long as it takes (shutdown() ends the wait)
                _wait(self.tls, want, None)
                continue
            if n == 0 or not flags & _WAITALL:
                return got + n
            got += n
        return got

    def recv_nowait(self, buffer: Any, nbytes: int) -> int:
        """Read what is there into ``buffer`` without waiting (the I/O loop's read): raises
        BlockingIOError when nothing is (so no decrypted data stays buffered unseen)."""
        with self.lock:
            try:
                return self.tls.recv_into(buffer, nbytes)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise BlockingIOError("TLS: nothing to read yet") from None

    def shutdown(self, how: int) -> None:
        # the raw socket's shutdown: SSLSocket.shutdown drops the TLS state, and the reader would
        # then read ciphertext as frames
        socket.socket.shutdown(self.tls, how)

    def close(self) -> None:
        self.tls.close()

    def fileno(self) -> int:
        return self.tls.fileno()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tls, name)


def _wait(sock: socket.socket, write: int, timeout: Optional[float]) -> None:
    """Until ``sock`` is readable (``write`` 0) or writable (1), or ``timeout`` s pass."""
    fd = sock.fileno()
    if fd < 0:
        raise OSError("the socket is closed")
    poller = select.poll()  # not select(): descriptors above 1023 are common in large jobs
    poller.register(fd, select.POLLOUT if write else select.POLLIN)
    poller.poll(None if timeout is None else max(1, int(timeout * 1000)))


def tell_tls_required(sock: socket.socket) -> None:
    """Best effort: consume a plaintext HELLO and answer :data:`TLS_REQUIRED` before the caller closes."""
    try:
        sock.recv(4096)
        sock.send(TLS_REQUIRED)
    except OSError:
        pass


def fatal(exc: BaseException) -> Optional[str]:
    """Why a connection failed for good (a certificate refused by either side), None when
    retrying may help (a closed connection, a timeout)."""
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError) + WOULD_BLOCK):
        return describe_ssl_error(exc)
    return None


def refusal(exc: BaseException) -> str:
    """Why an accepted connection's TLS handshake failed, for the timeout error's list of refusals."""
    if isinstance(exc, ssl.SSLError):
        return describe_ssl_error(exc)
    return f"TLS handshake failed: {exc}"
