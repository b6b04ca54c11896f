"""Atomic publication on node-local storage.

Publishing a file is making it appear under its key in one step: it is written under a
hidden temporary name in the key's directory, optionally fsynced, then given its final name
with ``link`` + ``unlink`` (write-once; ``renameat2(RENAME_NOREPLACE)`` where the file system
has no hard links) or ``rename`` (overwrite). A reader therefore sees either nothing or the
whole file. The writer file objects here publish themselves on ``close`` and discard themselves
on any failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import io
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from ..errors import KeyExistsError, UnsupportedModeError
from ..keys import tmp_name
from ..record import CHECKSUM_ALGORITHM


def _load_renameat2():  # type: ignore[no-untyped-def]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _rename_noreplace(tmp: str | Path, final: str | Path) -> bool:
    """One-syscall write-once rename; False when the file system does not support it."""
    global _RENAMEAT2
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(tmp), _AT_FDCWD, os.fsencode(final), _RENAME_NOREPLACE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        _RENAMEAT2 = None  # not supported here: use link + unlink from now on
        return False
    raise OSError(err, os.strerror(err), str(final))


def publish_file(tmp: str | Path, final: str | Path, key: str, *, overwrite: bool,
                 keep_tmp: bool = False) -> bool:
    """Atomically give the complete file ``tmp`` its final name ``final``.

    Write-once (``overwrite=False``) makes a hard link ``final`` of ``tmp`` and then removes
    ``tmp`` (as the preload library does), or uses ``renameat2(RENAME_NOREPLACE)`` where the
    file system has no hard links: either way an existing key is detected atomically and never
    replaced. ``overwrite=True`` uses ``rename``.

    Link and unlink first: ``renameat2`` is called through :mod:`ctypes`, whose call cost
    ~46 µs right after the producer was idle (12 µs warm) against ~26 µs for both system
    calls; publish → remote wake-up came out lower in 9 of 10 alternating rounds (by 6–77 µs).
    A ``link`` that reports the key as existing while it names ``tmp``'s own file (NFS: a call
    the client retried after the server made the link) is the publication, not a conflict.

    ``keep_tmp``: a write-once publication by ``link`` leaves ``tmp``'s name for the caller to
    remove (:func:`drop_name`) once it has announced the key: the name is hidden, and its
    ``unlink`` then costs the announcement nothing (~6–8 µs right after the producer was idle).

    The directory of ``final`` is created again if it is missing: a consumer's failed wait
    removes the empty directory it created to watch, possibly just after the producer checked
    it (both sides only ever create it or remove it while empty, so retrying converges).

    Returns
    -------
    bool
        Whether ``tmp``'s name is left for the caller to remove (only with ``keep_tmp``).

    Raises
    ------
    KeyExistsError
        If ``final`` exists and ``overwrite`` is false; ``tmp`` is removed.
    UnsupportedModeError
        If ``overwrite`` is false and the file system has neither hard links nor
        ``renameat2(RENAME_NOREPLACE)`` (nothing else makes a name without replacing one in a
        single step); ``tmp`` is removed.
    """
    for attempt in range(5):
        try:
            return _publish_once(tmp, final, key, overwrite=overwrite, keep_tmp=keep_tmp)
        except FileNotFoundError:
            if attempt == 4 or not os.path.exists(tmp):  # the temporary file itself is gone
                raise
            os.makedirs(os.path.dirname(final), exist_ok=True)


#: tries of a writer's lock that a collector's look holds off (it holds its exclusive probe
#: for microseconds), a millisecond apart, for a second at most (as the C side's): the lock is
#: taken, or the file system has none
_MARK_TRIES = 1000


def mark_writing(fd: int) -> None:
    """Lock (shared) a temporary file being written: :func:`~instride.store.collect_garbage`
    leaves a locked one alone — its writer runs, whatever its process id says in another PID
    namespace. Shared, so that a reader's lease on the published file never conflicts.

    A collector's look at the file (an exclusive lock for a moment, see
    :func:`~instride.store.gc.being_written`) at that very moment refuses it: tried again, so
    that the file does not stay unlocked for good (a later collector in another PID namespace
    would remove a live writer's file)."""
    for _ in range(_MARK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.001)
        except OSError:
            return  # (a file system without flock: its writer's process id decides)


def _held_open(fd: int) -> int:
    """A second descriptor of ``fd``'s open file (its lock with it), or -1 if none can be had."""
    try:
        return os.dup(fd)
    except OSError:
        return -1


#: whether this file system makes hard links (else ``renameat2`` from the first refusal on)
_LINKS = [True]


def _link(tmp: str | Path, final: str | Path) -> bool:
    """``os.link(tmp, final)`` where the file system makes hard links: whether it made one
    (``False``: none here, or ``tmp`` has as many links as it may have — a rename without
    replacing then); a name there raises ``FileExistsError``."""
    if not _LINKS[0]:
        return False
    try:
        os.link(tmp, final)
    except OSError as exc:
        if exc.errno not in _NO_LINKS + (errno.EMLINK,):
            raise
        if exc.errno != errno.EMLINK:  # (EMLINK: that one file's links, not the system)
            _LINKS[0] = False
        return False
    return True


def _publish_once(tmp: str | Path, final: str | Path, key: str, *, overwrite: bool,
                  keep_tmp: bool) -> bool:
    if overwrite:
        os.rename(tmp, final)
        return False
    try:
        if _link(tmp, final):
            if keep_tmp:
                return True
            drop_name(tmp)
            return False
        if _rename_noreplace(tmp, final):
            return False
        try:  # (links refused before, maybe on another file system: this one may make them)
            os.link(tmp, final)
        except OSError as exc:
            if exc.errno not in _NO_LINKS:
                raise
            raise _neither(tmp, final, key) from exc
    except FileExistsError:
        if _same_file(tmp, final):  # (NFS: a link retried by the client after it was made)
            drop_name(tmp)
            return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise KeyExistsError(key) from None
    drop_name(tmp)
    return False


#: what ``link`` answers on a file system that makes no hard links
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS)


def name_if_free(tmp: str | Path, final: str | Path) -> bool:
    """Give the file ``tmp`` the name ``final`` unless a file has that name, in one step.

    For a name that another process may take at any moment without a lock in common (a
    fetched copy's key, which a publication of this node renames its original to): a test
    of the name before a ``rename`` would leave a moment in which the rename replaces that
    file. A hard link, or ``renameat2(RENAME_NOREPLACE)`` where the file system makes none,
    never replaces one; where it has neither, ``rename`` (nothing better exists there).

    Returns
    -------
    bool
        Whether ``final`` names ``tmp``'s file now (``tmp``'s name is gone then; else it
        stays, for the caller to remove).
    """
    try:
        if _link(tmp, final):
            drop_name(tmp)
            return True
        if _rename_noreplace(tmp, final):
            return True
    except FileExistsError:
        if not _same_file(tmp, final):  # (NFS: a link retried by the client after it was made)
            return False
        drop_name(tmp)
        return True
    os.rename(tmp, final)
    return True


def _neither(tmp: str | Path, final: str | Path, key: str) -> UnsupportedModeError:
    """The error of a write-once publication where the file system has neither hard links nor
    ``renameat2(RENAME_NOREPLACE)`` (nothing else makes a name without possibly replacing one);
    ``tmp`` is removed."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    where = os.path.dirname(os.path.abspath(final))
    err = UnsupportedModeError(
        "write-once", f"key {key!r} cannot be published without the risk of replacing another"
        f" writer's file: the file system of {where!r} makes no hard links and has no"
        " renameat2(RENAME_NOREPLACE); only a publication that may replace works there"
        " (overwrite=True), or put the managed directory on a file system with either")
    err.errno = errno.EOPNOTSUPP  # (what a C caller sees, as the C library's own refusal)
    return err


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one file (``False`` if either is gone)."""
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False


def drop_name(tmp: str | Path) -> None:
    """Remove the temporary name of a file now linked under its key. The publication is done
    whatever happens here (the key names the whole file): a failure leaves a temporary name
    behind, which ``instride gc`` removes once its writer is gone."""
    with contextlib.suppress(OSError):
        os.unlink(tmp)


def fsync_dir(directory: str | Path) -> None:
    """fsync a directory, making a rename in it durable (errors ignored: best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: called after a publication with the key and the final path; a writer opened with
#: ``checksum=True`` also passes the record checksum (``"xxh3:<hex>"``) and size of the content
#: it computed while writing (``None``, ``None`` if it could not: it seeked or truncated)
PublishHook = Callable[..., None]


class _PublishingFileIO(io.FileIO):
    """A raw file on a temporary name that publishes itself under its key when closed.

    Only the process that opened it publishes or discards it: a child forked meanwhile holds
    a copy of this object, and its close (or its exit) only closes its inherited descriptor,
    never the parent's unfinished file.
    """

    def __init__(
        self,
        final: str,
        key: str,
        *,
        readable: bool,
        overwrite: bool,
        fsync: bool,
        on_publish: PublishHook | None,
        checksum: bool = False,
        close_after: bool = False,
    ) -> None:
        if not overwrite and os.path.exists(final):
            raise KeyExistsError(key)
        self._tmp = tmp_name(final)
        self._final = final
        self._key = key
        self._overwrite = overwrite
        self._fsync = fsync
        self._on_publish = on_publish
        self._close_after = close_after and not fsync
        self._aborted = False
        self._failed: BaseException | None = None
        self._pid = os.getpid()  # (the owner: see foreign())
        # The content is hashed as it is written (while still in the CPU cache), so that
        # recording it needs no second pass over the file; any seek or truncate drops it.
        self._hasher: Any = xxhash.xxh3_64() if checksum else None
        self._checksum = checksum
        self._size = 0
        for attempt in range(5):
            try:
                super().__init__(self._tmp, "x+" if readable else "x")
                break
            except FileNotFoundError:  # first file of its directory (or a failed wait's
                if attempt == 4:      # cleanup removed the empty directory meanwhile)
                    raise
                os.makedirs(os.path.dirname(final), exist_ok=True)
        mark_writing(self.fileno())

    @property
    def key(self) -> str:
        """The key this file is published under on close."""
        return self._key

    def write(self, b: Any) -> int | None:  # type: ignore[override]
        try:
            n = super().write(b)
        except BaseException as exc:
            self._failed = exc  # a lost write must never be published as a complete file
            raise
        if self._hasher is not None and n:
            try:
                view = memoryview(b)
                if view.ndim != 1 or view.itemsize != 1:
                    view = view.cast("B")
                self._hasher.update(view[:n])
                self._size += n
            except (TypeError, ValueError):
                self._hasher = None  # an exotic buffer: hash the file at publication instead
        return n

    def seek(self, pos: int, whence: int = 0) -> int:  # type: ignore[override]
        if not (pos == 0 and whence == os.SEEK_CUR):  # a tell() keeps the running hash
            self._hasher = None
        return super().seek(pos, whence)

    def truncate(self, size: int | None = None) -> int:  # type: ignore[override]
        self._hasher = None
        return super().truncate(size)

    def _digest(self) -> tuple[str | None, int | None]:
        if self._hasher is None:
            return None, None
        return f"{CHECKSUM_ALGORITHM}:{self._hasher.hexdigest()}", self._size

    def foreign(self) -> bool:
        """Whether this is a forked child's copy of the writer (its file is the parent's)."""
        return os.getpid() != getattr(self, "_pid", None)

    def __exit__(self, exc_type, exc, tb):  # type: ignore[no-untyped-def]
        # (io.FileIO's would close, so publish, the half-written file of a failed block)
        if exc_type is not None:
            self._aborted = True
        self.close()

    def abort(self) -> None:
        """Close without publishing and remove the temporary file."""
        self._aborted = True
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        if self.foreign():  # the parent still writes the file: publish nothing, remove nothing
            super().close()
            return
        if self._failed is not None and not self._aborted:
            self._aborted = True
            self.close()
            raise OSError(errno.EIO, f"key {self._key!r} not published: a write failed "
                          f"({self._failed})", str(self._final))
        if self._aborted:
            super().close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            return
        try:
            if self._fsync:
                os.fsync(self.fileno())
        except BaseException:
            super().close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            raise
        # The writer's lock (mark_writing) lives as long as a descriptor of the file does:
        # one held across the rename keeps `instride gc` off the file until it has its name.
        # The temporary name (a link publishes the file under a second name) and that
        # descriptor go after the announcement: neither is visible, and their system calls
        # no longer delay it. The file's own descriptor is closed first where a close may
        # report a failed write (NFS flushes then: never publish what it refuses), its copy
        # held; where it cannot (``close_after``: tmpfs), it is the one held, closed after
        # the announcement (a dup and a close fewer before it: ~10–20 µs of a producer that
        # was idle).
        held, kept = -1, False
        try:
            if not self._close_after:
                held = _held_open(self.fileno())
                super().close()
            kept = publish_file(self._tmp, self._final, self._key, overwrite=self._overwrite,
                                keep_tmp=True)
            if self._fsync:  # the new name survives a crash too (and the temporary one does not)
                if kept:
                    drop_name(self._tmp)
                    kept = False
                fsync_dir(os.path.dirname(self._final))
            if self._on_publish is not None:
                if self._checksum:
                    self._on_publish(self._key, self._final, *self._digest())
                else:
                    self._on_publish(self._key, self._final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            raise
        finally:
            if kept:
                drop_name(self._tmp)
            if held >= 0:
                with contextlib.suppress(OSError):
                    os.close(held)
            if not self.closed:  # (close_after: its own descriptor, now)
                with contextlib.suppress(OSError):
                    super().close()

    def __del__(self) -> None:
        # Never publish a file nobody closed: its content may be incomplete.
        if not self.closed:
            if self.foreign():  # (a forked child's copy: the parent's file is not its own)
                with contextlib.suppress(OSError):
                    super().close()
                return
            _warn_never_closed(self._key)
            self.abort()


def _warn_never_closed(key: str) -> None:
    """The ``ResourceWarning`` of a writer collected without ``close()`` (raw, buffered or
    text alike: its file is discarded, and a lost publication must leave a trace)."""
    warnings.warn(f"instride file for key {key!r} was never closed; not published",
                  ResourceWarning, stacklevel=3)


class _AbortOnError:
    """Buffered/text layers over a :class:`_PublishingFileIO`: an exception leaving a ``with``
    block, a failed flush, or garbage collection without ``close()`` discards the file. In a
    forked child, closing its copy only closes the inherited descriptor: its copy of the buffer
    is dropped, not written into the parent's file."""

    def _publishing_raw(self) -> _PublishingFileIO:
        layer: Any = self
        while not isinstance(layer, _PublishingFileIO):
            layer = layer.buffer if hasattr(layer, "buffer") else layer.raw
        return layer

    def __exit__(self, exc_type, exc, tb):  # type: ignore[no-untyped-def]
        if exc_type is not None:
            self._publishing_raw()._aborted = True
        self.close()

    def close(self) -> None:
        if self.closed:  # type: ignore[attr-defined]
            return
        raw = self._publishing_raw()
        if raw.foreign():  # (the layers above report closed once their raw file is)
            raw.close()
            return
        try:
            self.flush()  # type: ignore[attr-defined]
        except BaseException:
            self._publishing_raw()._aborted = True
            with contextlib.suppress(Exception):
                super().close()  # type: ignore[misc]
            raise
        super().close()  # type: ignore[misc]

    def __del__(self) -> None:
        try:
            closed = self.closed  # type: ignore[attr-defined]
        except ValueError:  # (a text layer whose __init__ failed, e.g. a bad encoding: the
            return          # open_for_write that made it has discarded the file already)
        if not closed:
            raw = self._publishing_raw()
            if not raw.foreign():  # (as the raw file's own: a forked child's copy says nothing)
                _warn_never_closed(raw.key)
            raw._aborted = True  # (closed here: the raw file's __del__ warns no second time)
            with contextlib.suppress(Exception):
                self.close()


class _PublishingBufferedWriter(_AbortOnError, io.BufferedWriter):
    pass


class _PublishingBufferedRandom(_AbortOnError, io.BufferedRandom):
    pass


class _PublishingTextIOWrapper(_AbortOnError, io.TextIOWrapper):
    pass


WRITE_MODES = {"w", "wb", "wt", "x", "xb", "xt", "w+", "w+b", "wb+", "w+t", "wt+", "x+", "x+b", "xb+"}
READ_MODES = {"r", "rb", "rt"}


def check_mode(mode: str) -> bool:
    """Return True for a write mode, False for a read mode.

    Raises
    ------
    UnsupportedModeError
        For append (``a``) or update (``r+``) modes: published keys are immutable.
    """
    if mode in WRITE_MODES:
        return True
    if mode in READ_MODES:
        return False
    chars = set(mode) if isinstance(mode, str) else set()
    kinds = chars & {"r", "w", "x", "a"}
    if "a" in chars or "r" in chars and "+" in chars:
        raise UnsupportedModeError(mode, "published keys are immutable (no append or update)")
    if len(chars) == len(mode) and chars <= {"r", "w", "x", "b", "t", "+"} \
            and len(kinds) == 1 and not {"b", "t"} <= chars:
        return "r" not in kinds  # (the builtin open's other spellings: "br", "bw", "+wb"...)
    raise UnsupportedModeError(mode, "expected one of r, rb, w, wb, x, xb, w+, w+b (in any "
                               "order, as for open())")


def open_for_write(
    final: str,
    key: str,
    mode: str,
    *,
    overwrite: bool,
    fsync: bool,
    on_publish: PublishHook | None = None,
    checksum: bool = False,
    close_after: bool = False,
    buffering: int = -1,
    encoding: str | None = None,
    errors: str | None = None,
    newline: str | None = None,
) -> io.IOBase:
    """Open a file that is written under a temporary name and published when closed.

    Leaving a ``with`` block by an exception discards the file instead of publishing it.
    ``x`` modes are write-once regardless of ``overwrite``. With ``checksum``, the content is
    hashed while it is written and ``on_publish(key, path, checksum, size)`` receives its record
    checksum and size (``None`` for both if the file was seeked, truncated or is readable);
    without, ``on_publish(key, path)``. ``close_after``: the file system reports nothing at
    ``close`` (tmpfs), so the file's descriptor is closed after its publication, not before.
    """
    if "x" in mode:
        overwrite = False
    readable = "+" in mode
    raw = _PublishingFileIO(
        final, key, readable=readable, overwrite=overwrite, fsync=fsync, on_publish=on_publish,
        checksum=checksum and not readable, close_after=close_after,
    )
    if buffering == 0:
        if "b" not in mode:
            raw.abort()
            raise ValueError("can't have unbuffered text I/O")
        return raw
    size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
    cls = _PublishingBufferedRandom if readable else _PublishingBufferedWriter
    buffered: io.BufferedIOBase = cls(raw, size)
    if "b" in mode:
        return buffered
    try:
        return _PublishingTextIOWrapper(
            buffered, encoding=encoding or "utf-8", errors=errors, newline=newline,
            line_buffering=buffering == 1,
        )
    except BaseException:  # (a bad encoding or newline: the file is discarded now, not
        raw.abort()        # at its collection, which would warn of a writer never closed)
        raise


def read_error(path: Path) -> OSError:
    """An ``OSError`` for a key whose file vanished between wait and open (evicted, deleted)."""
    return FileNotFoundError(errno.ENOENT, "published key disappeared before it was opened", str(path))


__all__ = [
    "READ_MODES",
    "WRITE_MODES",
    "PublishHook",
    "check_mode",
    "drop_name",
    "fsync_dir",
    "name_if_free",
    "open_for_write",
    "publish_file",
    "read_error",
]
