"""The conformance kit's control channel: a local process that connects to a World's
controller, or poses as one to a worker, gets nothing unpickled (so runs no code)
before it has proved it knows the world's token."""

from __future__ import annotations

import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tdist.testing.processes import base_env, kill_session
from tdist.testing import World

pytestmark = pytest.mark.timeout(120)


class _Plant:
    """Unpickling it creates the file ``path``: proof that a pickle was loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _frame(obj) -> bytes:
    payload = pickle.dumps(obj)
    return struct.pack(">Q", len(payload)) + payload


def _wait_for(path: Path, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.05)
    return path.read_text().strip()


def _impostor(address: str, frames: list[bytes]) -> None:
    """Connect to the controller at ``address``, send ``frames``, read until it hangs up."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            for data in frames:
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass
        except OSError:  # hung up on
            pass


def test_controller_refuses_an_impostor_before_unpickling(tmp_path):
    marker = tmp_path / "code-ran"
    address_file, go = tmp_path / "controller", tmp_path / "go"
    # The worker waits (in sitecustomize, before tdist starts) until the impostors are done,
    # so that the controller certainly reads their connections first.
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(f"""
        import os, time
        if "TDIST_TESTING_CONTROLLER" in os.environ:
            open({str(address_file)!r}, "w").write(os.environ["TDIST_TESTING_CONTROLLER"])
            deadline = time.monotonic() + 60
            while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
    """)
    )
    world = World("tcp", 1, init=False, start_timeout=90, env={"PYTHONPATH": str(tmp_path)})
    starter = threading.Thread(target=world.start, daemon=True)
    starter.start()
    try:
        address = _wait_for(address_file)
        evil = _frame(("hello", _Plant(str(marker))))
        _impostor(address, [evil])  # a pickle straight away
        _impostor(address, [b"TDKIT\x00\x00\x01" + os.urandom(32), os.urandom(32), evil])  # a wrong proof
        go.write_text("1")
        starter.join(90)
        assert world.alive, "the genuine worker was not accepted"
        assert world.run("os:getpid") == [world.pids[0]]
    finally:
        go.write_text("1")
        world.kill()
    assert not marker.exists(), "the controller unpickled an unauthenticated connection's message"


def test_worker_refuses_a_controller_that_does_not_know_the_token(tmp_path):
    marker = tmp_path / "code-ran"
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        env = base_env(
            TDIST_TESTING_CONTROLLER=f"127.0.0.1:{port}", TDIST_TESTING_TOKEN="the-secret", RANK="0", WORLD_SIZE="1"
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "tdist.testing._worker"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                # a "call" that plants the marker, padded past the handshake's reply size
                conn.sendall(_frame(("call", 1, "os:getpid", {"pad": "x" * 64, "x": _Plant(str(marker))})))
                try:
                    out, _ = proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:  # it took the call and waits for more
                    kill_session(proc.pid)
                    out, _ = proc.communicate()
        finally:
            kill_session(proc.pid)
    assert not marker.exists(), "the worker unpickled a message from an unauthenticated controller"
    assert proc.returncode == 18 and "refusing the controller" in out, (proc.returncode, out)
