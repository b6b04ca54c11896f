"""``SlurmBench``: a repetition's batch job never outlives the benchmark that submitted it."""

from __future__ import annotations

from pathlib import Path

import pytest

from instride.bench.slurm import SlurmBench
from instride.bench.workflow_run import RunConfig
from instride.emulate.slurm import EmulatedSlurm

pytestmark = pytest.mark.root


def test_a_ctrl_c_while_a_repetition_runs_cancels_its_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only an InstrideError of the wait led to `scancel`: on Ctrl-C the job ran on (on a real
    Slurm nothing else would stop it) while its files were removed under it."""
    with EmulatedSlurm(nodes=1, cpus=2, kill_wait=2) as slurm:
        shared = slurm.base_dir / "shared"
        shared.mkdir()
        bench = SlurmBench(slurm, shared)
        submitted: list[int] = []
        real_sbatch = slurm.sbatch

        def sbatch(*args, **kwargs):  # type: ignore[no-untyped-def]
            submitted.append(real_sbatch(*args, **kwargs))
            return submitted[-1]

        def wait(job: int, timeout: float = 120.0) -> str:
            raise KeyboardInterrupt  # (Ctrl-C while the repetition runs)

        monkeypatch.setattr(slurm, "sbatch", sbatch)
        monkeypatch.setattr(slurm, "wait", wait)
        # (a run of about 100 s: still running when the Ctrl-C comes)
        cfg = RunConfig(model="JAC", frames=128, backend="localfs", timeout=300.0)
        with pytest.raises(KeyboardInterrupt):
            bench.run_once(cfg, tmp_path / "out", 0)
        monkeypatch.undo()
        assert len(submitted) == 1
        assert slurm.wait(submitted[0], timeout=60) == "CANCELLED"
