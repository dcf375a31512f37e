"""Dumps cannot be turned against their owner: a dump directory another user owns, or
can write to without the sticky bit, is refused (said once, the job goes on); files are
created new (O_EXCL | O_NOFOLLOW, mode 0600) and renamed into place, so a link planted
under the temporary name is never followed."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from typing import Any
from pathlib import Path

import pytest
from tdist.testing.processes import python_job
from tdist_debug import dumpfiles
from tdist_debug.recorder import Recorder
from tdist_debug.settings import Settings

from tdist._launch import debug as launch_debug

pytestmark = pytest.mark.timeout(120)

#: The other local user (a uid with no account is enough to own files and run coreutils).
OTHER_UID = 54321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second local user")


def _as_other_user(*command: str) -> None:
    subprocess.run(command, user=OTHER_UID, group=OTHER_UID, cwd="/", check=True, timeout=30, capture_output=True)


def _secret(tmp_path: Path) -> Path:
    target = tmp_path / "secret"
    target.write_text("mine")
    target.chmod(0o600)
    return target


def test_own_new_directory_dump_is_0600_in_a_0700_directory(tmp_path):
    directory = tmp_path / "a" / "dumps"
    recorder = Recorder(Settings(10, str(directory), trace=True))
    recorder.rank = 3
    path = recorder.dump("test")
    assert path == str(directory / "rank3.json")
    assert sorted(os.listdir(directory)) == ["rank3.json", "trace-rank3.json"]  # no temporary left
    assert stat.S_IMODE(os.stat(directory / "trace-rank3.json").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert json.loads(Path(path).read_text())["reason"] == "test"


def test_directory_others_can_write_to_is_refused_once_and_nothing_is_written(tmp_path, capsys):
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    recorder = Recorder(Settings(10, str(directory)))
    assert recorder.dump("first") is None and recorder.dump("second") is None
    assert os.listdir(directory) == []
    err = capsys.readouterr().err
    assert err.count("tdist-debug: not writing flight-recorder dumps into") == 1, err
    assert f"{directory}: other users can write to it (mode 0777, no sticky bit)" in err, err
    logged: list[str] = []
    launch_debug.verdict(str(directory), logged.append)  # tdistrun does not read what others could plant
    assert logged and "other users can write to it" in logged[0], logged


def test_link_planted_under_the_temporary_name_is_not_followed(tmp_path, monkeypatch):
    directory = tmp_path / "sticky"
    directory.mkdir()
    directory.chmod(0o1777)  # like /tmp, but this user's: allowed
    target = _secret(tmp_path)
    names = iter(["planted", "fresh"])
    monkeypatch.setattr(dumpfiles, "_token", lambda: next(names))
    link = directory / f"rank0.json.{os.getpid()}.planted.tmp"
    link.symlink_to(target)
    recorder = Recorder(Settings(10, str(directory)))
    recorder.rank = 0
    assert recorder.dump("test") == str(directory / "rank0.json")
    assert target.read_text() == "mine" and stat.S_IMODE(target.stat().st_mode) == 0o600
    assert link.is_symlink()  # left alone, not followed
    assert json.loads((directory / "rank0.json").read_text())["reason"] == "test"
    assert stat.S_IMODE((directory / "rank0.json").stat().st_mode) == 0o600


def test_not_a_directory_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    assert "it is not a directory" in (dumpfiles.dump_dir_refusal(str(tmp_path / "file")) or "")
    assert dumpfiles.dump_dir_refusal(str(tmp_path / "missing")) is None


JOB = """
import os, subprocess, sys
from datetime import timedelta
import torch
import tdist as dist
dump_dir, target, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("tcp", timeout=timedelta(seconds=20))
dist.all_reduce(torch.ones(2))
# the other user plants this process's old temporary dump name (and the dump's), as links
for name in (f"rank0.json.{os.getpid()}.tmp", "rank0.json"):
    subprocess.run(["ln", "-s", target, os.path.join(dump_dir, name)], user=uid, group=uid, cwd="/", check=True,
                   timeout=30)
dist.destroy_process_group()
print("finished")
"""


def _dumping_job(tmp_path, dump_dir: str, target) -> Any:
    """One rank of JOB, dumping its flight recorder into ``dump_dir`` at exit."""
    program = tmp_path / "job.py"
    program.write_text(JOB)
    [result] = python_job(
        [str(program), dump_dir, str(target), str(OTHER_UID)],
        1,
        timeout=90,
        TDIST_DEBUG_RECORDER="10",
        TDIST_DEBUG_DUMP_DIR=dump_dir,
        TDIST_DEBUG_DUMP_AT_EXIT="1",
    )
    return result


@as_root
def test_directory_another_user_created_first_is_refused_and_the_job_finishes(tmp_path):
    shared = tempfile.mkdtemp(prefix="tdist-shared-")  # a /tmp-like directory both users can reach
    try:
        os.chmod(shared, 0o1777)
        dump_dir = os.path.join(shared, "dumps")
        _as_other_user("mkdir", "-m", "777", dump_dir)  # the other user got there first
        target = _secret(tmp_path)
        result = _dumping_job(tmp_path, dump_dir, target)
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-3000:]
        assert target.read_text() == "mine" and stat.S_IMODE(target.stat().st_mode) == 0o600
        assert (
            f"tdist-debug: not writing flight-recorder dumps into {dump_dir}: it belongs to user id {OTHER_UID}"
        ) in result.stderr, result.stderr[-3000:]
        assert all(os.path.islink(os.path.join(dump_dir, name)) for name in os.listdir(dump_dir))  # nothing written
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@as_root
def test_sticky_directory_of_this_user_with_links_planted_by_another_user(tmp_path):
    shared = tempfile.mkdtemp(prefix="tdist-shared-")
    try:
        os.chmod(shared, 0o1777)
        target = _secret(tmp_path)
        result = _dumping_job(tmp_path, shared, target)
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-3000:]
        assert target.read_text() == "mine"
        dump = os.path.join(shared, "rank0.json")
        assert not os.path.islink(dump) and json.loads(Path(dump).read_text())["reason"] == "exit"
        assert stat.S_IMODE(os.stat(dump).st_mode) == 0o600 and os.stat(dump).st_uid == os.geteuid()
    finally:
        shutil.rmtree(shared, ignore_errors=True)
