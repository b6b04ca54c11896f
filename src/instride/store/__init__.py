"""Node-local storage: atomic publication, waiting, garbage collection, the managed directory.

==================  ==========================================================================
module              job
==================  ==========================================================================
``publish``         write under a hidden temporary name, fsync, rename into place; writer files
``wait``            block until a file appears (inotify, no lost wake-up)
``gc``              remove temporary files of producers that died mid-write
``dirs``            the managed directory's permissions and file system; file checksums
``served``          which files of the directory may be served or recorded (regular, inside)
``ring``            recycled frame files of streams: the producer's pool, the readers' leases
``streamstate``     a stream's head, policy and consumer groups (files here, Redis in a cluster)
==================  ==========================================================================

Everything here works on one node's files; nothing knows about modes, metadata or peers.
"""

from __future__ import annotations

from .dirs import ensure_private_dir, file_checksum, file_checksum_and_size, file_system_type
from .gc import being_written, collect_garbage, iter_tmp_files, pid_alive
from .publish import (
    READ_MODES,
    WRITE_MODES,
    PublishHook,
    check_mode,
    fsync_dir,
    mark_writing,
    open_for_write,
    publish_file,
    read_error,
)
from .wait import wait_any, wait_keys

__all__ = [
    "READ_MODES",
    "WRITE_MODES",
    "PublishHook",
    "being_written",
    "check_mode",
    "collect_garbage",
    "ensure_private_dir",
    "file_checksum",
    "file_checksum_and_size",
    "file_system_type",
    "fsync_dir",
    "iter_tmp_files",
    "mark_writing",
    "open_for_write",
    "pid_alive",
    "publish_file",
    "read_error",
    "wait_any",
    "wait_keys",
]
