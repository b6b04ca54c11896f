"""The local engine: one node, the file system is the metadata, inotify is the wake-up.

A key is published exactly when a file exists under its final name; a reader of a missing key
waits on an inotify watch (:mod:`instride.store.wait`). No server, no network, no checksum.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import store
from ..config import Settings
from ..keys import key_path, recyclable
from ..metadata import get_backend
from ..paths import ConfinedOpener, check_confined
from ..record import Record
from ..store.streamstate import LocalStreamState
from .base import map_file


class LocalEngine:
    """Engine of local mode (``INSTRIDE_REDIS_URL`` unset).

    Parameters
    ----------
    settings
        Supplies the managed directory, the node name and address (for records).
    """

    name = "local"

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.root = settings.dir
        self._root_s = str(settings.dir)
        self.metadata = get_backend("files", settings)
        self.confined = ConfinedOpener(self.root)  # [confine] maps keys, never through links

    def ready(self, key: str) -> str | None:
        """The file of ``key`` if it exists (one ``stat``)."""
        path = f"{self._root_s}/{key}"  # strings, not pathlib, on this hot path
        return path if os.access(path, os.F_OK) else None  # (exists() raises per miss)

    def consume(self, key: str, timeout: float | None) -> Path:
        """The file of ``key``, waiting for it with inotify if needed.

        Checked confined (a regular file reached through directories only) before and right
        after the wait, by :func:`instride.store.wait.wait_keys`.
        """
        store.wait_keys(self._root_s, [key], timeout, label=key, refuse=self._refuse,
                        spin=self.settings.spin)
        return key_path(key, self.root)

    def _refuse(self, key: str) -> None:
        check_confined(self._root_s, key, for_write=False)  # [confine] names what is in the way

    def consume_bytes(self, key: str, timeout: float | None) -> memoryview:
        """A read-only memory map of the file of ``key`` (zero copy)."""
        path = self.consume(key, timeout)
        return map_file(path, lambda _p, _f: self.confined.open(key, hold=recyclable(key)))  # [confine]

    def wait_any(self, keys: Sequence[str], timeout: float | None) -> str:
        """The first of ``keys`` whose file exists (checked confined), waiting for one if none does."""
        return self.metadata.wait_any(list(keys), timeout).key

    def exists(self, key: str) -> bool:
        """Whether ``key`` is published: a regular file reached through directories only.

        A symbolic link, a directory or a special file is no key (``open`` refuses it), and
        nothing beyond a link is looked at: it may be outside the managed directory.
        """
        return self.metadata.lookup(key) is not None

    #: local mode records no checksum: writers need not compute one
    wants_checksum = False
    #: consume checks what it returns (in the wait, right after the wake-up)
    confines = True

    def published(self, key: str, overwrite: bool, checksum: str | None = None,
                  size: int | None = None, *, then: Sequence[tuple[Any, ...]] = ()) -> None:
        """Nothing to record: the atomic rename was the publication."""

    def retired(self, key: str) -> None:
        """Nothing to forget: moving the file away was the retirement."""

    def drop_copy(self, key: str) -> None:
        """Nothing to drop: every file here is an original."""

    def is_copy(self, key: str) -> bool:
        """Never: every file here is an original."""
        return False

    def frame_path(self, key: str) -> str | None:
        """Where ``key``'s file is (whether or not it exists: opening it tells)."""
        return f"{self._root_s}/{key}"

    def stream_state(self, stream: str) -> LocalStreamState:
        """The stream's head, policy and groups: files of this node."""
        return LocalStreamState(self.root, stream)

    def register(self, key: str, *, overwrite: bool, checksum: str | None = None,
                 size: int | None = None) -> Record:
        """A record built from ``stat`` (no checksum); nothing is stored."""
        st = key_path(key, self.root).stat()
        record = Record(key=key, owner=self.settings.addr, size=st.st_size, checksum=None,
                        version=1, time=time.time(), node=self.settings.node)
        return self.metadata.publish(record, overwrite=overwrite)

    def close(self) -> None:
        """Release the metadata backend and the directory descriptor (reopened when needed)."""
        self.confined.close()
        self.metadata.close()


__all__ = ["LocalEngine"]
