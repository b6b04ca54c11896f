"""The managed directory itself: its file-system type, the checksum of a file in it."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from instride.errors import FileTypeError
from instride.record import checksum_of
from instride.store.dirs import file_checksum, file_checksum_and_size


def _in_mount_namespace(script: str, tmp_path: Path) -> str:
    """Run ``script`` (sh) in a mount namespace of its own (the suite runs as root, with
    util-linux's ``unshare``: where either is missing this fails, loudly)."""
    assert shutil.which("unshare") is not None, "needs unshare(1) (util-linux)"
    out = subprocess.run(["unshare", "-m", "sh", "-ec", script], capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_type_is_the_file_system_mounted_last_over_the_path(tmp_path: Path) -> None:
    """A file system mounted over another at the same mount point hides it, but the type was
    the first one's (the first line of ``/proc/self/mountinfo`` that matched): a directory on
    a disk (or NFS) mounted over a tmpfs was called tmpfs — publications skipped the fsync
    asked for, and closed their files after publishing them (no deferred write error seen).
    The same for a mount hidden with the directory it was made in."""
    probe = textwrap.dedent(
        f"""
        from instride.store.dirs import file_system_type
        print(file_system_type({str(tmp_path / "over")!r}),
              file_system_type({str(tmp_path / "under" / "inner")!r}))
        """
    )
    (tmp_path / "probe.py").write_text(probe)
    script = textwrap.dedent(
        f"""
        mkdir -p over under
        mount -t tmpfs none over
        mount -t ramfs none over
        mount -t ramfs none under
        mkdir under/inner
        mount -t tmpfs none under/inner
        mount -t ramfs none under
        mkdir under/inner
        {sys.executable} probe.py
        """
    )
    assert _in_mount_namespace(script, tmp_path) == "ramfs ramfs"


def test_a_checksum_of_a_file_truncated_meanwhile_does_not_kill_the_process(
        tmp_path: Path) -> None:
    """The checksum of a file to register (``Client.register``: a thin client's ``PUBLISH``,
    computed in its node's server) was taken through a memory mapping: a file cut short while
    it was read (another process truncating it) was a ``SIGBUS`` — the process (the node's
    server, for every thin client of the node) was killed. Now it reads the file: a
    truncated file has a checksum of what was read (which the readers' check refuses)."""
    path = tmp_path / "shrinking.bin"
    path.write_bytes(b"")
    code = textwrap.dedent(
        f"""
        import time
        from instride.store.dirs import file_checksum
        end = time.monotonic() + 3
        n = 0
        while time.monotonic() < end:
            file_checksum({str(path)!r})
            n += 1
        print(n)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            while child.poll() is None:  # (sparse: no memory spent on the bytes)
                os.ftruncate(fd, 32 << 20)
                os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode != -signal.SIGBUS, "killed by SIGBUS"
    assert child.returncode == 0 and int(out) > 0


def test_a_checksum_is_of_a_regular_file_only(tmp_path: Path) -> None:
    """A FIFO in the file's place (swapped in after the caller's check) made the checksum's
    ``open`` wait for a writer for ever; a directory raised ``IsADirectoryError``."""
    data = os.urandom(3 << 20)
    (tmp_path / "f.bin").write_bytes(data)
    assert file_checksum(tmp_path / "f.bin") == checksum_of(data)
    assert file_checksum_and_size(tmp_path / "f.bin") == (checksum_of(data), len(data))
    (tmp_path / "empty.bin").write_bytes(b"")
    assert file_checksum(tmp_path / "empty.bin") == checksum_of(b"")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileTypeError) as err:
        file_checksum(tmp_path / "fifo")
    assert err.value.errno == errno.EINVAL
    with pytest.raises(FileTypeError) as err:
        file_checksum(tmp_path)
    assert err.value.errno == errno.EISDIR  # (as FileTypeError documents for a directory)
    os.symlink(tmp_path / "fifo", tmp_path / "link")
    with pytest.raises(FileTypeError):
        file_checksum(tmp_path / "link")
