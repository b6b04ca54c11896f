"""Confinement: a key's file must be a regular file reached without leaving the managed directory.

Key validation (:mod:`instride.keys`) is lexical: it refuses ``..``, absolute paths outside the
managed directory, NUL and the like before anything touches the file system. What the file
system itself holds can still lead elsewhere: a symbolic link planted inside the managed
directory (``s/link -> /elsewhere``) would carry a write to ``s/link/evil.bin`` outside it, and
a key that names a directory, a FIFO or a device is no file to publish or consume. The
functions here check the path of an already-normalized key on the file system and refuse
every such case with a typed error:

* :class:`~instride.errors.UnsafePathError` (a :class:`PermissionError`, errno ``ELOOP``) for
  a symbolic link anywhere on the way, the key's last component included, or a file that
  resolves outside the managed directory;
* :class:`~instride.errors.FileTypeError` (an :class:`OSError`; errno ``EISDIR`` for a
  directory, ``ENOTDIR`` for a file where a directory is needed, ``EINVAL`` for a special
  file) for anything that is not a regular file.

The check walks the key's components with ``lstat`` (no symbolic link is ever followed), so a
key of depth *d* costs *d* system calls. Readers that open the file use :func:`open_confined`,
which checks the *opened* descriptor (``O_NOFOLLOW``, ``fstat``, its ``/proc/self/fd`` name)
and so is immune to a path being swapped between check and open. Writers check before they
create their temporary file; the managed directory is private (mode 0700, owned by the user),
so only the user's own processes could swap a directory for a link in between.

>>> from pathlib import Path
>>> import tempfile
>>> root = Path(tempfile.mkdtemp())
>>> confined_path(root, "run7/frame_1.isf", for_write=True) == root / "run7/frame_1.isf"
True
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import stat
import threading
from pathlib import Path

from .errors import FileTypeError, UnsafePathError

__all__ = ["ConfinedOpener", "check_confined", "check_parents", "confined_file", "confined_path",
           "managed_key_of", "open_confined"]


def kind_of(mode: int) -> str:
    """What a file of ``st_mode`` ``mode`` is, in words ("a directory", "a FIFO", ...)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def check_parents(root: str | os.PathLike[str], key: str) -> None:
    """Check the directories on the way to ``key``: real directories, no symbolic links.

    Missing directories are fine (a writer creates them, a reader waits for them).

    Raises
    ------
    UnsafePathError
        A directory on the way is a symbolic link.
    FileTypeError
        A component on the way is a file, not a directory (``ENOTDIR``).
    """
    head = os.fspath(root)
    parts = key.split("/")
    for i, comp in enumerate(parts[:-1]):
        head = f"{head}/{comp}"
        try:
            st = os.lstat(head)
        except (FileNotFoundError, NotADirectoryError):
            return  # nothing deeper exists either
        if stat.S_ISDIR(st.st_mode):
            continue
        sub = "/".join(parts[: i + 1])
        if stat.S_ISLNK(st.st_mode):
            raise UnsafePathError(key, f"{sub!r} is a symbolic link; keys never follow links")
        raise FileTypeError(key, f"{sub!r} is {kind_of(st.st_mode)}, not a directory", errno.ENOTDIR)


def confined_path(root: str | os.PathLike[str], key: str, *, for_write: bool) -> Path:
    """Return the path of ``key`` under ``root`` after checking it stays confined there.

    Parameters
    ----------
    root
        The managed directory.
    key
        A normalized key (see :func:`instride.keys.normalize_key`).
    for_write
        ``True`` for a producer (the file may exist or not; an existing one must be a regular
        file), ``False`` for a consumer (the same checks; a missing file is fine, the caller
        waits for it).

    Returns
    -------
    pathlib.Path
        ``root / key``.

    Raises
    ------
    UnsafePathError
        A symbolic link on the way or as the key's own name.
    FileTypeError
        The key names a directory, a FIFO, a socket or a device, or a file stands where a
        directory is needed.
    """
    return Path(check_confined(root, key, for_write=for_write))


def check_confined(root: str | os.PathLike[str], key: str, *, for_write: bool) -> str:
    """:func:`confined_path` as a string (the hot path of every read builds no ``Path``).

    Same checks, same errors; returns ``f"{root}/{key}"``.
    """
    return confined_file(root, key, for_write=for_write)[0]


def confined_file(root: str | os.PathLike[str], key: str, *, for_write: bool) -> tuple[str, bool]:
    """:func:`check_confined`, and whether the key's file is there: ``(path, exists)``.

    Same checks, same errors (a missing file is fine: ``exists`` is ``False``).
    """
    check_parents(root, key)
    path = f"{os.fspath(root)}/{key}"
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return path, False
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return path, True
    if stat.S_ISLNK(mode):
        raise UnsafePathError(key, "it is a symbolic link; keys never follow links")
    what = "written" if for_write else "consumed"
    code = errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL
    raise FileTypeError(key, f"it is {kind_of(mode)}; only regular files are {what}", code)


def open_confined(root_real: str, key: str, path: str | os.PathLike[str]) -> int:
    """Open the published file of ``key`` for reading; return a descriptor, checked after opening.

    Parameters
    ----------
    root_real
        The managed directory with every symbolic link resolved (``os.path.realpath``).
    key
        The normalized key.
    path
        Its path (``root / key``).

    Raises
    ------
    FileNotFoundError
        Nothing is published under the key (yet).
    UnsafePathError
        The key's name is a symbolic link, or the file is reached through one (its real path is
        not ``root_real / key``).
    FileTypeError
        The key names a directory or a special file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except NotADirectoryError:
        check_parents(root_real, key)  # a file where a directory is needed: say which
        raise FileNotFoundError(errno.ENOENT, "no such file", os.fspath(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafePathError(key, "it is a symbolic link; keys never follow links") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            code = errno.EISDIR if stat.S_ISDIR(st.st_mode) else errno.EINVAL
            raise FileTypeError(key, f"it is {kind_of(st.st_mode)}; only regular files are consumed",
                                code)
        real = os.readlink(f"/proc/self/fd/{fd}")
        if real != f"{root_real}/{key}" and real.removesuffix(" (deleted)") != f"{root_real}/{key}":
            if real.startswith(root_real.rstrip("/") + "/"):
                raise UnsafePathError(key, "it is reached through a symbolic link")
            raise UnsafePathError(key, "it resolves outside the managed directory")
    except BaseException:
        os.close(fd)
        raise
    # O_NONBLOCK only kept a FIFO from blocking the open; it has no effect on a regular file.
    return fd


def _hold(fd: int, key: str, path: str, dirfd: int | None) -> None:
    """Hold the file open as ``fd`` (shared ``flock``) and check it is still the one published
    under ``key`` (its ``path``, or ``key`` beneath ``dirfd``); else close ``fd`` and raise
    :class:`FileNotFoundError` (retired, or being rewritten for a later frame)."""
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # a bounded stream's producer rewrites it: retired
            raise FileNotFoundError(errno.ENOENT, "retired (its storage is being reused)",
                                    path) from None
        except OSError:  # no flock on this file system: nothing to hold (nor to recycle by it)
            return
        st = os.fstat(fd)
        try:
            now = os.stat(key if dirfd is not None else path, dir_fd=dirfd, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is None or (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
            raise FileNotFoundError(errno.ENOENT, "retired before it was held", path)
    except BaseException:
        os.close(fd)
        raise


def managed_key_of(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> str | None:
    """The key a file written at ``path`` would land under, or ``None`` outside ``root``.

    A path lexically under ``root`` is a key: it is validated and confined (no symbolic link
    on the way). A path that only *looks* outside but reaches ``root`` through symbolic links
    (``/scratch/link-to-managed/x``) is recognized as inside too. Tools that write files under
    the managed directory by other means (exports, archives) use it to publish them atomically
    with :meth:`instride.Client.publish` instead of writing in place.

    Raises
    ------
    KeyValidationError
        ``path`` is inside ``root`` but no valid key (a reserved name, a trailing ``/``...).
    UnsafePathError, FileTypeError
        See :func:`confined_path`.
    """
    from .keys import normalize_key

    raw = os.fspath(path)
    full = os.path.abspath(raw) + ("/" if raw.endswith("/") else "")
    root_s = os.path.normpath(os.path.abspath(root))
    if not full.startswith(root_s.rstrip("/") + "/"):
        root_s = os.path.realpath(root_s)
        parent = os.path.realpath(os.path.dirname(full.rstrip("/")))
        full = f"{parent.rstrip('/')}/{os.path.basename(full.rstrip('/'))}"
        if not full.startswith(root_s.rstrip("/") + "/"):
            return None
    key = normalize_key(full, Path(root_s))
    confined_path(root_s, key, for_write=True)
    return key


# ---------------------------------------------------------------------- openat2 fast path
class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_SYS_OPENAT2 = 437  # the same number on every architecture (added after the syscall table merge)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08


def _load_syscall():  # type: ignore[no-untyped-def]
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


#: directory descriptors an opener keeps after it let go of them, for callers of
#: ConfinedOpener.dirfd that do not say when they are done (see ConfinedOpener.close)
_RETIRED_KEPT = 4


class ConfinedOpener:
    """Open keys for reading beneath one managed directory, refusing every symbolic link.

    Where the kernel has ``openat2`` (Linux 5.6+), one system call opens the key relative to a
    descriptor of the directory with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``: the kernel itself
    refuses a link anywhere on the way and any escape, race-free, at the cost of a plain open.
    Elsewhere (older kernels, seccomp filters) it falls back to :func:`open_confined`. Either
    way the opened descriptor must be a regular file.

    Parameters
    ----------
    root
        The managed directory.
    """

    _syscall = _load_syscall()
    _how = _OpenHow(os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, 0,
                    _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.fspath(root)
        self.root_real = os.path.realpath(self.root)
        self._dirfd = -1
        self._pid = 0
        #: descriptors let go of by close(), closed later (see there)
        self._retired: list[int] = []
        #: one entry per use of a directory descriptor under way (an open, or a caller's
        #: between acquire_dirfd and release_dirfd): none of the retired ones is closed
        #: meanwhile. (A list: append and pop are atomic, no lock on the path of every read.)
        self._users: list[None] = []
        #: held while the directory's descriptor is replaced or let go of (never by a read
        #: that finds it open): threads that found it stale at once each opened one, and
        #: all but the last were lost; made again in a forked child (see _guard)
        self._lock = threading.Lock()
        self._lock_pid = os.getpid()

    def _guard(self) -> threading.Lock:
        """This process's lock (a forked child's own: the parent's may have been held by
        another thread at the fork, for good in the child)."""
        pid = os.getpid()
        if self._lock_pid != pid:
            self._lock, self._lock_pid = threading.Lock(), pid
        return self._lock

    def close(self) -> None:
        """Let go of the directory descriptor (reopened on the next :meth:`open`).

        It is closed later — with the opener, or once more than a few are let go of and no
        thread uses any of them — not now: another thread may be in an ``openat2`` beneath
        it at this moment, which would fail with an untyped ``EBADF``, or, its number taken
        by another file meanwhile, resolve the key beneath another directory."""
        self._let_go(self._dirfd)

    def acquire_dirfd(self) -> int:
        """:meth:`dirfd`, kept open until the matching :meth:`release_dirfd`.

        For a caller that uses the descriptor itself (a native call that opens keys beneath
        it): while it does, the managed directory may be made again and the descriptor let
        go of by another thread; it is not closed before every such use is released (a
        closed one's number, taken by another file, would resolve keys beneath another
        directory). Always paired, in a ``try``/``finally``.

        Returns
        -------
        int
            The descriptor; -1 where the kernel has no ``openat2`` (as :meth:`dirfd`; to be
            released all the same).
        """
        users = self._users
        users.append(None)  # (first: a descriptor found after it is not closed under it)
        try:
            fd = self.dirfd()
        except BaseException:
            users.pop()
            raise
        if users is not self._users:  # (a forked child's first use: its own list now)
            users.pop()
            self._users.append(None)
        return fd

    def release_dirfd(self) -> None:
        """End a use begun with :meth:`acquire_dirfd`."""
        users = self._users
        users.pop()
        if len(self._retired) > _RETIRED_KEPT and not users:
            self._reap()

    def _reap(self) -> None:
        """Close the retired descriptors beyond the few kept, if no thread uses any now."""
        with self._guard():
            if self._users or self._pid != os.getpid():
                return
            while len(self._retired) > _RETIRED_KEPT:
                with contextlib.suppress(OSError):
                    os.close(self._retired.pop(0))

    def _let_go(self, fd: int) -> None:
        """:meth:`close`, where ``fd`` is still the descriptor kept (not one another thread
        opened since it was found stale)."""
        with self._guard():
            if fd < 0 or fd != self._dirfd:
                return
            if self._pid == os.getpid():
                self._retired.append(fd)
            self._dirfd = -1
        if len(self._retired) > _RETIRED_KEPT and not self._users:
            self._reap()  # (else the last use under way closes them, see release_dirfd)

    def __del__(self) -> None:
        try:
            self.close()
            if self._pid == os.getpid():
                for fd in self._retired:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._retired = []
        except OSError:  # pragma: no cover - interpreter shutdown
            pass

    def dirfd(self) -> int:
        """The managed directory's descriptor keys are opened beneath with ``openat2``
        (opened on first use in each process), or -1 where the kernel has no ``openat2``."""
        if ConfinedOpener._syscall is None:
            return -1
        fd = self._dirfd  # (read once: another thread may let go of it meanwhile)
        if fd >= 0 and self._pid == os.getpid():
            return fd
        with self._guard():  # (one thread opens it; the others take that one)
            pid = os.getpid()
            if self._pid not in (0, pid):  # (a forked child: the parent's are not its to
                self._retired, self._users = [], []  # close, nor its threads in flight here)
            if self._pid != pid or self._dirfd < 0:
                self._dirfd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                self._pid = pid
            return self._dirfd

    def open(self, key: str, *, hold: bool = False) -> int:
        """Open the normalized ``key``; see :func:`open_confined` for the errors.

        ``hold``: also hold the file as a stream's reader does (a shared ``flock`` on the
        descriptor, for as long as it or a mapping made through it lives), checked to be
        still the file published under ``key`` once held. A bounded stream rewrites a
        retired frame's file only when it can lock it exclusively (see
        :mod:`instride.store.ring`), so a held file never changes under its reader.
        :class:`FileNotFoundError` when the key's file was retired before it was held.
        """
        users = self._users  # (this one: a forked child's first open starts its own)
        users.append(None)  # (the directory's descriptor is used until the end: see close)
        try:
            fd, dirfd = self._open(key)
            if hold:
                _hold(fd, key, f"{self.root}/{key}", dirfd if dirfd >= 0 else None)
            return fd
        finally:
            users.pop()
            if len(self._retired) > _RETIRED_KEPT and not users:
                self._reap()  # (the last use of retired descriptors closes them)

    def _stale(self, dirfd: int) -> bool:
        """Whether the directory descriptor ``dirfd`` kept names another directory than
        :attr:`root` now (the managed directory removed and made again by the user: a read
        beneath the removed one finds nothing); it is let go of then, to be opened afresh."""
        try:
            held, now = os.fstat(dirfd), os.stat(self.root)
        except OSError:
            return False
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino) and held.st_nlink:
            return False
        self._let_go(dirfd)
        return True

    def _open(self, key: str) -> tuple[int, int]:
        """The key's descriptor, and the directory's it was opened beneath (-1: none)."""
        syscall = ConfinedOpener._syscall
        if syscall is None:
            return open_confined(self.root_real, key, f"{self.root}/{key}"), -1
        dirfd = self.dirfd()
        how = ConfinedOpener._how
        name = os.fsencode(key)
        fd = syscall(_SYS_OPENAT2, dirfd, name, ctypes.byref(how), ctypes.sizeof(how))
        # A signal while it ran (a timer's, SIGCHLD, a profiler's; an open on a slow or FUSE
        # file system): called again, as os.open does (PEP 475), once the handlers ran
        # (between the bytecodes here: one that raises ends the read with its error).
        while fd < 0 and ctypes.get_errno() == errno.EINTR:
            fd = syscall(_SYS_OPENAT2, dirfd, name, ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0 and ctypes.get_errno() in (errno.ENOENT, errno.ENOTDIR) \
                and self._stale(dirfd):
            dirfd = self.dirfd()  # (once more, beneath the directory there now)
            fd = syscall(_SYS_OPENAT2, dirfd, name, ctypes.byref(how), ctypes.sizeof(how))
            while fd < 0 and ctypes.get_errno() == errno.EINTR:
                fd = syscall(_SYS_OPENAT2, dirfd, name, ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG, errno.EINVAL):
                ConfinedOpener._syscall = None  # unsupported or filtered: the portable checks
                return open_confined(self.root_real, key, f"{self.root}/{key}"), -1
            if err in (errno.ELOOP, errno.EXDEV):
                check_parents(self.root, key)  # names the linked directory, if that is it
                raise UnsafePathError(key, "it is a symbolic link; keys never follow links"
                                      if err == errno.ELOOP else "it resolves outside the "
                                      "managed directory")
            if err == errno.ENOTDIR:
                check_parents(self.root, key)
            raise FileNotFoundError(err, os.strerror(err), f"{self.root}/{key}") if (
                err in (errno.ENOENT, errno.ENOTDIR)) else OSError(err, os.strerror(err),
                                                                   f"{self.root}/{key}")
        try:
            mode = os.fstat(fd).st_mode
        except BaseException:
            os.close(fd)
            raise
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise FileTypeError(key, f"it is {kind_of(mode)}; only regular files are consumed",
                                errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL)
        return fd, dirfd
