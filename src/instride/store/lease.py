"""A read lease on a file about to be published by moving it into place (Linux ``F_SETLEASE``).

A key's bytes never change once published. A file still open for writing by another process
(a simulation still writing it) must not become one, nor a file that someone opens for writing
while it is linked or copied into place. The kernel grants a read lease (``F_RDLCK``) only
while no descriptor, and no shared writable mapping, has the file open for writing; an open for
writing while the lease is held breaks it (the writer waits until the lease is released, at
most ``/proc/sys/fs/lease-break-time``, 45 s by default) and ``F_GETLEASE`` no longer says
``F_RDLCK``. The preload library's rename into the managed directory does the same
(``csrc/core/publish.c``).

No lease where the file system has none (NFS, Lustre: ``EINVAL``), the caller neither owns the
file nor has ``CAP_LEASE`` (``EACCES``), or ``/proc/sys/fs/leases-enable`` is 0: the file is
moved unchecked then, as before leases. The same where this process itself holds it open for
writing ("write a temporary file, flush it, publish it, then close it"): its other writers, if
any, cannot be told apart from it; and where ``/proc`` cannot be read to tell.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import signal
from pathlib import Path

from ..errors import SourceBusy
from ..perthread import pid


def _self_writes(fd: int) -> bool:
    """Whether this process has the file of ``fd`` open for writing through another
    descriptor (``/proc/self/fd``; Python's own mappings keep a descriptor of their file), or
    this cannot be told (no ``/proc``: then as before leases, the file moved unchecked)."""
    st = os.fstat(fd)
    try:
        names = os.listdir("/proc/self/fd")
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return True  # (no /proc)
    except OSError:
        return False  # (out of descriptors, say: another's writer, as far as is known)
    for name in names:
        other = int(name)
        if other == fd:
            continue
        try:
            if fcntl.fcntl(other, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
                continue
            there = os.fstat(other)
        except OSError:  # (closed since, or the listing's own descriptor)
            continue
        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


class SourceLease:
    """A read lease on ``path`` (a regular file, not followed if a symbolic link), held until
    :meth:`close`.

    Raises
    ------
    SourceBusy
        Another process has the file open for writing (or a shared writable mapping of it).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        #: whether a lease is held (``False``: none could be had; see the module's notes)
        self.held = False
        self._fd = -1
        try:
            # (O_NONBLOCK: a writer's own lease on it refuses, EWOULDBLOCK, instead of a wait)
            self._fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except BlockingIOError:
            raise SourceBusy(path) from None
        except OSError:
            return  # (not readable, or gone: the caller's own steps say what)
        try:
            # A lease break is told to its holder by a signal, SIGIO by default, whose default
            # action kills the process: SIGURG instead (ignored by default; a program that
            # handles it gets one spuriously), set on this private descriptor only. The break
            # itself is read from F_GETLEASE (broken()), never from the signal.
            fcntl.fcntl(self._fd, fcntl.F_SETSIG, signal.SIGURG)
            fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            self.held = True
        except OSError as exc:
            if exc.errno == errno.EAGAIN and not _self_writes(self._fd):
                self.close()
                raise SourceBusy(path) from None
        except BaseException:
            self.close()
            raise

    def broken(self) -> bool:
        """Whether a writer opened the file since the lease was taken (its break pending, or
        the lease revoked); ``False`` where no lease is held."""
        if not self.held:
            return False
        try:
            return fcntl.fcntl(self._fd, fcntl.F_GETLEASE) != fcntl.F_RDLCK
        except OSError:
            return True

    def close(self) -> None:
        """Release the lease (a writer waiting for it goes on)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> SourceLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hidden_name(src: Path) -> Path:
    """A hidden name beside ``src``, ``.instride-moving-<pid>-<hex>.<name>`` (starting with
    ``.instride``: never a key; not a temporary file's name: ``instride gc`` never takes it,
    it is the user's file), drawn afresh."""
    return src.parent / f".instride-moving-{pid()}-{secrets.token_hex(8)}.{src.name[:200]}"


def hide_source(src: Path, hidden: Path) -> Path:
    """Rename ``src`` to ``hidden`` (:func:`hidden_name`) and return the name it has: ``src``
    itself where it cannot be renamed (its publication then goes on from its own name, as
    without a lease)."""
    try:
        os.rename(src, hidden)  # (a fresh random name: nothing there to replace)
    except OSError:
        return src
    return hidden


def put_back_source(hidden: Path | None, src: Path, exc: BaseException) -> None:
    """Name the source :func:`hide_source` may have hidden again (it is there if it was: its
    name is random), never over a file that took the name meanwhile -- then it stays hidden,
    and ``exc``, the publication's failure, says where (a note)."""
    if hidden is None or not os.path.lexists(hidden):
        return
    try:
        try:
            os.link(hidden, src)
        except FileExistsError:
            raise
        except OSError:  # (no hard links here: a rename, where the name is free)
            if os.path.lexists(src):
                raise FileExistsError(errno.EEXIST, "taken meanwhile", str(src)) from None
            os.rename(hidden, src)
            return
        os.unlink(hidden)
    except OSError as err:
        note = getattr(exc, "add_note", None)  # (Python 3.11: notes)
        if note is not None:
            note(f"{src} could not be named again ({err.strerror}): it is {hidden}")
