"""``instride bench study --launcher slurm``: the study's runs as real Slurm batch jobs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from instride.bench.study import run_study

pytestmark = pytest.mark.root


def test_slurm_study_runs_each_repetition_as_a_batch_job(tmp_path: Path) -> None:
    before = set(Path("/dev/shm").glob("isb*"))
    study = run_study("tiny", tmp_path / "study", experiments=("two_node",), progress=False,
                      launcher="slurm")
    assert study["launcher"] == "slurm"
    assert [r["summary"]["config"]["backend"] for r in study["results"]] == [
        "instride", "sharedfs"]
    for result in study["results"]:
        summary = result["summary"]
        assert summary["config"]["launcher"] == "slurm"
        assert summary["frames"]["verified"] == summary["frames"]["expected"] == 3
        run_dir = tmp_path / "study" / "runs" / "two_node" / summary["config"]["name"]
        job = json.loads((run_dir / "raw" / "rep0" / "job.json").read_text())
        assert job["JobState"] == "COMPLETED" and job["NumNodes"] == "2"
        hosts = (run_dir / "raw" / "rep0" / "hosts").read_text().split()
        assert hosts == ["node1", "node2"]  # producer on the first node, consumer on the second
    assert (tmp_path / "study" / "report.md").exists()
    assert set(Path("/dev/shm").glob("isb*")) == before  # managed directories removed
