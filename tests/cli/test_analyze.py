"""``instride analyze``: options that would be ignored are refused (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest
from MDAnalysisTests.datafiles import DCD, PSF

from instride.cli import main


@pytest.mark.parametrize(("workers", "backend"), [(["--workers", "2"], "multiprocessing"),
                                                  ([], "serial"), ([], "multiprocessing")])
def test_straggle_of_a_rank_that_does_not_exist_is_refused(
        workers: list[str], backend: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--straggle 7:0.01 --workers 2` ran with exit 0 and never applied the delay."""
    out = tmp_path / "out"
    code = main(["analyze", "rg", "--topology", PSF, "--trajectory", DCD, "--backend", backend,
                 *workers, "--straggle", "7:0.01", "--out", str(out), "--no-plot"])
    assert code == 2
    assert "--straggle" in capsys.readouterr().err
    assert not out.exists()
