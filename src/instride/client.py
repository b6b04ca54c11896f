"""open / publish / consume over one engine chosen at construction.

The client validates keys, writes produced files through atomic publication
(:mod:`instride.store`) and hands everything that depends on the mode to its engine
(:mod:`instride.engine`): a local engine (files + inotify) or a cluster engine (metadata +
transport + a cache of fetched copies). The synchronization is adaptive: a key already on this
node costs one ``stat`` (plus, for a copy fetched from another node, a version check); only a
missing key waits on metadata, and only a key owned by another node is transferred.
"""

from __future__ import annotations

import contextlib
import errno
import io as _io
import os
import shutil
import stat
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from . import store
from .config import Settings, env_snapshot, parse_timeout
from .engine import Engine, get_engine
from .errors import (
    ConfigError,
    FileTypeError,
    KeyExistsError,
    KeyNotFoundError,
    PublicationUnsettled,
    SourceBusy,
    UnsupportedModeError,
)
from .keys import key_path, normalize_key, recyclable, tmp_path
from .metadata import MetadataBackend, Record
from .paths import ConfinedOpener, check_confined, confined_file, confined_path, kind_of
from .store import ensure_private_dir, file_checksum, file_system_type
from .store.lease import SourceLease, hidden_name, hide_source, put_back_source
from .store.recvpool import ReceivePool
from .store.ring import collect_pools

_open = _io.open  # the builtin, captured before instride.interception.pyopen may patch it
#: consumes of a key whose file is gone again before it could be opened (a fetched copy that
#: another process of the node evicted), before :class:`KeyNotFoundError`
#: (8: readers thrashing a cache smaller than what they read lost a copy three times in a
#: row under CI load, 1 read in ~450 of tests/engine/test_cluster.py's churn test)
_OPEN_ATTEMPTS = 8


#: why :meth:`Client.publish` refuses a file a writer opened while it was moved into place
_OPENED_WHILE_MOVED = "it was opened for writing while it was being moved into place"


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
        tmpfs = file_system_type(self._root_s) == "tmpfs"
        self.fsync = self.settings.fsync and not tmpfs
        #: whether a written file's close() can report nothing (tmpfs: no deferred write
        #: errors), so a writer may close it after its publication (store.open_for_write)
        self._close_after = tmpfs
        #: the engine of this client's mode, chosen once (:mod:`instride.engine`)
        self.engine: Engine = get_engine(self.settings.mode, self.settings)

    # ------------------------------------------------------------------ plumbing
    @property
    def mode(self) -> str:
        """``"local"`` or ``"cluster"``: the name of the engine."""
        return self.engine.name

    @property
    def metadata(self) -> MetadataBackend:
        """The metadata backend of this client's engine."""
        return self.engine.metadata

    @property
    def cluster(self) -> Any:
        """The cluster engine (fetching, cache, transfer counters); ``None`` in local mode.

        Kept for existing callers; new code uses :attr:`engine`.
        """
        return self.engine if self.engine.name == "cluster" else None

    def close(self) -> None:
        """Release connections held by this client (it stays usable)."""
        self._confined.close()
        self.engine.close()

    def key(self, key_or_path: str | os.PathLike[str]) -> str:
        """Validate and normalize a key or a path under the managed directory."""
        return normalize_key(key_or_path, self.root)

    def path(self, key_or_path: str | os.PathLike[str]) -> Path:
        """The local path of a key (whether or not it is published)."""
        return key_path(self.key(key_or_path), self.root)

    def _timeout(self, timeout: float | str | None) -> float | None:
        if timeout is None:
            return self.settings.timeout
        # 0 means "do not wait", like INSTRIDE_TIMEOUT=0 and --timeout 0; text as a Stream's
        # timeout= takes it ("abc" was a bare TypeError); NaN and negative are refused (no
        # deadline would ever pass, a wait for a lock would not end)
        try:
            return parse_timeout(timeout, "timeout")
        except (TypeError, ValueError, OverflowError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError("timeout", timeout, "not a number of seconds") from None

    def register(self, key: str | os.PathLike[str], *, overwrite: bool = False) -> Record:
        """Record a file already in place under ``key`` in the metadata (cluster mode).

        Local mode needs no record (the file is the record). In cluster mode the record holds
        this node as owner, the size, the checksum and a new version. If recording fails, a
        write-once file is removed again, so no key is left visible without a record; except
        where Redis went out of reach after the record was sent
        (:class:`~instride.errors.PublicationUnsettled`):
        then the file stays, since a record may name it. A key recorded already with this very
        file (this node, the same checksum) is confirmed: its record is returned. That is how
        an unsettled publication is settled.

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
            Write-once and another node already published ``key`` (or other bytes).
        MetadataUnavailable
            Redis could not be reached.
        PublicationUnsettled
            Redis went out of reach after the record was sent, before its answer: it may be
            recorded; the file stays (register it again once Redis answers).
        """
        key = self.key(key)
        confined_path(self.root, key, for_write=False)  # [confine] a regular file, no link
        return self.engine.register(key, overwrite=overwrite)

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
        writing = store.check_mode(mode)
        key = self.key(key_or_path)
        if writing:
            check_confined(self._root_s, key, for_write=True)  # [confine] no link, dir, device
            if not overwrite:
                self._free_of_stale_copy(key, f"{self._root_s}/{key}")
            return store.open_for_write(
                f"{self._root_s}/{key}",  # strings, not pathlib, on this hot path
                key,
                mode,
                overwrite=overwrite,
                fsync=self.fsync,
                close_after=self._close_after,
                on_publish=lambda k, _p, digest=None, size=None: self.engine.published(
                    k, overwrite, digest, size),
                checksum=self.engine.wants_checksum,
                buffering=buffering,
                encoding=encoding,
                errors=errors,
                newline=newline,
            )
        limit = self._timeout(timeout)  # (a bad one is refused whether or not the key is here)
        ready = self.engine.ready(key)
        if ready is not None:  # adaptive: a key already here costs a stat (cluster: and a
            # look at its record) and the open
            try:
                return self._open_read(key, ready, mode, buffering, encoding, errors, newline)
            except FileNotFoundError:
                pass  # deleted or evicted meanwhile: wait for it like any missing key
        deadline = None if limit is None else time.monotonic() + limit
        for attempt in range(_OPEN_ATTEMPTS):
            # (forever stays forever: None would be INSTRIDE_TIMEOUT again)
            left = float("inf") if deadline is None else max(0.0, deadline - time.monotonic())
            path = self._consume_key(key, left)
            try:
                return self._open_read(key, path, mode, buffering, encoding, errors, newline)
            except FileNotFoundError:
                # a fetched copy another process of this node evicted between its fetch and
                # this open (INSTRIDE_CACHE_BYTES): made local again
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise KeyNotFoundError(key) from None
        raise AssertionError("unreachable")

    def open_fd(self, key: str) -> int:
        """A read-only descriptor of the local file of the normalized ``key``, confined.

        No symbolic link is followed on the way (the kernel's ``openat2`` beneath the managed
        directory where it has one, see :class:`~instride.paths.ConfinedOpener`), and only a
        regular file is opened. The caller closes it. A stream's frame is held while the
        descriptor is open (a bounded stream never rewrites it for a later frame meanwhile).

        Raises
        ------
        FileNotFoundError
            No file under ``key`` on this node (yet), or a frame's file was retired.
        UnsafePathError, FileTypeError
            A symbolic link on the way or as the key; a directory or special file.
        """
        return self._confined.open(key, hold=recyclable(key))

    @property
    def confined(self) -> ConfinedOpener:
        """The opener of this client's keys (beneath the managed directory, no links)."""
        return self._confined

    def _opener(self, key: str) -> Any:
        """An ``opener`` for :func:`open` that refuses links, directories and special files."""
        hold = recyclable(key)  # (a stream's frame: held while open, never rewritten under it)
        return lambda _path, _flags: self._confined.open(key, hold=hold)  # [confine]

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
        same file system (copied when it has other hard links: a key shares its file with no
        other name), else copied to a hidden temporary name, then renamed into place; the
        source is removed once the key is recorded. Without ``key``, ``src`` must already
        be at its final path under the managed directory (written in place by a legacy tool);
        it is recorded — as is a ``src`` that is another name of the key's very file.

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
        FileTypeError
            ``src`` is a directory or a special file (``errno`` ``EISDIR``, ``EINVAL``).
        KeyExistsError
            ``key`` is published and ``overwrite`` is false (``src`` is left untouched).
        KeyValidationError
            Bad key, or ``src`` outside the managed directory when ``key`` is omitted.
        MetadataUnavailable
            Cluster mode: the record could not be stored; ``src`` is left untouched (the
            key's file is removed again, write-once), or, for
            :class:`~instride.errors.PublicationUnsettled` (it may be recorded), moved.
        SourceBusy
            ``src`` is open for writing by another process (a read lease says so, where the
            file system grants one: not NFS or Lustre), or was opened for writing while it was
            linked or copied into place; nothing is published, ``src`` is left untouched. (This
            process's own descriptors of it do not count: write, flush, publish, then close.
            A file published in place, without ``key``, is looked at once, as the call
            begins.) With ``overwrite``, a writer seen only once the key's file is in place
            leaves it published: the key's previous file is gone.
        UnsupportedModeError
            ``src`` is a symbolic link.
        """
        srcp = Path(os.path.abspath(src))
        if srcp.is_symlink():
            raise UnsupportedModeError("publish", f"{str(srcp)!r} is a symbolic link; publish its target")
        try:
            mode = os.stat(srcp).st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(errno.ENOENT,
                                    f"cannot publish {str(srcp)!r}: no such file") from None
        if not stat.S_ISREG(mode):  # (a directory was "no such file")
            raise FileTypeError(os.fspath(key if key is not None else srcp),
                                f"its source {str(srcp)!r} is {kind_of(mode)}; only a regular "
                                "file is published",
                                errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL)
        if key is None:
            key = self.key(srcp)
            final = confined_path(self.root, key, for_write=True)  # [confine]
        else:
            key = self.key(key)
            final = key_path(key, self.root)
        confined_path(self.root, key, for_write=True)  # [confine] no link or directory on the way
        try:
            in_place = os.path.samestat(os.lstat(srcp), os.lstat(final))
        except FileNotFoundError:
            in_place = False
        # A key's bytes never change: a file another process still writes is refused, and one
        # opened for writing while it is linked or copied here is not published (a read
        # lease, held until the publication; see store/lease.py)
        with SourceLease(str(srcp)) as lease:
            if in_place:  # (written in place by a legacy tool, or another name of the key's file)
                self._record_in_place(key, final, overwrite)
                return key
            final.parent.mkdir(parents=True, exist_ok=True)
            if not overwrite:
                self._free_of_stale_copy(key, str(final))
            if not overwrite and final.exists():
                raise KeyExistsError(key)
            # Leased, the source's name goes to a hidden name beside it: on one file system
            # before its file is linked to the key (a writer whose open found the name waits
            # for the lease, and the looks below see it before the key's file is in place,
            # where a reader could open it; one that looks for the name from then on does not
            # find it); across two, once the copy is whole (its name is kept meanwhile). The
            # name is drawn first: whatever ends the call -- an interrupt right after the
            # rename too -- names the source again by it. (No lease: as before.)
            hidden = hidden_name(srcp) if lease.held else None
            linked = os.stat(srcp).st_dev == os.stat(final.parent).st_dev \
                and os.lstat(srcp).st_nlink == 1  # (other names: a copy, never shared with them)
            staged = tmp_path(final)
            source, done = srcp, False
            try:
                if hidden is not None and linked:
                    source = hide_source(srcp, hidden)
                if lease.broken():  # (a writer opened it meanwhile: it waits for the lease)
                    raise SourceBusy(str(srcp), _OPENED_WHILE_MOVED)
                if linked:
                    try:
                        os.link(source, staged)  # same file system: no copy
                    except OSError:  # (no hard links here, or another mount of it)
                        shutil.copyfile(source, staged)
                else:
                    shutil.copyfile(source, staged)
                if self.fsync:
                    fd = os.open(staged, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                if hidden is not None and source == srcp:
                    source = hide_source(srcp, hidden)
                if lease.broken():
                    raise SourceBusy(str(srcp), _OPENED_WHILE_MOVED)
                ino = os.lstat(staged).st_ino
                store.publish_file(staged, final, key, overwrite=overwrite)
                if self.fsync:  # the new name survives a crash too, as a writer's does
                    store.fsync_dir(final.parent)
                if lease.broken() and not overwrite:
                    # (a writer whose open found the name just before it went, at the lease
                    # only now: taken back. Replacing, the key's previous file is gone: it
                    # stays, as the preload library's does)
                    with contextlib.suppress(FileNotFoundError):
                        if os.lstat(final).st_ino == ino:
                            os.unlink(final)
                    raise SourceBusy(str(srcp), _OPENED_WHILE_MOVED)
                # Recorded before the source goes: a record refused (write-once: another node
                # published the key; Redis out of reach) removes the key's file, and the
                # source must then still be there, untouched (named again)
                try:
                    self.engine.published(key, overwrite)
                except PublicationUnsettled:
                    os.unlink(source)  # (the key's file stays, a record may name it: moved after all)
                    done = True
                    raise
                os.unlink(source)  # moved, not copied: the source goes away
                done = True  # (after it: an interrupt between the two finds nothing to name again)
            except BaseException as exc:
                if not done:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(staged)
                    put_back_source(hidden, srcp, exc)
                raise
        return key

    def _record_in_place(self, key: str, final: Path, overwrite: bool) -> None:
        """Record the file in place under ``key``. A record refused removes a write-once
        key's file (no key visible without a record), here the caller's own file: a second
        name of it, hidden, brings it back then (where the file system makes hard links)."""
        spare = tmp_path(final)
        try:
            os.link(final, spare)
        except OSError:
            spare = None
        try:
            self.engine.published(key, overwrite)
        except BaseException:
            if spare is not None:
                with contextlib.suppress(OSError):  # (as it was before the call, unrecorded;
                    os.link(spare, final)  # never over a file that appeared there)
            raise
        finally:
            if spare is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(spare)

    # ------------------------------------------------------------------ consuming
    def _consume_key(self, key: str, timeout: float | None) -> Path:
        timeout = self._timeout(timeout)
        if self.engine.confines:  # [confine] checked in the wait, before and after it
            return self.engine.consume(key, timeout)
        fetched_now = getattr(self.engine, "fetched_now", None)
        if fetched_now is not None and fetched_now(key):
            # A copy this process stored moments ago, of the record the wait just returned
            # (the usual wait_any + consume of a stream's next frame, fetched early): nothing
            # to wait for or fetch, so one check of the file, as after a fetch (the checks
            # before and after, and the engine's look, cost a woken process ~0.1 ms).
            path, there = confined_file(self._root_s, key, for_write=False)  # [confine]
            if there:
                return Path(path)
        check_confined(self._root_s, key, for_write=False)  # [confine] before waiting/fetching
        self.engine.consume(key, timeout)
        return confined_path(self.root, key, for_write=False)  # [confine] what was published

    def ready(self, key: str | os.PathLike[str]) -> str | None:
        """The local path of ``key`` if it can be read right now without waiting, else ``None``.

        A key published on this node (or a fetched copy of its latest version, in cluster
        mode) is ready; nothing waits and nothing is fetched.

        Parameters
        ----------
        key
            The key (or a path under the managed directory).

        Returns
        -------
        str or None
            The path as a string (this is the hot path of every read), or ``None``.
        """
        return self.engine.ready(self.key(key))

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
        check_confined(self._root_s, key, for_write=False)  # [confine] the engine maps it confined
        return self.engine.consume_bytes(key, timeout)

    def wait_any(self, keys: Sequence[str], timeout: float | None = None) -> str:
        """Wait until one of ``keys`` is published; return the (normalized) key that was.

        Call :meth:`consume` for its content. (In cluster mode, a consumer that fetched the
        key before ``keys[0]`` from another node asks that node for ``keys[0]`` while it
        waits, so the key is usually on this node already when the wait returns.)

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
            check_confined(self._root_s, key, for_write=False)  # [confine] links, dirs, special files
        # Nothing is checked after the wait: it returns a key, not a file. The file is checked
        # where it is opened or handed out (consume, open: the confined openat2); in cluster
        # mode it is usually not even here yet. (The check cost ~25 µs of a remote wake-up.)
        return self.engine.wait_any(keys, timeout)

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
        return self.engine.exists(self.key(key))

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
            A key prefix such as ``"run7/"`` (or an absolute path under the managed
            directory); empty lists everything.

        Returns
        -------
        list of str
            Sorted keys.
        """
        if prefix.rstrip("/"):  # (validated, and an absolute path's made its key prefix)
            norm = normalize_key(prefix.rstrip("/"), self.root)
            prefix = f"{norm}/" if prefix.endswith("/") else norm
        return self.metadata.list(prefix)

    def delete(self, key: str | os.PathLike[str]) -> None:
        """Unpublish ``key`` on this node (and its record, in cluster mode).

        Parameters
        ----------
        key
            The key; no error when it is not published.
        """
        self._delete(self.key(key), mark=True)

    def _retire(self, key: str) -> None:
        """:meth:`delete` of a bounded channel's oldest message, its publication confirmed
        long since (published and answered): no mark of it is left in cluster mode (one per
        message would grow Redis by a key per message for minutes; see
        :meth:`~instride.metadata.redis.RedisMetadata.forget`)."""
        self._delete(self.key(key), mark=False)

    def _delete(self, key: str, *, mark: bool) -> None:
        self._unlink(key)
        forget = getattr(self.engine, "forget_fetched", None)
        if forget is not None:  # (a fetched copy's sidecar: it named a file gone now)
            forget(key)
        unmarked = None if mark else getattr(self.metadata, "forget", None)
        (unmarked or self.metadata.delete)(key)

    def _free_of_stale_copy(self, key: str, path: str) -> None:
        """Before a write-once publication of ``key`` (file ``path``) on this node: a copy of
        the key fetched here before its owner deleted it (no record now) is no publication,
        and must not refuse this one (cluster mode; a ``lexists`` where nothing is there)."""
        drop = getattr(self.engine, "drop_unrecorded_copy", None)
        if drop is not None and os.path.lexists(path):
            drop(key)

    def _unlink(self, key: str) -> None:
        """Remove the file of ``key`` (normalized) on this node, if any; its record stays."""
        confined_path(self.root, key, for_write=True)  # [confine] never unlink through a link
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)

    def gc(self, min_age: float = 0.0) -> list[Path]:
        """Remove temporary files of dead producers, and the files kept for reuse by fetches
        (the node's receive pool, :mod:`instride.store.recvpool`).

        Parameters
        ----------
        min_age
            Also remove temporary files older than this many seconds (PID reuse).

        Returns
        -------
        list of pathlib.Path
            The files removed. See :func:`instride.store.collect_garbage`.
        """
        return (store.collect_garbage(self.root, min_age=min_age) + collect_pools(self.root)
                + ReceivePool(self.settings.internal_dir / "recv").clear())


_default: tuple[tuple[object, ...], Client] | None = None


_default_lock = threading.Lock()


def get_client() -> Client:
    """The process-wide client for the current ``INSTRIDE_*`` environment.

    A new client replaces the old one when the environment changes; the old one is not
    closed (another thread may still be using it) and is released when garbage-collected.
    """
    global _default
    env = env_snapshot()
    current = _default
    if current is not None and current[0] == env:
        return current[1]
    with _default_lock:
        if _default is None or _default[0] != env:
            _default = (env, Client())
        return _default[1]


__all__ = ["Client", "ensure_private_dir", "file_checksum", "file_system_type", "get_client"]
