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


def _ctrl_c() -> None:
    """A Ctrl-C landing right here (Python raises it at its next check, in this thread)."""
    import signal

    os.kill(os.getpid(), signal.SIGINT)


def _up_interrupted(monkeypatch: pytest.MonkeyPatch) -> EmulatedSlurm:
    """A one-node ``EmulatedSlurm`` whose ``up()`` the patches in place interrupt (Ctrl-C):
    it must raise ``KeyboardInterrupt``; the patches are undone either way."""
    slurm = EmulatedSlurm(nodes=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            slurm.up()
    finally:
        monkeypatch.undo()
    return slurm


@pytest.mark.parametrize("where", ["hub", "node"])
def test_a_ctrl_c_as_a_namespace_is_made_leaves_no_namespace(
        monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A Ctrl-C between `ip netns add` and the record of the name left a namespace that
    down() never deleted (it deletes the names recorded only)."""
    import re

    real_ip = nn.ip
    pattern = re.compile(r"isl\d+h" if where == "hub" else r"isl\d+n1")
    made: list[str] = []

    def ip(*args: str, check: bool = True):  # type: ignore[no-untyped-def]
        proc = real_ip(*args, check=check)
        if args[:2] == ("netns", "add") and pattern.fullmatch(args[2]) and not made:
            made.append(args[2])
            _ctrl_c()
        return proc

    monkeypatch.setattr(nn, "ip", ip)
    try:
        slurm = _up_interrupted(monkeypatch)
    finally:
        leaked = [ns for ns in made if ns in nn.list_netns()]
        for ns in leaked:  # (before the fix: removed here, by its name)
            nn.del_netns(ns)
    assert made and not leaked
    assert not slurm.base_dir.exists()


def test_a_ctrl_c_as_munged_starts_leaves_no_munged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while Popen started munged left it running: never recorded, so never stopped
    (it runs in the host's namespace, where no kill_all finds it), its directory removed."""
    import signal
    import subprocess

    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(argv, *args, **kwargs):  # type: ignore[no-untyped-def]
        proc = real_popen(argv, *args, **kwargs)
        if not started and isinstance(argv, list) and argv[0].endswith("munged"):
            started.append(proc)
            _ctrl_c()
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        slurm = _up_interrupted(monkeypatch)
    finally:
        alive = [p for p in started if p.poll() is None]
        for p in alive:  # (before the fix: stopped here, by its PID)
            p.send_signal(signal.SIGTERM)
            p.wait(10)
    assert started and not alive
    assert not slurm.base_dir.exists()
    assert not [ns for ns in nn.list_netns() if slurm.k and ns.startswith(f"isl{slurm.k}")]
