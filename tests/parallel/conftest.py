"""Fixtures for parallel analysis: the adk trajectory as DCD, H5MD and an instride stream.

The data are built once per session in their own managed directory (explicit client, no
environment change); the function fixture ``adk`` points ``INSTRIDE_DIR`` at it for one test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from instride.client import Client
from instride.config import Settings

_INSTRIDE_VARS = ("INSTRIDE_REDIS_URL", "INSTRIDE_TOKEN", "INSTRIDE_TIMEOUT",
                  "INSTRIDE_CACHE_BYTES", "INSTRIDE_ADDR", "INSTRIDE_SOCKET", "INSTRIDE_NODE",
                  "INSTRIDE_PATCH_OPEN")


@dataclass
class AdkData:
    psf: str
    dcd: str
    h5: str  # H5MD exported from the stream
    managed: Path  # INSTRIDE_DIR holding streams "adk" (98 frames) and "one" (1 frame)
    rmsd: np.ndarray  # MDAnalysis serial RMSD (n, 3): frame, time, rmsd
    rg: np.ndarray  # MDAnalysis serial radius of gyration of "protein"
    n_frames: int


def mpiexec() -> str:
    """The venv's mpiexec (mpich wheel); fails loudly when missing."""
    exe = Path(sys.executable).parent / "mpiexec"
    assert exe.exists(), f"{exe} missing: pip install mpich mpi4py (the [test] extra)"
    return str(exe)


def run(cmd: list[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess:
    """Run a command to completion (killed by PID on timeout), capturing text output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"{cmd} timed out\nstdout: {out}\nstderr: {err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def adk_data(tmp_path_factory: pytest.TempPathFactory) -> AdkData:
    import MDAnalysis as mda
    from MDAnalysis.analysis.rms import RMSD
    from MDAnalysisTests.datafiles import DCD, PSF

    from instride import Stream
    from instride.parallel import ADK_CORE_CA, export_h5md

    root = tmp_path_factory.mktemp("adk")
    managed = root / "managed"
    managed.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = mda.Universe(PSF, DCD)
    client = Client(Settings.from_env({"INSTRIDE_DIR": str(managed)}))
    try:
        with Stream("adk", mode="w", layout="xyz32", client=client) as s:
            for ts in u.trajectory:
                s.append(u.atoms.positions, step=ts.frame, time=ts.time, box=None)
        with Stream("one", mode="w", layout="xyz32", client=client) as s:
            s.append(u.trajectory[0].positions, step=0, time=0.0)
    finally:
        client.close()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("INSTRIDE_DIR", str(managed))
        for var in _INSTRIDE_VARS:
            mp.delenv(var, raising=False)
        h5 = export_h5md("instride://adk", root / "adk.h5", timeout=30)
    rmsd = RMSD(u, select=ADK_CORE_CA).run().results.rmsd.copy()
    protein = u.select_atoms("protein")
    rg = np.array([protein.radius_of_gyration() for _ in u.trajectory])
    return AdkData(PSF, DCD, str(h5), managed, rmsd, rg, u.trajectory.n_frames)


@pytest.fixture
def adk(adk_data: AdkData, monkeypatch: pytest.MonkeyPatch) -> AdkData:
    """``adk_data`` with ``INSTRIDE_DIR`` pointing at its managed directory (local mode)."""
    monkeypatch.setenv("INSTRIDE_DIR", str(adk_data.managed))
    for var in _INSTRIDE_VARS:
        monkeypatch.delenv(var, raising=False)
    return adk_data


def instride_cmd(*args: str) -> list[str]:
    """``python -m instride ARGS`` with the test's interpreter."""
    return [sys.executable, "-m", "instride", *args]


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env
