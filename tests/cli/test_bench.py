"""``instride bench run/study``: options that would be ignored are refused (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from instride.cli import main


@pytest.mark.parametrize(("argv", "named"), [
    (["study", "--launcher", "slurm", "--sharedfs-kind", "sshfs"], "--sharedfs-kind"),
    (["study", "--launcher", "slurm", "--workdir", "/tmp"], "--workdir"),
    (["run", "--nodes", "2", "--workdir", "/tmp"], "--workdir"),
])
def test_options_that_would_be_ignored_are_refused(
        argv: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They were accepted and silently ignored (sshfs switched to a plain directory, the
    work directory not used): the run measured something other than what was asked."""
    assert main(["bench", *argv, "--out", str(tmp_path / "out"), "-q"]) == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
