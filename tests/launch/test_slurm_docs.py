"""The example of docs/slurm.md, run as written on the emulated Slurm (fewer MD steps).

Only what cannot work on emulated nodes is changed: the ``#SBATCH`` resource lines and the
site-specific ``module``/``source`` lines are dropped (the venv's ``bin`` goes on ``PATH``
instead), and ``--dir`` gets ``%n`` because the
emulated nodes share one ``/dev/shm``.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from instride.emulate.slurm import EmulatedSlurm

from .conftest import settle, tree

pytestmark = pytest.mark.root

DOC = Path(__file__).resolve().parents[2] / "docs" / "slurm.md"


def doc_files() -> dict[str, str]:
    """The code blocks of docs/slurm.md announced by ``<!-- file: NAME -->``."""
    text = DOC.read_text()
    return {m.group(1): m.group(2) for m in re.finditer(
        r"<!-- file: (\S+) -->\n```\w*\n(.*?)\n```", text, re.S)}


def test_slurm_docs_example_runs_as_written(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    files = doc_files()
    assert set(files) == {"replica.py", "analyse.py", "job.sbatch"}
    for name in ("replica.py", "analyse.py"):
        (tmp_path / name).write_text(files[name] + "\n")
    script = "\n".join(
        line for line in files["job.sbatch"].splitlines()
        if not line.startswith("#SBATCH") and "site-specific" not in line)
    assert '--dir "/dev/shm/$USER-instride-%j"' in script
    script = script.replace('"/dev/shm/$USER-instride-%j"', f"{scratch}/%n-%j")
    states = tmp_path / "states"
    out = tmp_path / "out.txt"
    job = slurm.sbatch(script + "\n", "-N", "2", f"--output={out}", cwd=tmp_path,
                       env={"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                            "REPLICAS": "1", "STEPS": "20", "INTERVAL": "10",
                            "INSTRIDE_JOB_STATE_DIR": str(states)})
    state = slurm.wait(job, timeout=240)
    text = out.read_text()
    assert state == "COMPLETED", text
    nodes = slurm.run(["scontrol", "show", "hostnames", slurm.job(job)["NodeList"]],
                      capture_output=True, text=True).stdout.split()
    assert f"replica 0 on {nodes[0]}: 2 frames published" in text
    assert f"analytics 0 on {nodes[1]}: 2 frames" in text
    rows = (tmp_path / "results" / "replica0" / "analytics.csv").read_text().splitlines()
    assert len(rows) == 3  # header + one row per frame
    assert "rmsd" in rows[0] and "H1" in rows[0], rows[0]  # (the eigenvalues the text promises)
    assert settle(slurm) == {}
    assert tree(scratch) == []
    assert tree(states) == []
