"""Node-local publication and waiting: atomic rename and inotify.

Publishing a file is making it appear under its key in one step: it is written under a
hidden temporary name in the key's directory, optionally fsynced, then hard-linked (write-once)
or renamed (overwrite) to its final name. A reader therefore sees either nothing or the whole
file. Waiting arms an inotify watch on the key's directory and re-checks after arming, so a
publication that lands between the first check and the watch is never missed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from inotify_simple import INotify
from inotify_simple import flags as inflags

from .errors import ConsumeTimeout, KeyExistsError, UnsupportedModeError
from .keys import TMP_PATTERN, tmp_name

_MAX_WAIT_MS = 60_000  # one read() at most; longer waits loop (poll() takes an int)
_LOST = int(inflags.Q_OVERFLOW)
_GONE = int(inflags.IGNORED | inflags.DELETE_SELF | inflags.MOVE_SELF)
_WATCH = inflags.CREATE | inflags.MOVED_TO | inflags.DELETE_SELF | inflags.MOVE_SELF


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


def publish_file(tmp: str | Path, final: str | Path, key: str, *, overwrite: bool) -> None:
    """Atomically give the complete file ``tmp`` its final name ``final``.

    Write-once (``overwrite=False``) uses ``renameat2(RENAME_NOREPLACE)`` (or ``link`` +
    ``unlink`` where unsupported) so that an existing key is detected atomically and never
    replaced; ``overwrite=True`` uses ``rename``.

    Raises
    ------
    KeyExistsError
        If ``final`` exists and ``overwrite`` is false; ``tmp`` is removed.
    """
    if overwrite:
        os.rename(tmp, final)
        return
    try:
        if _rename_noreplace(tmp, final):
            return
        os.link(tmp, final)
    except FileExistsError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise KeyExistsError(key) from None
    os.unlink(tmp)


class _Watcher(threading.local):
    """One inotify instance per thread, kept for the life of the thread.

    Closing an inotify descriptor waits for an RCU grace period (milliseconds on some
    kernels), so waits reuse one instance and its directory watches instead of making and
    closing one each time. Watches are bounded; stale events of other files are ignored.
    """

    MAX_WATCHES = 64

    def __init__(self) -> None:
        self.ino: INotify | None = None
        self.pid = 0
        self.wds: OrderedDict[Path, int] = OrderedDict()

    def get(self) -> INotify:
        if self.ino is None or self.pid != os.getpid():  # new thread, or a forked child
            self.ino = INotify()
            self.pid = os.getpid()
            self.wds.clear()
        return self.ino

    def watch(self, directory: Path) -> None:
        ino = self.get()
        if directory in self.wds:
            self.wds.move_to_end(directory)
            return
        directory.mkdir(parents=True, exist_ok=True)
        self.wds[directory] = ino.add_watch(directory, _WATCH)
        while len(self.wds) > self.MAX_WATCHES:
            _old, wd = self.wds.popitem(last=False)
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)

    def drop(self, directory: Path) -> None:
        """Stop watching ``directory`` (about to be removed)."""
        wd = self.wds.pop(directory, None)
        if wd is not None:
            with contextlib.suppress(OSError):
                self.get().rm_watch(wd)

    def forget(self, wd: int) -> None:
        for directory, w in list(self.wds.items()):
            if w == wd:
                del self.wds[directory]
                with contextlib.suppress(OSError):
                    self.get().rm_watch(w)

    def reset(self) -> None:
        """Drop every watch (after a queue overflow); waits re-arm what they need."""
        ino = self.get()
        for wd in self.wds.values():
            with contextlib.suppress(OSError):
                ino.rm_watch(wd)
        self.wds.clear()


_watcher = _Watcher()


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


def _missing_dirs(dirs: Iterable[Path]) -> list[Path]:
    """The directories (deepest first) that watching ``dirs`` would create."""
    missing: list[Path] = []
    for directory in dirs:
        d = directory
        while d not in missing and not os.path.isdir(d) and d != d.parent:
            missing.append(d)
            d = d.parent
    return sorted(missing, key=lambda p: len(p.parts), reverse=True)


def wait_any(
    paths: Sequence[Path],
    timeout: float | None,
    *,
    label: str,
) -> Path:
    """Block until one of ``paths`` exists and return it.

    Parameters
    ----------
    paths
        Candidate files; their directories are created if missing so they can be watched, and
        removed again (when still empty) if the wait fails: a failed wait leaves nothing behind.
    timeout
        Seconds to wait; ``None`` waits forever.
    label
        What is being waited for, named in the :class:`ConsumeTimeout`.

    Raises
    ------
    ConsumeTimeout
        If none appears within ``timeout``.
    """
    for path in paths:
        if os.path.exists(path):
            return path
    created = _missing_dirs(dict.fromkeys(p.parent for p in paths))  # [cleanup]
    try:
        return _wait_any(paths, timeout, label)
    except BaseException:
        for directory in created:  # [cleanup] deepest first; a non-empty one stays
            _watcher.drop(directory)
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise


#: errno of inotify_init / inotify_add_watch when the per-user limits are reached
#: (fs.inotify.max_user_instances, 128 by default; max_user_watches) or memory is short.
_NO_INOTIFY = (errno.EMFILE, errno.ENFILE, errno.ENOSPC, errno.ENOMEM)
#: Longest sleep between two checks of a polling wait.
_POLL_MAX = 0.05


def _poll_any(paths: Sequence[Path], timeout: float | None, label: str, start: float) -> Path:
    """Wait by polling (1 ms doubling to 50 ms): the fallback when no inotify is available.

    A process can hold only so many inotify instances (a thousand waiting threads exceed the
    default per-user limit of 128); their waits still end correctly, at most 50 ms late.
    """
    delay = 0.001
    while True:
        for path in paths:
            if os.path.exists(path):
                return path
        elapsed = time.monotonic() - start
        if timeout is not None and elapsed >= timeout:
            raise ConsumeTimeout(label, elapsed)
        time.sleep(delay if timeout is None else max(0.0, min(delay, timeout - elapsed)))
        delay = min(delay * 2, _POLL_MAX)


def _wait_any(paths: Sequence[Path], timeout: float | None, label: str) -> Path:
    start = time.monotonic()
    names = {p.name for p in paths}
    dirs = list(dict.fromkeys(p.parent for p in paths))
    try:
        ino = _watcher.get()
        for directory in dirs:
            _watcher.watch(directory)
    except OSError as exc:  # [limits] out of inotify instances or watches: poll instead
        if exc.errno not in _NO_INOTIFY:
            raise
        return _poll_any(paths, timeout, label, start)
    # Re-check after arming: a publication between the first check and the watch produced
    # no event we could see.
    for path in paths:
        if os.path.exists(path):
            return path
    while True:
        if timeout is None:
            wait_ms = _MAX_WAIT_MS
        else:
            remaining = timeout - (time.monotonic() - start)
            if remaining <= 0:
                raise ConsumeTimeout(label, time.monotonic() - start)
            wait_ms = min(max(1, int(remaining * 1000)), _MAX_WAIT_MS)
        wake = rearm = False
        for ev in ino.read(timeout=wait_ms):  # the cheapest test first: this is the hot path
            if ev.name in names:
                wake = True
            elif ev.mask & _LOST:  # events (maybe IN_IGNORED) were lost
                _watcher.reset()
                rearm = True
            elif ev.mask & _GONE:  # a watched directory went away or moved
                _watcher.forget(ev.wd)
                rearm = True
        if rearm:
            for directory in dirs:
                _watcher.watch(directory)
        if wake or rearm:
            for path in paths:
                if os.path.exists(path):
                    return path


def iter_tmp_files(root: Path) -> Iterable[tuple[Path, int]]:
    """Yield ``(path, pid)`` for every instride temporary file under ``root``."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            match = TMP_PATTERN.match(name)
            if match:
                yield Path(dirpath) / name, int(match.group("pid"))


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def collect_garbage(root: Path, *, min_age: float = 0.0) -> list[Path]:
    """Remove temporary files left by producers that died mid-write.

    A temporary file is removed when its writer's PID is gone, or when it is older than
    ``min_age`` seconds and ``min_age`` is positive (for PIDs reused since).
    """
    removed = []
    now = time.time()
    for path, pid in iter_tmp_files(root):
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if (pid != os.getpid() and not pid_alive(pid)) or (min_age > 0 and age > min_age):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


# --------------------------------------------------------------------------- writers

PublishHook = Callable[[str, str], None]


class _PublishingFileIO(io.FileIO):
    """A raw file on a temporary name that publishes itself under its key when closed."""

    def __init__(
        self,
        final: str,
        key: str,
        *,
        readable: bool,
        overwrite: bool,
        fsync: bool,
        on_publish: PublishHook | None,
    ) -> None:
        if not overwrite and os.path.exists(final):
            raise KeyExistsError(key)
        self._tmp = tmp_name(final)
        self._final = final
        self._key = key
        self._overwrite = overwrite
        self._fsync = fsync
        self._on_publish = on_publish
        self._aborted = False
        self._failed: BaseException | None = None
        for attempt in range(5):
            try:
                super().__init__(self._tmp, "x+" if readable else "x")
                break
            except FileNotFoundError:  # first file of its directory (or a failed wait's
                if attempt == 4:      # cleanup removed the empty directory meanwhile)
                    raise
                os.makedirs(os.path.dirname(final), exist_ok=True)

    @property
    def key(self) -> str:
        """The key this file is published under on close."""
        return self._key

    def write(self, b: Any) -> int | None:  # type: ignore[override]
        try:
            return super().write(b)
        except BaseException as exc:
            self._failed = exc  # a lost write must never be published as a complete file
            raise

    def abort(self) -> None:
        """Close without publishing and remove the temporary file."""
        self._aborted = True
        self.close()

    def close(self) -> None:
        if self.closed:
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
        super().close()
        try:
            publish_file(self._tmp, self._final, self._key, overwrite=self._overwrite)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            raise
        if self._fsync:
            fsync_dir(os.path.dirname(self._final))  # the new name survives a crash too
        if self._on_publish is not None:
            self._on_publish(self._key, self._final)

    def __del__(self) -> None:
        # Never publish a file nobody closed: its content may be incomplete.
        if not self.closed:
            warnings.warn(
                f"instride file for key {self._key!r} was never closed; not published",
                ResourceWarning,
                stacklevel=2,
            )
            self.abort()


class _AbortOnError:
    """Buffered/text layers over a :class:`_PublishingFileIO`: an exception leaving a ``with``
    block, a failed flush, or garbage collection without ``close()`` discards the file."""

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
        try:
            self.flush()  # type: ignore[attr-defined]
        except BaseException:
            self._publishing_raw()._aborted = True
            with contextlib.suppress(Exception):
                super().close()  # type: ignore[misc]
            raise
        super().close()  # type: ignore[misc]

    def __del__(self) -> None:
        if not self.closed:  # type: ignore[attr-defined]
            self._publishing_raw()._aborted = True
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
    if "a" in mode or "r+" in mode or "+r" in mode:
        raise UnsupportedModeError(mode, "published keys are immutable (no append or update)")
    raise UnsupportedModeError(mode, "expected one of r, rb, w, wb, x, xb, w+, w+b")


def open_for_write(
    final: str,
    key: str,
    mode: str,
    *,
    overwrite: bool,
    fsync: bool,
    on_publish: PublishHook | None = None,
    buffering: int = -1,
    encoding: str | None = None,
    errors: str | None = None,
    newline: str | None = None,
) -> io.IOBase:
    """Open a file that is written under a temporary name and published when closed.

    Leaving a ``with`` block by an exception discards the file instead of publishing it.
    ``x`` modes are write-once regardless of ``overwrite``.
    """
    if "x" in mode:
        overwrite = False
    readable = "+" in mode
    raw = _PublishingFileIO(
        final, key, readable=readable, overwrite=overwrite, fsync=fsync, on_publish=on_publish
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
    return _PublishingTextIOWrapper(
        buffered, encoding=encoding or "utf-8", errors=errors, newline=newline,
        line_buffering=buffering == 1,
    )


def read_error(path: Path) -> OSError:
    """An ``OSError`` for a key whose file vanished between wait and open (evicted, deleted)."""
    return FileNotFoundError(errno.ENOENT, "published key disappeared before it was opened", str(path))
