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


def test_a_sigterm_inside_the_with_block_takes_the_slurm_down() -> None:
    """A process stopped by SIGTERM inside ``with EmulatedSlurm(...)``: its daemons (started
    in sessions of their own), namespaces and directory go first (they used to stay)."""
    import signal
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from instride.emulate.slurm import EmulatedSlurm
        with EmulatedSlurm(nodes=1) as s:
            daemons = [p.pid for p in s._procs.values()]
            print(s.base_dir, *[s.hub, *(n.netns for n in s.nodes)], flush=True)
            print(*daemons, flush=True)
            time.sleep(300)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        base, *namespaces = proc.stdout.readline().split()
        daemons = [int(x) for x in proc.stdout.readline().split()]
        assert daemons and os.path.isdir(base)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == -signal.SIGTERM  # (died of it, after the teardown)
        assert not os.path.exists(base)
        assert not set(namespaces) & set(nn.list_netns())
        assert not [pid for pid in daemons if os.path.exists(f"/proc/{pid}")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
