"""The emulated nodes' huge-page tmpfs: mounted on an empty directory only, and unmounted even
while a process still works in it (a lazy unmount: the files go once the last user leaves).

Needs root (``mount``); without it the mount raises ClusterError and these tests fail loudly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate import ClusterError, mounts

pytestmark = pytest.mark.root


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[Path]:
    """A huge-page tmpfs on a new directory, unmounted at the end whatever happened."""
    point = tmp_path / "huge"
    point.mkdir()
    mounts.mount_huge_tmpfs(point)
    try:
        yield point
    finally:
        if mounts.is_mount(point):
            subprocess.run(["umount", "-l", str(point)], check=False)


def test_the_mount_has_huge_pages_and_a_plain_unmount_removes_it(mounted: Path) -> None:
    options = mounts.mount_options(mounted) or ""
    assert "huge=within_size" in options.split(","), options
    (mounted / "frame").write_bytes(b"x" * 4096)
    mounts.unmount(mounted)
    assert not mounts.is_mount(mounted)
    assert mounts.mount_options(mounted) is None
    assert list(mounted.iterdir()) == []  # the file went with the tmpfs
    mounts.unmount(mounted)  # not a mount point any more: nothing to do, no error


def test_a_busy_mount_is_unmounted_lazily(mounted: Path) -> None:
    """A process whose working directory is on the tmpfs makes a plain ``umount`` fail (busy);
    the lazy fallback detaches the mount at once all the same."""
    user = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], cwd=mounted,
                            stdin=subprocess.PIPE)
    try:
        plain = subprocess.run(["umount", str(mounted)], capture_output=True, text=True)
        assert plain.returncode != 0 and mounts.is_mount(mounted), plain  # busy, as it should be
        mounts.unmount(mounted)
        assert not mounts.is_mount(mounted)
        assert user.poll() is None  # the user was not disturbed
    finally:
        assert user.stdin is not None
        user.stdin.close()
        try:
            user.wait(10)
        except subprocess.TimeoutExpired:
            user.kill()  # (its own PID)
            user.wait(10)


def test_only_an_empty_directory_is_mounted_on(tmp_path: Path) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine").write_text("kept")
    with pytest.raises(ClusterError, match="not an empty directory"):
        mounts.mount_huge_tmpfs(full)
    with pytest.raises(ClusterError, match="not an empty directory"):
        mounts.mount_huge_tmpfs(tmp_path / "missing")
    assert (full / "mine").read_text() == "kept" and not mounts.is_mount(full)
