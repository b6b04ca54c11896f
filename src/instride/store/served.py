"""Which files of the managed directory may leave the node or be recorded.

Only regular files are served or published: a symbolic link (as the key's last component or
as a directory on the way), a FIFO, a device or a directory under a key is refused, and so is
a file whose resolved path is outside the managed directory. Hard links are not detected.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from ..errors import KeyNotFoundError, KeyNotServed
from ..keys import key_path


def check_real(root_real: str, key: str, real: str) -> None:
    """Refuse a file whose resolved path ``real`` is not exactly ``key``'s path.

    Parameters
    ----------
    root_real
        The real path of the managed directory.

    Raises
    ------
    KeyNotServed
        The file resolves outside the directory, or is reached through a symbolic link.
    """
    if real == os.path.join(root_real, key):
        return
    if not real.startswith(root_real.rstrip(os.sep) + os.sep):
        raise KeyNotServed(key, "it resolves outside the managed directory")
    raise KeyNotServed(key, "it is reached through a symbolic link")


#: What ``flock`` says on a file system that has no such locks (the file is served unheld).
NO_FLOCK = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS})
#: Errors of the serving process, not of the file: out of descriptors or memory. Raised as they
#: are (``OSError``), for the server to answer "unavailable now", never "not found".
RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def open_served(root: Path, root_real: str, key: str) -> tuple[int, os.stat_result]:
    """Open ``key`` for sending: a regular file, no symlink, inside the managed directory.

    The file is held (a shared ``flock``, until the descriptor is closed) once its name is seen
    to still name it, as the C engine holds what it serves: a stream's producer rewrites a
    retired frame's file only under an exclusive lock, after renaming it away from its key, so
    what is sent is the frame published under ``key``. A file being rewritten, or renamed away
    since the open, is not found.

    Returns
    -------
    (int, os.stat_result)
        An open read-only descriptor (the caller closes it, which lets go of the file) and
        its status, looked at under the lock.

    Raises
    ------
    KeyNotFoundError
        No such key; :class:`~instride.errors.KeyNotServed` (with the reason) for a file that
        exists but may not be served.
    OSError
        The serving process is out of descriptors or memory (:data:`RESOURCE_ERRORS`).
    """
    path = key_path(key, root)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise KeyNotFoundError(key) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise KeyNotServed(key, "it is a symbolic link") from None
        if exc.errno in RESOURCE_ERRORS:
            raise
        raise KeyNotServed(key, os.strerror(exc.errno or errno.EIO)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyNotServed(key, "it is not a regular file")
        try:  # where the opened file really is (immune to changes after the open)
            real = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            real = os.path.realpath(path)
        try:
            check_real(root_real, key, real)
        except KeyNotServed:
            # (a frame retired since the open: its file went back to its stream's pool, which
            # is no key. Not a link: the name no longer names this file, so not found)
            try:
                renamed = os.stat(path, follow_symlinks=False).st_ino != st.st_ino
            except FileNotFoundError:
                renamed = True
            if renamed:
                raise KeyNotFoundError(key) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except (BlockingIOError, InterruptedError):
            raise KeyNotFoundError(key) from None  # (being rewritten)
        except OSError as exc:
            if exc.errno not in NO_FLOCK:
                raise KeyNotServed(key, f"it cannot be locked ({os.strerror(exc.errno or 0)})") \
                    from None
            # a file system without flock: served unheld, after the name check below
        try:
            named = os.stat(path, follow_symlinks=False)
        except OSError:
            raise KeyNotFoundError(key) from None  # (gone since the open)
        if (named.st_ino, named.st_dev) != (st.st_ino, st.st_dev):
            raise KeyNotFoundError(key)  # (another file has the name now)
    except BaseException:
        os.close(fd)
        raise
    return fd, named  # (looked at under the lock: its size and times hold from here on)


__all__ = ["NO_FLOCK", "check_real", "open_served"]
