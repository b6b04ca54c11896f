"""The emulated Slurm itself: real slurmctld, one slurmd per namespace, distinct host names.

Needs root, slurm-wlm and munge (``make test`` installs them); without them EmulatedSlurm
raises ClusterError and this test fails loudly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from instride.emulate import netns as nn
from instride.emulate.slurm import EmulatedSlurm

pytestmark = pytest.mark.root


def test_emulated_slurm_runs_a_job_on_distinct_hosts_and_leaves_nothing(tmp_path: Path) -> None:
    slurm = EmulatedSlurm(nodes=3)
    with slurm:
        namespaces = [slurm.hub, *(n.netns for n in slurm.nodes)]
        assert set(namespaces) <= set(nn.list_netns())
        base = slurm.base_dir
        out = tmp_path / "out.txt"
        job = slurm.sbatch("#!/bin/sh\nsrun -N3 -n3 sh -c 'echo $(hostname) $SLURMD_NODENAME'\n",
                           "-N", "3", f"--output={out}")
        assert slurm.wait(job, timeout=60) == "COMPLETED"
        lines = sorted(out.read_text().split("\n"))[1:]
        assert lines == ["node1 node1", "node2 node2", "node3 node3"]
        info = slurm.job(job)
        assert info["ExitCode"] == "0:0" and info["NumNodes"] == "3"
        assert slurm.squeue() == []
        daemons = [p.pid for p in slurm._procs.values()]
    assert not base.exists()
    assert not set(namespaces) & set(nn.list_netns())
    assert not [pid for pid in daemons if os.path.exists(f"/proc/{pid}")]
