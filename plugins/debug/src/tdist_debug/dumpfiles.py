"""Writing dumps without being turned against their owner.

A dump directory on a shared path (``/tmp/dumps``) may have been created first by
another user, who could then plant ``rank<R>.json.<pid>.tmp`` as a symbolic link and
have the job overwrite any file its owner can write. So a dump directory is used only
when it belongs to this user (or to root) and nobody else can write to it, unless it
has the sticky bit (then nobody else can remove or rename what the job writes there);
a directory that does not exist yet is created mode 0700. Every file is created new
(``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) under a random name, relative to the
directory opened once and checked, then renamed over ``rank<R>.json`` in that directory.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import stat
from typing import Any, Optional

__all__ = ["DumpDirRefused", "dump_dir_refusal", "write_json"]

_TRIES = 8


class DumpDirRefused(PermissionError):
    """The dump directory is not safe to write to (why: the message, naming it)."""


def _token() -> str:
    return secrets.token_hex(6)


def _refusal(directory: str, st: os.stat_result) -> Optional[str]:
    why = None
    if not stat.S_ISDIR(st.st_mode):
        why = "it is not a directory"
    elif st.st_uid not in (os.geteuid(), 0):
        why = (
            f"it belongs to user id {st.st_uid}, not to this user ({os.geteuid()}) or root: whoever owns it "
            "could plant links there that make a dump overwrite your files"
        )
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        why = (
            f"other users can write to it (mode {stat.S_IMODE(st.st_mode):04o}, no sticky bit): they could "
            "plant links there or replace the dumps"
        )
    if why is None:
        return None
    return (
        f"not writing flight-recorder dumps into {directory}: {why}; use a directory of your own "
        "(TDIST_DEBUG_DUMP_DIR, tdistrun --debug-dump), e.g. one this job creates"
    )


def dump_dir_refusal(directory: str) -> Optional[str]:
    """Why dumps must not be written to (or read from) ``directory``, or None when it is
    safe or does not exist yet (it will be created mode 0700)."""
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        return None
    return _refusal(os.path.abspath(directory), st)


def _open_directory(directory: str) -> int:
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    if parent:
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        why = _refusal(directory, os.fstat(fd))  # what was opened, not what was looked at
        if why is not None:
            raise DumpDirRefused(errno.EPERM, why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_json(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (mode 0600), replacing it atomically; raises
    :class:`DumpDirRefused` for a directory :func:`dump_dir_refusal` refuses."""
    directory, name = os.path.split(os.path.abspath(path))
    text = json.dumps(data).encode()
    dir_fd = _open_directory(directory)
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        for attempt in range(_TRIES):
            temporary = f"{name}.{os.getpid()}.{_token()}.tmp"
            try:
                fd = os.open(temporary, flags, 0o600, dir_fd=dir_fd)
                break
            except FileExistsError:  # planted or left over: never reused, never followed
                if attempt == _TRIES - 1:
                    raise
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text)
            os.replace(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)
