"""The process-wide I/O loop: one thread reads every tcp socket of every group of the process.

Each registered socket has a *handler* (a link's frame reader, a listener, a connection
in its handshake) whose :meth:`Handler.on_readable` the loop calls when the socket is
readable. A handler never blocks: it reads what is there (non-blocking) and returns
:data:`WAIT` (call me when readable again), :data:`AGAIN` (more may be buffered, e.g.
decrypted TLS data, or it stopped at its byte budget to let the other sockets in: call
me again soon) or :data:`DONE` (unregister me). Handlers with a ``tick()`` method are
also called about every :data:`TICK` seconds (handshake deadlines).

The thread (``tdist-tcp-io``, a daemon) starts with the first registration and ends when
the last socket is unregistered, so a process with no group has no tcp thread. Sockets
are registered and unregistered from any thread: the operation is queued and the loop
woken through a socket pair; :meth:`IOLoop.unregister` returns once the loop let go of
the socket (then the caller may close it). The number of threads does not depend on how
many peers or groups there are.
"""

from __future__ import annotations

import select
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Optional, Protocol

__all__ = ["IOLoop", "Handler", "WAIT", "AGAIN", "DONE", "io_loop"]

WAIT, AGAIN, DONE = 0, 1, -1
TICK = 0.05  # seconds between the ticks of handlers that have them
THREAD_NAME = "tdist-tcp-io"


class Handler(Protocol):
    def on_readable(self) -> int:
        """Read what the socket holds without blocking; return WAIT, AGAIN or DONE."""


class _Op:
    __slots__ = ("add", "sock", "handler", "done")

    def __init__(self, add: bool, sock: Any, handler: Any) -> None:
        self.add, self.sock, self.handler = add, sock, handler
        self.done = threading.Event()


class _Poller:
    """Which registered sockets are readable: ``epoll`` itself where the platform has it
    (the fewest steps between a wake-up and the handler), else the :mod:`selectors`
    module. It knows sockets only; their handlers are the loop's. Used by the loop's
    thread only."""

    def __init__(self) -> None:
        self._epoll: Any = select.epoll() if hasattr(select, "epoll") else None
        self._selector: Any = None if self._epoll is not None else selectors.DefaultSelector()
        self._fd: dict[Any, int] = {}  # socket -> its descriptor when it was added (epoll)
        self._socks: dict[int, Any] = {}  # descriptor -> the socket added with it (epoll)

    def add(self, sock: Any) -> None:
        """Watch ``sock`` for reading (a socket watched already stays as it is)."""
        if self._epoll is None:
            if sock not in self._selector.get_map():
                self._selector.register(sock, selectors.EVENT_READ)
            return
        if sock in self._fd:
            return
        fd = sock.fileno()
        stale = self._socks.get(fd)
        if stale is not None:  # a socket closed without being removed had this number
            self._fd.pop(stale, None)
        try:
            self._epoll.register(fd, select.EPOLLIN)
        except FileExistsError:
            self._epoll.modify(fd, select.EPOLLIN)
        self._fd[sock] = fd
        self._socks[fd] = sock

    def remove(self, sock: Any) -> None:
        if self._epoll is None:
            self._selector.unregister(sock)
            return
        fd = self._fd.pop(sock)
        if self._socks.get(fd) is sock:
            del self._socks[fd]
            try:
                self._epoll.unregister(fd)
            except OSError:  # closed meanwhile: the kernel dropped it already
                pass

    def poll(self, timeout: float) -> list[Any]:
        """The sockets readable now, waiting up to ``timeout`` seconds for one."""
        if self._epoll is None:
            return [key.fileobj for key, _ in self._selector.select(timeout)]
        socks = self._socks
        return [socks[fd] for fd, _ in self._epoll.poll(timeout, len(socks) or 1) if fd in socks]

    def close(self) -> None:
        (self._epoll or self._selector).close()


class IOLoop:
    """One poller and one thread serving every registered socket (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops: deque[_Op] = deque()
        self._thread: Optional[threading.Thread] = None
        self._wake_w: Optional[socket.socket] = None
        self._sel: Optional[_Poller] = None  # the running thread's poller and handlers (touched by it only)
        self._handlers: dict[Any, Any] = {}
        self._again: list[Any] = []  # handlers to call without waiting for their socket

    # ------------------------------------------------------------ from anywhere
    def register(self, sock: Any, handler: Any) -> None:
        """Serve ``sock`` with ``handler`` (its ``on_readable`` runs once at once, for data
        already buffered); replaces the handler of a socket already registered."""
        op = _Op(True, sock, handler)
        if threading.current_thread() is self._thread:
            self._apply(op)
        else:
            self._queue(op)

    def unregister(self, sock: Any, wait: float = 5.0) -> None:
        """Stop serving ``sock``; returns once the loop no longer touches it (or after ``wait`` s)."""
        op = _Op(False, sock, None)
        if threading.current_thread() is self._thread:
            self._apply(op)
            return
        self._queue(op)
        op.done.wait(wait)

    def sync(self, wait: float = 5.0) -> None:
        """Return once every (un)registration queued before this call is done (or after
        ``wait`` s): a handler replaced by :meth:`register` is then called no more."""
        if threading.current_thread() is self._thread:
            return
        op = _Op(False, None, None)
        self._queue(op)
        op.done.wait(wait)

    def thread(self) -> Optional[threading.Thread]:
        """The loop's thread while it runs."""
        return self._thread

    def settle(self, wait: float = 2.0) -> None:
        """Wait (up to ``wait`` s) for the thread to end if no socket is registered any more."""
        with self._lock:
            thread = self._thread if not self._handlers and not self._ops else None
        if thread is not None and thread is not threading.current_thread():
            thread.join(wait)

    def _queue(self, op: _Op) -> None:
        with self._lock:
            self._ops.append(op)
            if self._thread is None:
                if not op.add:  # nothing runs: nothing to let go of
                    self._ops.pop()
                    op.done.set()
                    return
                wake_r, self._wake_w = socket.socketpair()
                wake_r.setblocking(False)
                self._thread = threading.Thread(target=self._run, args=(wake_r,), name=THREAD_NAME, daemon=True)
                self._thread.start()
            wake = self._wake_w
        try:
            wake.send(b"\0", socket.MSG_DONTWAIT)  # type: ignore[union-attr]
        except OSError:  # the pair's buffer is full: the loop is awake anyway
            pass

    # ------------------------------------------------------------ the thread
    def _run(self, wake_r: socket.socket) -> None:
        sel = self._sel = _Poller()
        sel.add(wake_r)
        handlers = self._handlers
        wake_w = None
        last_tick = time.monotonic()
        try:
            while True:
                with self._lock:
                    ops = list(self._ops)
                    self._ops.clear()
                    if not ops and not handlers:
                        self._thread = None  # a later registration starts a new thread
                        wake_w, self._wake_w = self._wake_w, None
                        break
                for op in ops:
                    self._apply(op)
                ready = sel.poll(0 if self._again else TICK)
                run: list[Any] = self._again
                self._again = []
                for sock in ready:
                    if sock is wake_r:
                        try:
                            while wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                        continue
                    handler = handlers.get(sock)
                    if handler is not None and handler not in run:
                        run.append(handler)
                for handler in run:
                    sock = handler.sock
                    if sock not in handlers or handlers[sock] is not handler:
                        continue  # unregistered meanwhile
                    try:
                        verdict = handler.on_readable()
                    except BaseException:  # noqa: BLE001 - a handler must not stop the loop
                        verdict = DONE
                    if verdict == AGAIN:
                        self._again.append(handler)
                    elif verdict == DONE and handlers.get(sock) is handler:
                        self._apply(_Op(False, sock, None))
                now = time.monotonic()
                if now - last_tick >= TICK:
                    last_tick = now
                    for handler in list(handlers.values()):
                        tick = getattr(handler, "tick", None)
                        if tick is not None:
                            try:
                                tick()
                            except Exception:  # noqa: BLE001
                                pass
        finally:
            handlers.clear()
            self._again = []
            self._sel = None
            sel.close()
            wake_r.close()
            if wake_w is not None:
                wake_w.close()

    def _apply(self, op: _Op) -> None:
        """Do a queued (un)registration (in the loop's thread)."""
        sock, sel, handlers = op.sock, self._sel, self._handlers
        assert sel is not None  # (only the running loop's thread applies operations)
        try:
            if op.add:
                sel.add(sock)
                handlers[sock] = op.handler
                self._again.append(op.handler)
            elif sock in handlers:
                del handlers[sock]
                sel.remove(sock)
        except (OSError, ValueError, KeyError):  # closed meanwhile
            handlers.pop(sock, None)
        finally:
            op.done.set()


_LOOP = IOLoop()


def io_loop() -> IOLoop:
    """The process's I/O loop."""
    return _LOOP
