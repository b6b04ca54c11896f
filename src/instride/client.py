"""open / publish / consume, built from keys, local publication, metadata and transport.

The synchronization is adaptive: a key already on this node costs one ``stat`` (plus, for
a copy fetched from another node, a version check); only a missing key waits on metadata,
and only a key owned by another node is transferred.
"""

from __future__ import annotations

import contextlib
import io as _io
import mmap
import os
import shutil
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import xxhash

from . import local
from .config import Settings
from .errors import ConfigError, KeyExistsError, UnsupportedModeError
from .keys import key_path, normalize_key, tmp_path
from .metadata import MetadataBackend, Record, get_backend
from .paths import ConfinedOpener, confined_path

if TYPE_CHECKING:
    from .remote import RemoteStore

_ENV_KEYS = (
    "INSTRIDE_DIR",
    "INSTRIDE_REDIS_URL",
    "INSTRIDE_TOKEN",
    "INSTRIDE_TIMEOUT",
    "INSTRIDE_FSYNC",
    "INSTRIDE_CACHE_BYTES",
    "INSTRIDE_NODE",
    "INSTRIDE_ADDR",
    "INSTRIDE_SOCKET",
    "INSTRIDE_CONNECT_TIMEOUT",
)
_ENV_KEYS_B = tuple(os.fsencode(k) for k in _ENV_KEYS)

_open = _io.open  # the builtin, captured before instride.interception.pyopen may patch it


def _env_snapshot() -> tuple[object, ...]:
    data = getattr(os.environ, "_data", None)  # CPython: the bytes-keyed dict behind environ
    if isinstance(data, dict):
        return tuple(data.get(k) for k in _ENV_KEYS_B)
    return tuple(os.environ.get(k) for k in _ENV_KEYS)


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
        The directory is a symbolic link, belongs to another user, or is writable by others.
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
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError("INSTRIDE_DIR", str(root), "writable by every user")


def file_checksum(path: Path) -> str:
    """Return ``"xxh3:<hex>"`` of a file's content (memory-mapped, no copy)."""
    with _open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return "xxh3:" + xxhash.xxh3_64_hexdigest(b"")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return "xxh3:" + xxhash.xxh3_64_hexdigest(mm)


class Client:
    """The instride API bound to one :class:`~instride.config.Settings`.

    Most programs use the module-level functions (:func:`instride.open` ...), which use a
    client built from the environment. Build a ``Client`` to use other settings in-process.

    Parameters
    ----------
    settings
        Settings to use; default: read from ``INSTRIDE_*`` environment variables.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings.from_env()
        self.root = self.settings.dir
        self._root_s = str(self.root)
        ensure_private_dir(self.root)
        self._confined = ConfinedOpener(self.root)  # [confine] opens keys, never through links
        #: whether publications fsync: asked for, and the managed directory is not on tmpfs
        #: (where fsync cannot make anything durable and only costs time)
        self.fsync = self.settings.fsync and file_system_type(self._root_s) != "tmpfs"
        self._metadata: MetadataBackend | None = None
        self._cluster: Any = None

    # ------------------------------------------------------------------ plumbing
    @property
    def mode(self) -> str:
        """``"local"`` or ``"cluster"``."""
        return self.settings.mode

    @property
    def metadata(self) -> MetadataBackend:
        """The metadata backend of this client's mode."""
        if self._metadata is None:
            self._metadata = get_backend("redis" if self.settings.redis_url else "files", self.settings)
        return self._metadata

    @property
    def cluster(self) -> RemoteStore | None:
        """Cluster-mode machinery (fetching, cache); ``None`` in local mode."""
        if self._cluster is None and self.settings.redis_url:
            from .remote import RemoteStore

            self._cluster = RemoteStore(self.settings, self.metadata)
        return self._cluster

    def close(self) -> None:
        """Release connections held by this client."""
        self._confined.close()
        if self._metadata is not None:
            self._metadata.close()
            self._metadata = None
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def key(self, key_or_path: str | os.PathLike[str]) -> str:
        """Validate and normalize a key or a path under the managed directory."""
        return normalize_key(key_or_path, self.root)

    def path(self, key_or_path: str | os.PathLike[str]) -> Path:
        """The local path of a key (whether or not it is published)."""
        return key_path(self.key(key_or_path), self.root)

    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.settings.timeout
        if timeout < 0:  # 0 means "do not wait", like INSTRIDE_TIMEOUT=0 and --timeout 0
            raise ConfigError("timeout", timeout, "must be >= 0 (0: do not wait; None: forever)")
        return None if timeout == float("inf") else timeout

    def _record_for(self, key: str, path: Path) -> Record:
        st = path.stat()
        return Record(
            key=key,
            owner=self.settings.addr,
            size=st.st_size,
            checksum=file_checksum(path) if self.settings.redis_url else None,
            version=1,
            time=time.time(),
            node=self.settings.node,
        )

    def register(self, key: str | os.PathLike[str], *, overwrite: bool = False) -> Record:
        """Record a file already in place under ``key`` in the metadata (cluster mode).

        Local mode needs no record (the file is the record). In cluster mode the record holds
        this node as owner, the size, the checksum and a new version. If recording fails, a
        write-once file is removed again, so no key is left visible without a record.

        Parameters
        ----------
        key
            The key (the file must be at its final path).
        overwrite
            Allow replacing an existing record (a new version) instead of write-once.

        Returns
        -------
        Record
            The record as stored.

        Raises
        ------
        KeyExistsError
            Write-once and another node already published ``key``.
        MetadataUnavailable
            Redis could not be reached.
        """
        key = self.key(key)
        path = confined_path(self.root, key, for_write=False)  # [confine] a regular file, no link
        record = self._record_for(key, path)
        if not self.settings.redis_url:
            return self.metadata.publish(record, overwrite=overwrite)
        self.cluster.forget_fetched(key)  # our own original now, never evicted
        try:
            return self.metadata.publish(record, overwrite=overwrite)
        except KeyExistsError:
            # [keep] a second PUBLISH of the very bytes already recorded (the same file) must
            # not remove the published original; a conflicting file is removed.
            existing = None if overwrite else self.metadata.lookup(key)
            same = existing is not None and existing.checksum == record.checksum and (
                existing.owner == record.owner)
            if not overwrite and not same:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise
        except BaseException:
            if not overwrite:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            raise

    def _after_publish(self, key: str, path: str | Path, overwrite: bool = False) -> None:
        if self.settings.redis_url:
            self.register(key, overwrite=overwrite)

    # ------------------------------------------------------------------ producing
    def open(
        self,
        key_or_path: str | os.PathLike[str],
        mode: str = "rb",
        *,
        timeout: float | None = None,
        overwrite: bool = False,
        buffering: int = -1,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
    ) -> IO[Any]:
        """Open a key like the builtin :func:`open`.

        Write modes (``w``, ``wb``, ``w+``, ``x``...) write to a hidden temporary file that is
        fsynced (if ``INSTRIDE_FSYNC``) and atomically published under the key on close; an
        exception leaving a ``with`` block discards it. Read modes (``r``, ``rb``) wait until
        the key is published (fetching it from its owner node in cluster mode), then open it.

        Parameters
        ----------
        key_or_path
            Key relative to the managed directory, or a path under it.
        mode
            ``"r"``, ``"rb"``, ``"w"``, ``"wb"``, ``"x"``, ``"xb"``, ``"w+"``, ``"w+b"``.
        timeout
            Seconds a read waits (default: ``INSTRIDE_TIMEOUT``, else forever).
        overwrite
            Replace an already published key (write modes); default is write-once.

        Returns
        -------
        file object
            A regular :mod:`io` file object.

        Raises
        ------
        KeyValidationError
            Bad key. Nothing is written.
        KeyExistsError
            Writing a published key without ``overwrite``.
        ConsumeTimeout
            A read waited longer than ``timeout``.
        UnsupportedModeError
            Append or update modes: published keys are immutable.
        UnsafePathError, FileTypeError
            A symbolic link on the way or under the key, or the key names a directory or a
            special file: nothing is read or written outside the managed directory.

        Examples
        --------
        >>> with instride.open("run1/frame_0.dat", "wb") as f:   # doctest: +SKIP
        ...     f.write(data)
        >>> with instride.open("run1/frame_0.dat") as f:         # doctest: +SKIP
        ...     data = f.read()
        """
        writing = local.check_mode(mode)
        key = self.key(key_or_path)
        path = f"{self._root_s}/{key}"  # strings, not pathlib, on this hot path
        if writing:
            confined_path(self._root_s, key, for_write=True)  # [confine] no link, dir, device
            return local.open_for_write(
                path,
                key,
                mode,
                overwrite=overwrite,
                fsync=self.fsync,
                on_publish=lambda k, p: self._after_publish(k, p, overwrite),
                buffering=buffering,
                encoding=encoding,
                errors=errors,
                newline=newline,
            )
        if self.settings.redis_url:
            path = self._consume_key(key, timeout)
        else:
            try:  # adaptive: a key already here costs just the open
                return self._open_read(key, path, mode, buffering, encoding, errors, newline)
            except FileNotFoundError:
                path = self._consume_key(key, timeout)
        return self._open_read(key, path, mode, buffering, encoding, errors, newline)

    def _opener(self, key: str) -> Any:
        """An ``opener`` for :func:`open` that refuses links, directories and special files."""
        return lambda _path, _flags: self._confined.open(key)  # [confine]

    def _open_read(
        self, key: str, path: str | Path, mode: str, buffering: int, encoding: str | None,
        errors: str | None, newline: str | None,
    ) -> IO[Any]:
        opener = self._opener(key)
        if "b" in mode:
            return _open(path, "rb", buffering=buffering, opener=opener)
        return _open(path, "r", buffering=buffering, encoding=encoding or "utf-8", errors=errors,
                     newline=newline, opener=opener)

    def publish(
        self,
        src: str | os.PathLike[str],
        key: str | os.PathLike[str] | None = None,
        *,
        overwrite: bool = False,
    ) -> str:
        """Publish a file written by other means.

        With ``key``, ``src`` (anywhere) is moved atomically under ``key``: linked when on the
        same file system, else copied to a hidden temporary name, then renamed into place; the
        source name is removed. Without ``key``, ``src`` must already be at its final path
        under the managed directory (written in place by a legacy tool); it is recorded.

        Parameters
        ----------
        src
            A regular file (not a symbolic link).
        key
            The key to publish under; default: the key of ``src``'s own path.
        overwrite
            Replace an already published key instead of write-once.

        Returns
        -------
        str
            The key.

        Raises
        ------
        FileNotFoundError
            ``src`` does not exist.
        KeyExistsError
            ``key`` is published and ``overwrite`` is false (``src`` is left untouched).
        KeyValidationError
            Bad key, or ``src`` outside the managed directory when ``key`` is omitted.
        UnsupportedModeError
            ``src`` is a symbolic link.
        """
        srcp = Path(os.path.abspath(src))
        if srcp.is_symlink():
            raise UnsupportedModeError("publish", f"{str(srcp)!r} is a symbolic link; publish its target")
        if not srcp.is_file():
            raise FileNotFoundError(f"cannot publish {str(srcp)!r}: no such file")
        if key is None:
            key = self.key(srcp)
            final = confined_path(self.root, key, for_write=True)  # [confine]
            if srcp == final:  # already in place (written non-atomically by a legacy tool)
                self._after_publish(key, final, overwrite)
                return key
        else:
            key = self.key(key)
            final = key_path(key, self.root)
        confined_path(self.root, key, for_write=True)  # [confine] no link or directory on the way
        final.parent.mkdir(parents=True, exist_ok=True)
        if not overwrite and final.exists():
            raise KeyExistsError(key)
        staged = tmp_path(final)
        try:
            try:
                os.link(srcp, staged)  # same file system: no copy
            except OSError:
                shutil.copyfile(srcp, staged)
            if self.fsync:
                fd = os.open(staged, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            local.publish_file(staged, final, key, overwrite=overwrite)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
            raise
        os.unlink(srcp)  # moved, not copied: the source name goes away
        self._after_publish(key, final, overwrite)
        return key

    # ------------------------------------------------------------------ consuming
    def _consume_key(self, key: str, timeout: float | None) -> Path:
        timeout = self._timeout(timeout)
        path = confined_path(self.root, key, for_write=False)  # [confine] before waiting/fetching
        if self.settings.redis_url:
            self.cluster.consume(key, timeout)
        elif os.path.exists(path):
            return path
        else:
            local.wait_any([path], timeout, label=key)
        return confined_path(self.root, key, for_write=False)  # [confine] what was published

    def consume(self, key: str | os.PathLike[str], timeout: float | None = None) -> Path:
        """Wait until ``key`` is published and present on this node; return its local path.

        Parameters
        ----------
        key
            The key (or a path under the managed directory).
        timeout
            Seconds to wait (default ``INSTRIDE_TIMEOUT``, else forever).

        Returns
        -------
        pathlib.Path
            The local file.

        Raises
        ------
        ConsumeTimeout
            After ``timeout`` seconds (default ``INSTRIDE_TIMEOUT``, else forever).
        PeerUnavailable, IntegrityError
            Cluster mode: the owner cannot be reached / the bytes do not verify.
        UnsafePathError
            A symbolic link on the way to the key, or as the key itself (never followed).
        FileTypeError
            The key names a directory, a FIFO, a socket or a device.
        """
        return self._consume_key(self.key(key), timeout)

    def consume_bytes(self, key: str | os.PathLike[str], timeout: float | None = None) -> memoryview:
        """Wait for ``key`` and return its content without a second copy on disk.

        A key on this node is memory-mapped read-only (zero copy); in cluster mode a key owned
        elsewhere is received into memory, verified, and not stored.

        Parameters
        ----------
        key
            The key.
        timeout
            Seconds to wait (default ``INSTRIDE_TIMEOUT``, else forever).

        Returns
        -------
        memoryview
            The content (read-only).
        """
        key = self.key(key)
        timeout = self._timeout(timeout)
        if self.settings.redis_url:
            data = self.cluster.consume_bytes(key, timeout)
            if data is not None:
                return data
        path = self._consume_key(key, timeout)
        with _open(path, "rb", opener=self._opener(key)) as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return memoryview(b"")
            return memoryview(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ))

    def wait_any(self, keys: Sequence[str], timeout: float | None = None) -> str:
        """Wait until one of ``keys`` is published; return the (normalized) key that was.

        The key is not fetched; call :meth:`consume` for its content.

        Raises
        ------
        ConsumeTimeout
            After ``timeout`` seconds (default ``INSTRIDE_TIMEOUT``, else forever).
        KeyValidationError
            A bad key.
        UnsafePathError, FileTypeError
            A key reached through a symbolic link, or naming a directory or special file.
        """
        keys = [self.key(k) for k in keys]
        timeout = self._timeout(timeout)
        for key in keys:
            confined_path(self.root, key, for_write=False)  # [confine] links, dirs, special files
        if not self.settings.redis_url:
            for key in keys:
                if os.path.exists(self.root / key):
                    return key
        key = self.metadata.wait_any(list(keys), timeout).key
        if not self.settings.redis_url:
            confined_path(self.root, key, for_write=False)  # [confine] what appeared
        return key

    def exists(self, key: str | os.PathLike[str]) -> bool:
        """Whether ``key`` is published (anywhere, in cluster mode).

        Parameters
        ----------
        key
            The key.

        Returns
        -------
        bool
        """
        key = self.key(key)
        if os.path.exists(self.root / key):
            return True
        return self.settings.redis_url is not None and self.metadata.lookup(key) is not None

    def lookup(self, key: str | os.PathLike[str]) -> Record | None:
        """The metadata record of ``key``.

        Parameters
        ----------
        key
            The key.

        Returns
        -------
        Record or None
            Owner, size, checksum, version and time; ``None`` when not published.
        """
        return self.metadata.lookup(self.key(key))

    def list(self, prefix: str = "") -> list[str]:
        """Published keys starting with ``prefix`` (all nodes, in cluster mode).

        Parameters
        ----------
        prefix
            A key prefix such as ``"run7/"``; empty lists everything.

        Returns
        -------
        list of str
            Sorted keys.
        """
        if prefix:
            normalize_key(prefix.rstrip("/") or "x", self.root)
        return self.metadata.list(prefix)

    def delete(self, key: str | os.PathLike[str]) -> None:
        """Unpublish ``key`` on this node (and its record, in cluster mode).

        Parameters
        ----------
        key
            The key; no error when it is not published.
        """
        key = self.key(key)
        confined_path(self.root, key, for_write=True)  # [confine] never unlink through a link
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)
        self.metadata.delete(key)

    def gc(self, min_age: float = 0.0) -> list[Path]:
        """Remove temporary files of dead producers.

        Parameters
        ----------
        min_age
            Also remove temporary files older than this many seconds (PID reuse).

        Returns
        -------
        list of pathlib.Path
            The files removed. See :func:`instride.local.collect_garbage`.
        """
        return local.collect_garbage(self.root, min_age=min_age)


_default: tuple[tuple[object, ...], Client] | None = None


_default_lock = threading.Lock()


def get_client() -> Client:
    """The process-wide client for the current ``INSTRIDE_*`` environment.

    A new client replaces the old one when the environment changes; the old one is not
    closed (another thread may still be using it) and is released when garbage-collected.
    """
    global _default
    env = _env_snapshot()
    current = _default
    if current is not None and current[0] == env:
        return current[1]
    with _default_lock:
        if _default is None or _default[0] != env:
            _default = (env, Client())
        return _default[1]


__all__ = ["Client", "get_client", "file_checksum"]
