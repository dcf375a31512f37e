"""The request side of :class:`~.tcp_server.TCPStoreServer`: the key space, the commands, parked requests.

A mixin of the server (one event-loop thread runs all of it): every command runs between
two selector calls, so each is atomic. A request that must wait (``get`` of a missing key,
``wait``, ``multi_get``, a blocking ``queue_pop``, ``barrier``) parks its connection until a
change to one of its keys completes it or its deadline passes (a timer of the server).

The bookkeeping costs O(1) per key change and waiter, whatever the number of connections:

* ``get``, ``wait`` and ``multi_get`` wait on the keys still missing when they parked; a
  change of one of those keys strikes it off (``_Parked.missing``), and only the last one
  checks the whole request again (a key may have gone meanwhile: then it waits again for
  the ones missing now). ``wait`` on N keys costs O(N) in all, not O(N) per arriving key.
* blocking pops wait apart (``_poppers``): a push wakes the oldest popper, not every one.
* barriers wait by key and world size (``_barriers``): an arrival reads the counter once and
  completes the groups it reached, instead of testing every parked rank (O(N^2) per barrier).
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Union

from .._errors import DistStoreError
from .table import KeyTable
from .tcp_connections import _Conn
from .tcp_protocol import (
    ADD,
    APPEND,
    BARRIER,
    CHECK,
    COMPARE_SET,
    DELETE,
    EMPTY,
    ERROR,
    GET,
    LIST_KEYS,
    MULTI_GET,
    MULTI_SET,
    NUM_KEYS,
    OK,
    PING,
    QUEUE_LEN,
    QUEUE_POP,
    QUEUE_PUSH,
    SET,
    TIMEOUT,
    WAIT,
    ProtocolError,
    encode_list,
    encode_reply,
    parse_request,
    timeout_arg,
)

__all__: List[str] = []

_OK_EMPTY = encode_reply(OK)
_TRUE, _FALSE = encode_reply(OK, b"\x01"), encode_reply(OK, b"\x00")
_Waiters = Dict[_Conn, None]  # an ordered set: the oldest waiter first


class _Parked:
    """A request waiting for keys: what it is, for which keys (``extra``: a barrier's world
    size), and, for ``wait``/``multi_get``, the keys not yet seen present since it parked."""

    __slots__ = ("kind", "keys", "extra", "missing")

    def __init__(self, kind: int, keys: List[bytes], extra: int = 0) -> None:
        self.kind, self.keys, self.extra = kind, keys, extra
        self.missing: Set[bytes] = set()


class _Requests:
    """The commands and the parked requests (a mixin of the server, which provides the
    attributes below and the connection side's methods)."""

    _table: KeyTable
    _waiters: Dict[bytes, _Waiters]  # get, wait, multi_get: by the keys they still miss
    _poppers: Dict[bytes, _Waiters]  # blocking queue pops, by queue
    _barriers: Dict[bytes, Dict[int, _Waiters]]  # barriers, by key and world size
    _parked_count: int
    _handlers: Dict[int, Callable[[_Conn, List[bytes]], Optional[bytes]]]
    _resume: "collections.deque[_Conn]"

    if TYPE_CHECKING:  # provided by the server and the connection side

        def _timer(self, delay: float, conn: _Conn, what: object) -> None: ...

        def _send(self, conn: _Conn, data: bytes) -> None: ...

        def _drop(self, conn: _Conn, exc: Exception) -> None: ...

    def _handler_table(self) -> Dict[int, Callable[[_Conn, List[bytes]], Optional[bytes]]]:
        """The handler of each command."""
        return {
            SET: self._set,
            GET: self._get,
            ADD: self._add,
            COMPARE_SET: self._compare_set,
            WAIT: self._wait,
            CHECK: self._check,
            DELETE: self._delete,
            NUM_KEYS: self._num_keys,
            PING: self._ping,
            APPEND: self._append,
            MULTI_GET: self._multi_get,
            MULTI_SET: self._multi_set,
            QUEUE_PUSH: self._queue_push,
            QUEUE_POP: self._queue_pop,
            QUEUE_LEN: self._queue_len,
            LIST_KEYS: self._list_keys,
            BARRIER: self._barrier,
        }

    # ----------------------------------------------------------------- requests
    def _process(self, conn: _Conn) -> None:
        """Serve the complete requests buffered on ``conn`` until one parks it."""
        used = self._serve(conn, conn.buf)
        if used:
            del conn.buf[:used]

    def _serve(self, conn: _Conn, buf: Union[bytearray, memoryview]) -> int:
        """Serve the complete requests in ``buf`` until one parks ``conn``; return the bytes used."""
        pos, replies = 0, []
        handlers, scan = self._handlers, conn.scan
        while conn.parked is None and not conn.closed:
            request = parse_request(buf, pos, scan)
            if request is None:
                break
            cmd, args, pos = request
            reply = handlers[cmd](conn, args)
            if reply is not None:
                replies.append(reply)
        if replies and not conn.closed:
            self._send(conn, replies[0] if len(replies) == 1 else b"".join(replies))
        return pos

    def _drain_resume(self) -> None:
        """Serve what the connections completed by a change had queued behind their parked request."""
        while self._resume:
            conn = self._resume.popleft()
            if not conn.closed and conn.parked is None:
                try:
                    self._process(conn)
                except Exception as exc:  # noqa: BLE001 - as in _on_read
                    self._drop(conn, exc)

    # ----------------------------------------------------------------- parked requests
    def _changed(self, key: bytes) -> None:
        """``key`` changed: complete the parked requests it satisfies, oldest first (readers
        before pops, so that a ``wait`` on a queue sees the value a pop then takes)."""
        waiting = self._waiters.get(key)
        if waiting:
            self._wake(key, waiting)
        if self._poppers:
            poppers = self._poppers.get(key)
            if poppers:
                self._wake_poppers(key, poppers)
        if self._barriers:
            groups = self._barriers.get(key)
            if groups:
                self._wake_barriers(key, groups)

    def _complete(self, conn: _Conn, reply: bytes) -> None:
        self._unpark(conn)
        self._send(conn, reply)
        self._resume.append(conn)

    def _wake(self, key: bytes, waiting: _Waiters) -> None:
        table = self._table
        value = table.values.get(key)
        present = value is not None or table.has(key)
        if not present:
            return
        get_reply: Optional[bytes] = None
        for conn in list(waiting):
            parked = conn.parked
            if parked is None:  # cannot happen: unparking unregisters
                waiting.pop(conn, None)
                continue
            if parked.kind == GET:
                if value is None:
                    continue
                if get_reply is None:
                    get_reply = encode_reply(OK, value)
                self._complete(conn, get_reply)
                continue
            if parked.kind == MULTI_GET and value is None:
                continue
            missing = parked.missing
            missing.discard(key)
            waiting.pop(conn, None)
            if missing:
                continue
            reply = self._try(parked)  # every key was seen once: are they all there now?
            if reply is not None:
                self._complete(conn, reply)
            else:  # one went meanwhile (a delete, a pop): wait for those missing now
                self._watch(conn, parked)
        if not waiting and self._waiters.get(key) is waiting:
            del self._waiters[key]

    def _wake_poppers(self, key: bytes, poppers: _Waiters) -> None:
        for conn in list(poppers):
            value = self._table.queue_pop(key)
            if value is None:
                return
            self._complete(conn, encode_reply(OK, value))

    def _wake_barriers(self, key: bytes, groups: Dict[int, _Waiters]) -> None:
        try:
            arrived = int(self._table.values.get(key, b"0"))
            reply = _OK_EMPTY
        except ValueError:
            arrived, reply = (
                1 << 62,
                encode_reply(ERROR, b"barrier: the barrier key was overwritten with a non-integer"),
            )
        for size in [size for size in groups if size <= arrived]:
            for conn in list(groups.get(size, ())):
                self._complete(conn, reply)

    def _missing(self, parked: _Parked) -> List[bytes]:
        """The keys ``parked`` (a get, wait or multi_get) still waits for."""
        table = self._table
        if parked.kind == WAIT:
            return table.missing(parked.keys)
        values = table.values
        return [k for k in parked.keys if k not in values]

    def _watch(self, conn: _Conn, parked: _Parked) -> None:
        """Register ``conn`` on the keys ``parked`` waits for (a get, wait or multi_get)."""
        parked.missing = set(self._missing(parked))
        waiters = self._waiters
        for key in parked.missing:
            found = waiters.get(key)
            if found is None:
                waiters[key] = {conn: None}
            else:
                found[conn] = None

    def _park(self, conn: _Conn, parked: _Parked, timeout: float) -> None:
        conn.parked = parked
        self._parked_count += 1
        kind = parked.kind
        if kind == BARRIER:
            self._barriers.setdefault(parked.keys[0], {}).setdefault(parked.extra, {})[conn] = None
        elif kind == QUEUE_POP:
            self._poppers.setdefault(parked.keys[0], {})[conn] = None
        else:
            self._watch(conn, parked)
        self._timer(timeout, conn, parked)

    def _unpark(self, conn: _Conn) -> None:
        parked, conn.parked = conn.parked, None
        if parked is None:
            return
        self._parked_count -= 1
        kind = parked.kind
        if kind == BARRIER:
            key = parked.keys[0]
            groups = self._barriers.get(key)
            if groups is not None:
                group = groups.get(parked.extra)
                if group is not None:
                    group.pop(conn, None)
                    if not group:
                        del groups[parked.extra]
                        if not groups:
                            del self._barriers[key]
            return
        if kind == QUEUE_POP:
            _forget(self._poppers, parked.keys[0], conn)
            return
        for key in parked.missing:
            _forget(self._waiters, key, conn)
        parked.missing = set()

    def _try(self, parked: _Parked) -> Optional[bytes]:
        """The reply completing ``parked``, or None while it must keep waiting."""
        table, kind = self._table, parked.kind
        if kind == GET:
            value = table.values.get(parked.keys[0])
            return None if value is None else encode_reply(OK, value)
        if kind == WAIT:
            return None if table.missing(parked.keys) else _OK_EMPTY
        if kind == MULTI_GET:
            values = table.values
            if any(k not in values for k in parked.keys):
                return None
            return encode_reply(OK, encode_list([values[k] for k in parked.keys]))
        if kind == QUEUE_POP:
            value = table.queue_pop(parked.keys[0])
            return None if value is None else encode_reply(OK, value)
        # BARRIER: the counter reached the world size
        try:
            arrived = int(table.values.get(parked.keys[0], b"0"))
        except ValueError:
            return encode_reply(ERROR, b"barrier: the barrier key was overwritten with a non-integer")
        return _OK_EMPTY if arrived >= parked.extra else None

    def _timed_out(self, parked: _Parked) -> bytes:
        """The TIMEOUT reply: the keys still missing (a barrier: its key and how many arrived)."""
        if parked.kind == BARRIER:
            missing = [parked.keys[0], self._table.values.get(parked.keys[0], b"0")]
        else:
            missing = [k for k in parked.keys if not self._table.has(k)] or parked.keys
        return encode_reply(TIMEOUT, encode_list(missing))

    def _expire(self, conn: _Conn, parked: _Parked) -> None:
        self._unpark(conn)
        self._send(conn, self._timed_out(parked))
        self._resume.append(conn)

    def _blocking(self, conn: _Conn, parked: _Parked, timeout: float) -> Optional[bytes]:
        reply = self._try(parked)
        if reply is not None:
            return reply
        if timeout <= 0:
            return self._timed_out(parked)
        self._park(conn, parked, timeout)
        return None

    # ----------------------------------------------------------------- commands
    def _set(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.values[args[0]] = args[1]
        self._changed(args[0])
        return _OK_EMPTY

    def _get(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(GET, args[1:]), timeout_arg(args[0]))

    def _wait(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(WAIT, args[1:]), timeout_arg(args[0]))

    def _multi_get(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        return self._blocking(conn, _Parked(MULTI_GET, args[1:]), timeout_arg(args[0]))

    def _add(self, conn: _Conn, args: List[bytes]) -> bytes:
        if len(args[1]) > 32:
            raise ProtocolError("bad ADD amount")
        amount = int(args[1])  # ValueError drops the connection
        try:
            value = self._table.add(args[0], amount)
        except DistStoreError as exc:
            return encode_reply(ERROR, str(exc).encode())
        self._changed(args[0])
        return encode_reply(OK, value)

    def _compare_set(self, conn: _Conn, args: List[bytes]) -> bytes:
        stored, result = self._table.compare_set(args[0], args[1], args[2])
        if stored:
            self._changed(args[0])
        return encode_reply(OK, result)

    def _check(self, conn: _Conn, args: List[bytes]) -> bytes:
        return _FALSE if self._table.missing(args) else _TRUE

    def _delete(self, conn: _Conn, args: List[bytes]) -> bytes:
        return _TRUE if self._table.delete(args[0]) else _FALSE

    def _num_keys(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, str(self._table.num_keys()).encode())

    def _ping(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, args[0] if args else b"")

    def _append(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.append(args[0], args[1])
        self._changed(args[0])
        return _OK_EMPTY

    def _multi_set(self, conn: _Conn, args: List[bytes]) -> bytes:
        if len(args) % 2:
            raise ProtocolError("MULTI_SET with an odd number of arguments")
        values = self._table.values
        for i in range(0, len(args), 2):
            values[args[i]] = args[i + 1]
        for i in range(0, len(args), 2):
            self._changed(args[i])
        return _OK_EMPTY

    def _queue_push(self, conn: _Conn, args: List[bytes]) -> bytes:
        self._table.queue_push(args[0], args[1])
        self._changed(args[0])
        return _OK_EMPTY

    def _queue_pop(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        block, timeout, key = args[0] != b"\x00", timeout_arg(args[1]), args[2]
        if not block:
            value = self._table.queue_pop(key)
            return encode_reply(EMPTY) if value is None else encode_reply(OK, value)
        return self._blocking(conn, _Parked(QUEUE_POP, [key]), timeout)

    def _queue_len(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, str(self._table.queue_len(args[0])).encode())

    def _list_keys(self, conn: _Conn, args: List[bytes]) -> bytes:
        return encode_reply(OK, encode_list([k.encode() for k in self._table.list_keys()]))

    def _barrier(self, conn: _Conn, args: List[bytes]) -> Optional[bytes]:
        timeout, key = timeout_arg(args[0]), args[1]
        if len(args[2]) > 32:
            raise ProtocolError("bad BARRIER world size")
        world_size = int(args[2])
        try:
            self._table.add(key, 1)
        except DistStoreError as exc:
            return encode_reply(ERROR, str(exc).encode())
        self._changed(key)
        return self._blocking(conn, _Parked(BARRIER, [key], world_size), timeout)


def _forget(index: Dict[bytes, _Waiters], key: bytes, conn: _Conn) -> None:
    """Take ``conn`` off ``index[key]``, dropping the entry once empty."""
    waiting = index.get(key)
    if waiting is not None:
        waiting.pop(conn, None)
        if not waiting:
            del index[key]
