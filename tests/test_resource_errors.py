"""Running out of a resource is named in the error, not left to look like a timeout: a
job whose processes run out of file descriptors (EMFILE), and a ``file://`` rendezvous
or FileStore whose file system is full (ENOSPC) or whose file may not grow (EFBIG)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest

import tdist
from tdist._errors import DistStoreError
from tdist._store import FileStore, TCPStore
from tdist._store.tcp_store import StoreConnectionError
from tdist.testing.processes import base_env, kill_session, python_job, run_job

pytestmark = pytest.mark.timeout(180)

EMFILE_JOB = textwrap.dedent(
    """
    import resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))  # ulimit -n 16, before tdist opens anything
    from datetime import timedelta
    import torch
    import tdist as dist
    try:
        dist.init_process_group("tcp", timeout=timedelta(seconds=5))
        dist.all_reduce(torch.ones(2))
        dist.destroy_process_group()
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    print("ok")
    """
)


@pytest.mark.slow
def test_a_job_out_of_file_descriptors_says_emfile(tmp_path):
    """8 ranks with ``ulimit -n 16``: rank 0's store server cannot accept them all. The
    ranks it turns away fail at once, saying that the server ran out of descriptors;
    rank 0's own wait names EMFILE; every rank ends."""
    program = tmp_path / "job.py"
    program.write_text(EMFILE_JOB)
    results = python_job([str(program)], 8, timeout=150)
    errors = [r.stdout for r in results]
    assert all(r.returncode == 1 and "ERROR" in r.stdout for r in results), [r.output[-2000:] for r in results]
    assert "EMFILE" in errors[0] and "Too many open files" in errors[0], errors[0]
    turned_away = [e for e in errors[1:] if "ran out of file descriptors (EMFILE or ENFILE: too many open files)" in e]
    assert turned_away, errors
    assert "cannot accept connections: EMFILE" in results[0].stderr, results[0].stderr[-3000:]  # the server's warning


SERVER = textwrap.dedent(
    """
    import os, resource, sys
    from tdist._store import TCPStoreServer
    server = TCPStoreServer("127.0.0.1", 0, token="").start()
    used, limit, free = {int(fd) for fd in os.listdir("/proc/self/fd")}, 0, 0
    while free < 1:  # room for 2 connections: this one and the one listing /proc/self/fd held
        free += limit not in used
        limit += 1
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    print(server.port, flush=True)
    sys.stdin.readline()
    """
)


def test_a_store_server_out_of_descriptors_tells_the_clients_it_turns_away(tmp_path):
    """A store server that can hold 2 connections: the 3rd and 4th clients fail at once,
    saying why (not after their timeout); once a client leaves, the next one gets in."""
    program = tmp_path / "server.py"
    program.write_text(SERVER)
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base_env(),
        start_new_session=True,
    )
    stores = []
    try:
        port = int(proc.stdout.readline())
        stores = [TCPStore("127.0.0.1", port, timeout=30) for _ in range(2)]
        for _ in range(2):
            with pytest.raises(StoreConnectionError, match=r"the server ran out of file descriptors \(EMFILE"):
                TCPStore("127.0.0.1", port, timeout=30)  # (a timeout would take 30 s)
        stores.pop().close()
        stores.append(TCPStore("127.0.0.1", port, timeout=30))
        stores[0].set("k", "v")
        assert stores[1].get("k") == b"v"
    finally:
        for store in stores:
            store.close()
        try:
            _, err = proc.communicate("\n", timeout=30)
        finally:
            kill_session(proc.pid)
    assert "cannot accept connections: EMFILE (Too many open files)" in err, err


FULL_DISK_JOB = textwrap.dedent(
    """
    import signal, resource, sys
    from datetime import timedelta
    import tdist
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit, writes fail with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
    try:
        tdist.init_process_group("tcp", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                                 timeout=timedelta(seconds=10))
    except Exception as exc:
        print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
        sys.exit(1)
    """
)


def test_a_file_rendezvous_that_cannot_grow_names_the_path_and_efbig(tmp_path):
    """RLIMIT_FSIZE (in a child process) stands in for a full disk anywhere: EFBIG, named with the path."""
    program = tmp_path / "job.py"
    program.write_text(FULL_DISK_JOB)
    path = tmp_path / "rendezvous"
    [result] = run_job([[sys.executable, str(program), str(path)]], [base_env()], timeout=60)
    assert result.returncode == 1, result.output[-3000:]
    assert f"FileStore {path}: cannot write to the store file: EFBIG (File too large)" in result.stdout, result.stdout
    assert "file size limit (ulimit -f)" in result.stdout, result.stdout


@pytest.fixture
def full_tmpfs():
    """A 64 KiB tmpfs, filled up; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount a small tmpfs")
    where = tempfile.mkdtemp(prefix="tdist-full-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", where], capture_output=True, text=True, timeout=30
    )
    if mounted.returncode != 0:
        os.rmdir(where)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        fd = os.open(os.path.join(where, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, bytes(4096)):
                pass
        except OSError:  # ENOSPC: full
            pass
        finally:
            os.close(fd)
        yield Path(where)
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
        os.rmdir(where)


def test_a_full_file_system_names_the_path_and_enospc(full_tmpfs):
    path = full_tmpfs / "store"
    with pytest.raises(DistStoreError, match=rf"FileStore {path}: cannot write to the store file: ENOSPC .*full"):
        FileStore(path, timeout=timedelta(seconds=5))
    for url in (f"file://{full_tmpfs}/rendezvous", f"file://{full_tmpfs}/shared?world_size=1#job"):
        with pytest.raises(DistStoreError, match=rf"{full_tmpfs}/\w+: cannot write to the store file: ENOSPC"):
            tdist.init_process_group("tcp", init_method=url, rank=0, world_size=1, timeout=timedelta(seconds=5))
        assert not tdist.is_initialized()
