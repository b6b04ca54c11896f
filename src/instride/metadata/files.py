"""Local-mode metadata: the file system is the record.

A key is published exactly when a file exists under its final name; waiting is an inotify
watch (see :mod:`instride.store.wait`). Records are derived from ``stat``; no checksum is kept.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from .. import store
from ..config import INTERNAL_DIRNAME, Settings
from ..errors import FileTypeError, KeyValidationError, UnsafePathError
from ..keys import normalize_key
from ..paths import check_confined, check_parents
from ..record import Record


class FileMetadata:
    """Metadata backend for one node: keys are files under the managed directory."""

    name = "files"

    def __init__(self, settings: Settings) -> None:
        self.root = settings.dir
        self.owner = settings.addr
        self.node = settings.node
        self.spin = settings.spin  # seconds a wait busy-polls before it sleeps

    def _record(self, key: str, st: os.stat_result) -> Record:
        return Record(key, self.owner, st.st_size, None, 1, st.st_mtime, self.node)

    def publish(self, record: Record, *, overwrite: bool = True) -> Record:
        """Nothing to record: the atomic rename already published the file."""
        return record

    def lookup(self, key: str) -> Record | None:
        """A record built from ``lstat``, or ``None`` when no key's file is there.

        Only a regular file reached through directories only is a key (as ``open`` has it):
        for a symbolic link, a directory or a special file on the way or under the key this is
        ``None``, and nothing beyond a link is looked at (it may be outside the managed
        directory).
        """
        try:
            check_parents(self.root, key)
            st = os.lstat(f"{self.root}/{key}")
        except (OSError, UnsafePathError, FileTypeError):  # (EACCES too: no key to see)
            return None
        return self._record(key, st) if stat.S_ISREG(st.st_mode) else None

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> Record:
        """Block until one of ``keys`` exists (inotify); :class:`ConsumeTimeout` after ``timeout``.

        The key returned is a regular file reached through directories only; a symbolic link
        or a special file on the way raises (:class:`~instride.errors.UnsafePathError`,
        :class:`~instride.errors.FileTypeError`).
        """
        start = time.monotonic()
        root = str(self.root)
        while True:
            remaining = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
            i = store.wait_keys(root, keys, remaining, label=keys[0], refuse=self._refuse,
                                spin=self.spin)
            record = self.lookup(keys[i])
            if record is not None:
                return record
            # deleted right after it appeared: keep waiting within the same deadline

    def _refuse(self, key: str) -> None:
        check_confined(self.root, key, for_write=False)  # [confine] names what is in the way

    def delete(self, key: str) -> None:
        """Remove the key's file."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / key)

    def list(self, prefix: str = "") -> list[str]:
        """Keys (regular files, minus instride's internals and temporary files) starting with
        ``prefix`` (a normalized key prefix). A file whose name no key can have (reserved, a
        control character, no UTF-8: put there by other means) is no key, and not listed.

        No symbolic link is followed, nor listed (``open`` refuses one): a directory reached
        through one holds no keys, whatever is beyond it.
        """
        base, _, _ = prefix.rpartition("/")
        if base:
            try:
                check_parents(self.root, f"{base}/x")  # (the directories on the way, and base)
            except (UnsafePathError, FileTypeError):
                return []
        out: list[str] = []
        todo = [base]
        while todo:
            rel = todo.pop()
            try:
                entries = list(os.scandir(f"{self.root}/{rel}" if rel else self.root))
            except OSError:  # (gone meanwhile, or unreadable: skipped, as os.walk did)
                continue
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    if not entry.name.startswith(INTERNAL_DIRNAME) and \
                            (key.startswith(prefix) or prefix.startswith(f"{key}/")):
                        todo.append(key)
                elif entry.is_file(follow_symlinks=False) and key.startswith(prefix) \
                        and self._is_key(key):
                    out.append(key)
        return sorted(out)

    def _is_key(self, key: str) -> bool:
        """Whether ``key`` (a file's path under the root) is a key, as ``open`` reads names."""
        try:
            return normalize_key(key, self.root) == key
        except KeyValidationError:
            return False

    def close(self) -> None:
        """Nothing to release."""


def ensure_root(root: Path) -> None:
    """Create the managed directory if needed."""
    root.mkdir(parents=True, exist_ok=True)
