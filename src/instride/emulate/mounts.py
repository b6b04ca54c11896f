"""The emulated nodes' file system: a tmpfs with huge pages, mounted for a cluster and removed.

A node's managed directory is usually a tmpfs (``/dev/shm``), whose files are made of 4 KiB
pages. On a VM that hands freed memory back to its host, every new page of a new file costs a
fault in the host too: writing a new 28 MiB file took ~12 ms on ``/dev/shm`` here, ~3 ms on a
tmpfs mounted with ``huge=within_size`` (whose files of 2 MiB and more are made of huge pages,
and smaller writes of large folios). :class:`~instride.emulate.EmulatedCluster` mounts one for its
nodes when asked (``huge_pages=True``, ``instride cluster up --huge-pages``); on a real node the
administrator mounts it (``mount -t tmpfs -o huge=within_size``; docs/cluster.md, "Huge
pages for the managed directory").
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .netns import ClusterError

#: the mount options of a huge-page tmpfs (its size: the kernel's default, half the memory)
HUGE_OPTIONS = "huge=within_size,mode=0755"


def mount_huge_tmpfs(path: Path) -> None:
    """Mount a tmpfs with huge pages on the empty directory ``path``.

    Raises
    ------
    ClusterError
        ``path`` is not an empty directory, ``mount`` is missing, or the kernel refused (not
        root, or a kernel without huge pages for tmpfs: its message is in the error).
    """
    if not path.is_dir() or any(path.iterdir()):
        raise ClusterError(f"cannot mount a huge-page tmpfs on {path}: not an empty directory")
    exe = shutil.which("mount")
    if exe is None:
        raise ClusterError("the `mount` command (util-linux) is not installed; "
                           "apt-get install mount")
    proc = subprocess.run([exe, "-t", "tmpfs", "-o", HUGE_OPTIONS, "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"mounting a tmpfs with huge pages ({HUGE_OPTIONS}) on {path} failed:"
                           f" {proc.stderr.strip() or f'exit status {proc.returncode}'}")


def is_mount(path: Path) -> bool:
    """Whether ``path`` is a mount point (listed in ``/proc/self/mounts``)."""
    target = str(path)
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        return any(line.split()[1].replace("\\040", " ") == target for line in fh if line.strip())


def mount_options(path: Path) -> str | None:
    """The options ``path`` is mounted with (``None``: not a mount point); the last mount wins."""
    found = None
    target = str(path)
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 4 and fields[1].replace("\\040", " ") == target:
                found = fields[3]
    return found


def unmount(path: Path) -> None:
    """Unmount ``path`` if it is a mount point (its files go with it); lazily if it is busy."""
    if not is_mount(path):
        return
    exe = shutil.which("umount") or "umount"
    proc = subprocess.run([exe, str(path)], capture_output=True, text=True)
    if proc.returncode != 0 and is_mount(path):
        subprocess.run([exe, "-l", str(path)], capture_output=True, text=True)


__all__ = ["HUGE_OPTIONS", "is_mount", "mount_huge_tmpfs", "mount_options", "unmount"]
