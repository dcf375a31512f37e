"""Opening the files of a ``file://`` rendezvous without being fooled by what is already there.

A path that names something other than a regular file (``/dev/null``, a FIFO, a
directory) is refused at once, and so is, in a world-writable directory such as ``/tmp``,
a symbolic link or a file another user owns: anyone can plant those there, to make the
job follow a link to a file of theirs (or of the victim's), or read and rewrite the
rendezvous. In a world-writable directory files are opened with ``O_NOFOLLOW``.
"""

from __future__ import annotations

import os
import stat

__all__ = ["check_path", "open_regular", "same_file"]


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _shared_directory(path: str) -> bool:
    """Whether the directory holding ``path`` is writable by every user."""
    parent = os.path.dirname(os.path.abspath(path)) or os.sep
    try:
        return bool(os.stat(parent).st_mode & stat.S_IWOTH)
    except OSError:
        return False


def _check_stat(path: str, st: os.stat_result, shared: bool, scheme: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(
            f"{scheme}:// rendezvous: {path} is {_kind(st.st_mode)}; the rendezvous needs a regular "
            "file it can create, lock and remove"
        )
    if shared and st.st_uid != os.geteuid():
        raise ValueError(
            f"{scheme}:// rendezvous: {path} belongs to user id {st.st_uid}, not to this user "
            f"({os.geteuid()}), in a directory anyone can write to: refusing it, anyone could have "
            "planted it (remove it, or use a path in a directory only you can write to)"
        )


def check_path(path: str, scheme: str = "file") -> None:
    """Refuse ``path`` at once when it cannot be this user's rendezvous file (see the module doc)."""
    shared = _shared_directory(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        if shared:
            raise ValueError(
                f"{scheme}:// rendezvous: {path} is a symbolic link in a directory anyone can write to "
                "(anyone could have planted it): refusing to follow it; name the file itself"
            )
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return  # a dangling link in the user's own directory: the file is created where it points
    _check_stat(path, st, shared, scheme)


def open_regular(path: str, scheme: str = "file") -> int:
    """Open (creating it, mode 0600) the regular file ``path`` after :func:`check_path`'s
    checks, without following a link in a world-writable directory; returns the descriptor."""
    check_path(path, scheme)
    shared = _shared_directory(path)
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_NOFOLLOW if shared else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        raise ValueError(f"{scheme}:// rendezvous: cannot open {path}: {exc}") from exc
    try:
        _check_stat(path, os.fstat(fd), shared, scheme)  # what was opened, not what was looked at
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not removed or replaced)."""
    try:
        st, mine = os.stat(path), os.fstat(fd)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
