"""A World's controller authenticates its connections concurrently: local connections
that say nothing (any local process can open them, before the workers do) cost no
worker its place, although each alone may stay silent for the whole handshake timeout."""

from __future__ import annotations

import socket
from typing import Any, Optional

import pytest

from tdist.testing import World

pytestmark = pytest.mark.timeout(120)


class _SilentFirst(World):
    """A World into whose listener three silent connections are made before any worker starts."""

    silent: list[socket.socket]

    def _env_for(self, rank: Optional[int], token: str) -> dict[str, Any]:
        if not getattr(self, "silent", None):
            address = self._listener.getsockname()  # type: ignore[union-attr]
            self.silent = [socket.create_connection(address, timeout=5) for _ in range(3)]
        return super()._env_for(rank, token)


@pytest.mark.slow
def test_silent_connections_made_first_do_not_hold_up_the_workers():
    world = _SilentFirst("tcp", 2, init=False, restartable=False, start_timeout=60)
    try:
        world.start()  # 3 silent connections x 10 s each, one at a time, would outlast the workers' 10 s
        assert sorted(world.pids) == [0, 1]
        assert world.run("os:getpid") == [world.pids[0], world.pids[1]]
        for sock in world.silent:  # the controller cut them off at its handshake deadline, or still waits
            sock.settimeout(15)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in getattr(world, "silent", ()):
            sock.close()
        world.kill()
