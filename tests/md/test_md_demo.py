"""`instride demo` end to end (tiny run), and its clean-up on Ctrl-C."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import finish


def _children(pid: int) -> set[int]:
    """PIDs of all descendants of ``pid`` (from /proc)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for k in map(int, kids):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_demo_runs_both_workflows_and_writes_outputs(managed_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo-output"
    proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "demo", "--out", str(out), "--steps", "30",
         "--interval", "10", "--replicas", "1", "--timeout", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    rc, stdout, err = finish(proc, timeout=240)
    assert rc == 0, err
    with open(out / "summary.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["workflow"] for r in rows] == ["instride", "localfs+barrier"]
    for r in rows:
        assert int(r["frames"]) == 3
        assert int(r["bytes"]) == 3 * (128 + 8867 * 12)
        assert float(r["consumer_idle_s"]) > 0 and float(r["producer_overhead_s"]) > 0
    assert "producer overhead, localfs+barrier / instride" in stdout
    assert (out / "summary.txt").read_text().strip() in stdout
    for wf in ("instride", "localfs+barrier"):
        table = (out / wf / "replica0" / "analytics.csv").read_text().splitlines()
        assert table[0].startswith("frame,step,time_ps,rmsd,rgyr,lambda_H1")
        assert len(table) == 4
        assert table[1].startswith("0,10,0.02,")  # no float noise (0.020000000000000004)
        for name in ("rmsd", "rgyr", "lambda_H1_H3"):
            assert (out / wf / "replica0" / f"{name}.png").stat().st_size > 1000
            assert (out / wf / f"{name}.png").stat().st_size > 1000
    # stderr is a pipe here: plain progress lines, no terminal control characters
    assert "instride r0 produced: 3/3 frame" in err and "localfs r0 analysed: 3/3 frame" in err
    assert "\r" not in err and "\x1b" not in err
    # same seed, same trajectory in both workflows
    assert "replica 0: same (every frame, every quantity identical)" in stdout
    assert (out / "performance.png").stat().st_size > 1000
    assert "0.06 ps simulated" in stdout
    assert [p.name for p in managed_dir.iterdir() if not p.name.startswith(".")] == []
    # nor the streams' state (heads, policies, run ids: every run left its own)
    streams = managed_dir / ".instride" / "streams"
    assert not streams.exists() or list(streams.iterdir()) == []


@pytest.mark.slow
def test_demo_ctrl_c_stops_every_process(tmp_path: Path, managed_dir: Path) -> None:
    env = dict(os.environ)
    env.pop("INSTRIDE_DIR")  # the demo makes (and must remove) its own managed directory
    proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "demo", "--out", str(tmp_path / "o"), "--steps",
         "100000", "--interval", "10", "--replicas", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        line = proc.stdout.readline().decode()
        managed = Path(line.rsplit("managed directory ", 1)[1].strip())
        deadline = time.monotonic() + 60
        while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        kids = _children(proc.pid)
        assert len(kids) >= 3, "producer and consumer processes did not start"
        time.sleep(1.0)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        rc = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 130
    time.sleep(0.5)
    assert not [k for k in kids if _alive(k)]
    assert not managed.exists()


def test_demo_rejects_bad_arguments(tmp_path: Path) -> None:
    from instride import ConfigError
    from instride.md.demo import run_demo

    with pytest.raises(ConfigError, match="--steps"):
        run_demo(tmp_path / "o", steps=5, interval=10)
    with pytest.raises(ConfigError, match="multiple"):  # (990 of 1000 steps were simulated)
        run_demo(tmp_path / "o", steps=1000, interval=15)
    with pytest.raises(ConfigError, match="--replicas"):
        run_demo(tmp_path / "o", replicas=0)


def test_a_managed_directory_that_cannot_be_made_is_a_usage_error_and_leaves_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``INSTRIDE_DIR`` naming a file: a ``ConfigError`` (exit status 2), and the demo's
    temporary directory goes (it was made before the cleanup began: left, and exit 1)."""
    from instride import ConfigError
    from instride.md import demo

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(demo, "_node_local_tmp", lambda: str(scratch))
    monkeypatch.setenv("INSTRIDE_DIR", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ConfigError, match="INSTRIDE_DIR"):
        demo.run_demo(tmp_path / "o", steps=15, interval=15)
    assert os.listdir(scratch) == []
    with pytest.raises(ConfigError, match="--timeout"):
        demo.run_demo(tmp_path / "o", timeout=float("nan"))


def test_stopping_children_passes_over_those_not_started() -> None:
    """Ctrl-C while the demo started its processes: the cleanup joined one never started
    (``AssertionError``, exit 1, instead of 130)."""
    import multiprocessing as mp

    from instride.md.demo import _stop

    started = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
    started.start()
    _stop([started, mp.get_context("spawn").Process(target=time.sleep, args=(60,))])
    assert not started.is_alive()
