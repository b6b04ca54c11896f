"""A real Slurm of emulated nodes for the launcher tests (root, slurm-wlm, munge needed).

Without Slurm or root, :class:`EmulatedSlurm` raises ``ClusterError`` and the tests fail
loudly (``make test`` installs ``slurm-wlm`` and ``munge``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate.slurm import EmulatedSlurm

PY = sys.executable


@pytest.fixture(scope="module")
def slurm() -> Iterator[EmulatedSlurm]:
    """Three emulated Slurm nodes, shared by the tests of one module."""
    with EmulatedSlurm(nodes=3, kill_wait=8) as cluster:
        yield cluster
        leftovers = settle(cluster)
    assert leftovers == {}


def job_script(slurm: EmulatedSlurm, body: str, *, states: Path) -> str:
    """A batch script: the services' state directory, then ``body``."""
    return f"#!/bin/sh\nexport INSTRIDE_JOB_STATE_DIR={states}\n{body}\n"


def settle(slurm: EmulatedSlurm, timeout: float = 20.0) -> dict[str, list[int]]:
    """Wait until no process but slurmd is left on any node; return what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = {n.name: slurm.node_pids(n.index) for n in slurm.nodes}
        if not any(left.values()) or time.monotonic() > deadline:
            return {k: v for k, v in left.items() if v}
        time.sleep(0.1)


def tree(path: Path) -> list[str]:
    """Every path under ``path`` (for 'nothing left behind' checks)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short-named scratch directory (a managed directory's Unix socket path is bounded)."""
    path = Path(tempfile.mkdtemp(prefix="isl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)
