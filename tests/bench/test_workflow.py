"""The ranks of the workflow (:mod:`instride.bench.workflow`): what their clocks include."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from instride.bench.results import read_timings
from instride.bench.workflow_run import RunConfig, run


def test_producer_builds_its_emulator_before_its_clock_starts(tmp_path: Path) -> None:
    # 3 M atoms: building the emulator (random coordinates, the payload) takes ~0.3 s in a
    # fresh process; none of it may count in the run (it delayed the first MD stride, and
    # with it the consumer's first wait)
    cfg = RunConfig(atoms=3_000_000, frames=2, pairs=1, backend="localfs", time_scale=0.01,
                    timeout=120.0, workdir=str(tmp_path / "work"))
    run(cfg, tmp_path / "out", progress=False)
    first = [r for r in read_timings(tmp_path / "out" / "timings.csv")
             if r["role"] == "producer" and r["frame"] == 0 and r["region"] == "produce.md"]
    assert len(first) == 1
    assert first[0]["start_s"] < 0.1, first  # right at time 0 (generous: a loaded machine)


def test_the_package_does_not_import_the_rank_module() -> None:
    # the ranks run `python -m instride.bench.workflow`: a package that imported it already
    # made runpy warn on every rank and run the module twice
    code = ("import sys, instride.bench, instride.bench.workflow_run, instride.bench.study; "
            "print('instride.bench.workflow' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_ranks_print_no_runpy_warning(tmp_path: Path) -> None:
    cfg = RunConfig(atoms=500, frames=2, pairs=1, backend="localfs", time_scale=0.005,
                    timeout=60.0, workdir=str(tmp_path / "work"))
    run(cfg, tmp_path / "out", progress=False)
    log = (tmp_path / "out" / "raw" / "rep0" / "mpiexec.log").read_text()
    assert "RuntimeWarning" not in log, log
