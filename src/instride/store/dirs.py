"""The managed directory itself: creation with safe permissions, its file-system type, and
the checksum of a file in it."""

from __future__ import annotations

import errno
import io
import mmap
import os
import stat
from pathlib import Path

from ..errors import ConfigError
from ..record import checksum_of

_open = io.open  # the builtin, captured before instride.interception.pyopen may patch it


def file_system_type(path: str) -> str:
    """The type (``"tmpfs"``, ``"ext4"``...) of the file system holding ``path``, or ``""``.

    Read from ``/proc/self/mountinfo``: the mount point that is the longest prefix of the
    path's real path.
    """
    real = os.path.realpath(path)
    best, kind = -1, ""
    try:
        with _open("/proc/self/mountinfo", "rb") as fh:
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        point = fields[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > best:
            best, kind = len(point), right.split()[0]
    return kind


def ensure_private_dir(root: Path) -> None:
    """Create the managed directory (mode 0700) and check it is ours and not a symlink.

    Raises
    ------
    ConfigError
        The directory is a symbolic link, belongs to another user, or is writable by others
        (its group, or every user) without the sticky bit of a shared directory like
        ``/dev/shm``: they could put files under its keys' names, or take ones away.
    """
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(root)
    except OSError as exc:
        raise ConfigError("INSTRIDE_DIR", str(root), f"cannot create it: {exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError("INSTRIDE_DIR", str(root), "not a directory (or a symbolic link)")
    if st.st_uid != os.getuid():
        raise ConfigError("INSTRIDE_DIR", str(root), f"owned by uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError("INSTRIDE_DIR", str(root),
                          "writable by every user" if st.st_mode & 0o002 else
                          "writable by its group (chmod g-w it: others could put files under "
                          "its keys' names)")


def file_checksum(path: str | Path) -> str:
    """Return ``"xxh3:<hex>"`` of a file's content (memory-mapped, no copy)."""
    with _open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return checksum_of(b"")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return checksum_of(mm)


__all__ = ["ensure_private_dir", "file_checksum", "file_system_type"]


#: errors of a file system out of room: the disk is full, or the user's quota is
NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def allocate(fd: int, size: int, path: str | os.PathLike[str]) -> None:
    """Allocate the first ``size`` bytes of the file ``fd`` (``path``) before it is mapped
    writable: a store into a mapping of a sparse file on a full file system is a ``SIGBUS``,
    which kills the process; allocating says ``ENOSPC`` (or ``EDQUOT``) first. Where the file
    system cannot allocate ahead (``EOPNOTSUPP``, ``EINVAL``: musl passes them through), the
    file is only sized, as before. (On a copy-on-write file system, btrfs or ZFS, an
    allocated file can still run out of room when it is overwritten.)

    Raises
    ------
    OSError
        The file system is out of room, or another error of ``posix_fallocate``; its message
        names the file.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # (a file system without it)
            os.ftruncate(fd, size)
            return
        raise OSError(exc.errno, f"{exc.strerror} (a file of {size} bytes)", str(path)) from None
