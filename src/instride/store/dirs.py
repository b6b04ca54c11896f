"""The managed directory itself: creation with safe permissions, its file-system type, and
the checksum of a file in it."""

from __future__ import annotations

import errno
import io
import os
import re
import stat
from pathlib import Path

import xxhash

from ..errors import ConfigError, FileTypeError
from ..record import CHECKSUM_ALGORITHM

_open = io.open  # the builtin, captured before instride.interception.pyopen may patch it


def file_system_type(path: str) -> str:
    """The type (``"tmpfs"``, ``"ext4"``...) of the file system holding ``path``, or ``""``.

    Read from ``/proc/self/mountinfo``: of the mounts not hidden, the one whose mount point is
    the longest prefix of the path's real path. A mount is hidden by another mounted over it
    (the same mount point, made on it), and with the mount it was made in: a file system
    mounted over another shows its own type, never the one underneath.
    """
    real = os.path.realpath(path)
    try:
        with _open("/proc/self/mountinfo", "rb") as fh:
            lines = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    mounts: dict[str, tuple[str, str, str]] = {}  # id: (parent's id, mount point, type)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mounts[fields[0]] = (fields[1], _unescape(fields[4]), right.split()[0])
    over: dict[str, str] = {}  # a mount's id: the id of the mount made over it
    for mount, (parent, point, _fs) in mounts.items():
        if parent in mounts and mounts[parent][1] == point:
            over[parent] = mount

    def visible(mount: str) -> bool:
        # (nothing mounted over it, nor over a mount it was made in, but itself and those on
        # its way: each mount of the chain that is over its parent)
        below, seen = "", set()
        while mount in mounts and mount not in seen:
            if over.get(mount, below) != below:
                return False
            seen.add(mount)
            below, mount = mount, mounts[mount][0]
        return True

    best, kind = -1, ""
    for mount, (_parent, point, fs) in mounts.items():
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) > best \
                and visible(mount):
            best, kind = len(point), fs
    return kind


def _unescape(field: str) -> str:
    """A mount point as ``mountinfo`` writes it: space, tab, newline and backslash as octal
    escapes (``\\040``...)."""
    if "\\" not in field:
        return field
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


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


#: bytes read at a time for a checksum
_CHUNK = 1 << 20


def file_checksum(path: str | Path) -> str:
    """Return ``"xxh3:<hex>"`` of a file's content (see :func:`file_checksum_and_size`)."""
    return file_checksum_and_size(path)[0]


def file_checksum_and_size(path: str | Path) -> tuple[str, int]:
    """Return ``"xxh3:<hex>"`` of a file's content, and the number of bytes it was taken of
    (a size looked up apart could be of another moment of the file's).

    The file is read (into one reused buffer), not mapped: a file cut short by another
    process meanwhile would make a mapping's next page a ``SIGBUS``, which kills the process;
    read, it ends where the file does, and the checksum is that of what was read (readers
    check the bytes they get against it, and refuse others).

    Raises
    ------
    FileTypeError
        Not a regular file (a FIFO, whose ``open`` would wait for a writer for ever, a
        directory, a device).
    OSError
        The file cannot be opened or read (``FileNotFoundError``...).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise FileTypeError(str(path), "not a regular file",
                                errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL)
        digest = xxhash.xxh3_64()
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        size = 0
        with _open(fd, "rb", buffering=0, closefd=False) as fh:
            while got := fh.readinto(buf):
                digest.update(view[:got])
                size += got
    finally:
        os.close(fd)
    return f"{CHECKSUM_ALGORITHM}:{digest.hexdigest()}", size


__all__ = ["ensure_private_dir", "file_checksum", "file_checksum_and_size", "file_system_type"]


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
