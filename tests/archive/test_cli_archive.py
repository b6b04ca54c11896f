"""``instride archive``: a failed archive leaves no directories behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_an_archive_into_missing_directories_is_refused_and_makes_none(
        managed_dir: Path, tmp_path: Path) -> None:
    """`--to a/b/c/x.h5` used to create a/b/c before anything was known to work: a failed
    archive (a typo in --to, a stream not there yet) left that tree behind."""
    target = tmp_path / "a" / "b" / "c" / "x.h5"
    out = subprocess.run([sys.executable, "-m", "instride", "archive", "nostream", "--to",
                          str(target), "--timeout", "0", "-q"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1, (out.stdout, out.stderr)  # (an ArchiveError, as for a file
    # that cannot be used as the archive)
    assert f"{tmp_path / 'a'}" in out.stderr and "does not exist" in out.stderr
    assert not (tmp_path / "a").exists()
