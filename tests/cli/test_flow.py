"""``instride flow run/check/draw`` and ``instride top`` as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from instride.cli import EXIT_ERROR, EXIT_INVALID, EXIT_USAGE
from instride.flow.runner import HEARTBEAT_FILE, host
from tests.flow.conftest import flow_env, pythonpath  # noqa: F401 - the fixture

GRAPH = textwrap.dedent("""
    from instride.flow import Graph, patterns
    from tests.flow import modules

    def build(n=3, delay=0.0):
        g = Graph("cli")
        src = g.module("src", modules.numbers, outputs={"out": "array"}, instances=2,
                       params={"n": n, "delay": delay})
        rec = g.module("rec", modules.record, inputs={"in": "array"})
        g.connect(patterns.gather(g, "all", src.output("out")), rec.input("in"))
        return g
""")

BAD = textwrap.dedent("""
    from instride.flow import Graph
    from tests.flow import modules

    graph = Graph("bad")
    graph.module("tot", modules.total, inputs=["frames"], outputs={"sums": "array"})
""")


def cli(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": pythonpath()},
                          **kw)


def test_run_top_and_outputs(flow_env:  # noqa: F811
                              dict[str, Path], tmp_path: Path) -> None:
    graph = tmp_path / "graph.py"
    graph.write_text(GRAPH)
    out = flow_env["out"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "instride", "flow", "run", str(graph), "--out", str(out),
         "-p", "n=40", "-p", "delay=0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": pythonpath()})
    try:
        top = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            top = cli("top", "--once")
            if top.returncode == 0 and "all_l0_0[0]" in top.stdout:
                break
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr
    assert top is not None and top.returncode == 0, top and top.stderr
    header = top.stdout.splitlines()[1].split()
    assert header[:4] == ["instance", "node", "port", "dir"] and "queue" in header
    assert "src[1]" in top.stdout and "rec[0]" in top.stdout
    assert "started src[0] on local" in stdout and "finished rec[0]" in stdout
    got = json.loads((out / "record-0.json").read_text())
    assert [s for s, _ in got] == [10 * k for k in range(40)]
    assert (out / "trace.json").exists() and (out / "timeline.png").exists()
    assert cli("top", "--once").stdout.startswith("no graph is running")


def test_check_and_draw(flow_env:  # noqa: F811
                         dict[str, Path], tmp_path: Path) -> None:
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(GRAPH)
    bad.write_text(BAD)
    ok = cli("flow", "check", str(good))
    assert ok.returncode == 0 and "valid" in ok.stdout and "all_l0_0 x1" in ok.stdout
    res = cli("flow", "check", str(bad))
    assert res.returncode == EXIT_INVALID  # a graph that does not validate: invalid input
    assert "blocking input tot[0].frames is not connected" in res.stderr
    res = cli("flow", "run", str(bad))
    assert res.returncode == EXIT_INVALID and "not connected" in res.stderr
    png = tmp_path / "g.png"
    res = cli("flow", "draw", str(good), "-o", str(png))
    assert res.returncode == 0 and png.stat().st_size > 1000
    for sub in (["flow", "run"], ["flow", "check"], ["flow", "draw"], ["top"]):
        assert cli(*sub, "--help").returncode == 0


def test_bad_graph_files_and_arguments_are_typed_errors(flow_env:  # noqa: F811
                                                        dict[str, Path], tmp_path: Path) -> None:
    files = {
        "nofn.py": 'from instride.flow import Graph\ngraph = Graph("nofn")\n'
                   'graph.module("m", "nosuchpkg.mod:func")\n',
        "syntax.py": 'from instride.flow import Graph\ngraph = Graph(\n',
        "empty.py": 'from instride.flow import Graph\ngraph = Graph("empty")\n',
        "good.py": GRAPH,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    res = cli("flow", "check", str(tmp_path / "nofn.py"))
    assert res.returncode == EXIT_INVALID and "cannot import 'nosuchpkg.mod'" in res.stderr
    res = cli("flow", "check", str(tmp_path / "syntax.py"))
    assert res.returncode == EXIT_INVALID and "syntax.py', line 2: '(' was never closed" in res.stderr
    res = cli("flow", "check", str(tmp_path / "good.py"), "-p", "m=2")
    assert res.returncode == EXIT_INVALID and "build() does not take these parameters" in res.stderr
    res = cli("flow", "draw", str(tmp_path / "empty.py"), "-o", str(tmp_path / "e.png"))
    assert res.returncode == EXIT_INVALID and "has no modules" in res.stderr
    assert not (tmp_path / "e.png").exists()
    # a format matplotlib does not write: said so, no traceback (a ValueError before)
    res = cli("flow", "draw", str(tmp_path / "good.py"), "-o", str(tmp_path / "g.xyz"))
    assert res.returncode == EXIT_USAGE and "no drawing format 'xyz'" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "g.xyz").exists()
    res = cli("flow", "run", str(tmp_path / "good.py"), "--timeout", "-1")
    assert res.returncode == EXIT_USAGE and "--timeout" in res.stderr
    # a directory, or nothing at all, named as the graph file: said as it is
    res = cli("flow", "check", str(tmp_path))
    assert res.returncode == EXIT_INVALID and "is a directory, not a graph file" in res.stderr
    res = cli("flow", "check", str(tmp_path / "none.py"))
    assert res.returncode == EXIT_INVALID and "none.py' does not exist" in res.stderr


def test_draw_nodes_given_by_index(tmp_path: Path) -> None:
    graph = tmp_path / "indexed.py"
    graph.write_text(textwrap.dedent("""
        from instride.flow import Graph
        from tests.flow import modules
        graph = Graph("indexed")
        graph.module("src", modules.numbers, outputs={"out": "array"}, nodes=[0, 1])
    """))
    res = cli("flow", "draw", str(graph), "-o", str(tmp_path / "i.png"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "i.png").stat().st_size > 1000


def test_top_unknown_and_killed_runs(flow_env:  # noqa: F811
                                     dict[str, Path]) -> None:
    res = cli("top", "nosuch")
    assert res.returncode == EXIT_INVALID and "no run 'nosuch' is recorded" in res.stderr
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    killed = flow_env["state"] / "g-killed"
    (killed / "stats").mkdir(parents=True)
    (killed / "run.json").write_text(json.dumps(
        {"graph": "g", "prefix": "flow/g-killed", "pid": dead.pid, "host": host(),
         "started": 0.0, "launcher": "local", "instances": []}))
    try:
        res = cli("top", "g-killed")
        assert res.returncode == EXIT_ERROR
        assert f"its runner (pid {dead.pid}) is gone" in res.stderr
        # nor is it the newest running graph
        assert cli("top", "--once").stdout.startswith("no graph is running")
    finally:
        shutil.rmtree(killed)


def test_top_of_a_run_recorded_by_another_host_says_what_it_knows(flow_env:  # noqa: F811
                                                                    dict[str, Path]) -> None:
    """A run started on host A and killed there, seen from host B sharing its records (a
    Slurm submission directory): B cannot check A's pid, and `instride top RUN` showed its
    last counters as a live run, refreshed for ever; `instride top` said no graph was running
    at all. It says whose runner it is, that it cannot be checked from here, and how long
    nothing of the run has changed — stale past a minute."""
    runs = {}
    for name, age in (("g-stale", 600.0), ("g-fresh", 0.0)):
        run = flow_env["state"] / name
        (run / "stats").mkdir(parents=True)
        then = time.time() - age
        (run / "run.json").write_text(json.dumps(
            {"graph": "g", "prefix": f"flow/{name}", "pid": 4242, "host": "node-a",
             "started": then - 5, "launcher": "slurm", "instances": [["src", 0, "node-a"]]}))
        (run / "stats" / "src.0.json").write_text(json.dumps(
            {"module": "src", "instance": 0, "node": "node-a", "pid": 4343,
             "started": then - 4, "updated": then, "seconds": {}, "inputs": {}, "outputs": {},
             "done": False}))
        runs[name] = run
    try:
        stale = cli("top", "g-stale", "--once")
        assert stale.returncode == 0, stale.stderr
        assert ("runner pid 4242 on host node-a cannot be checked from this host" in stale.stdout
                and "STALE" in stale.stdout), stale.stdout
        assert "nothing of the run has changed for 60" in stale.stdout  # (600 s, give or take)
        fresh = cli("top", "g-fresh", "--once")
        assert fresh.returncode == 0 and "STALE" not in fresh.stdout, fresh.stdout
        assert "cannot be checked from this host; last sign of life" in fresh.stdout
        # a runner that beats (runner.HEARTBEAT): its heartbeat says, not the counters' age
        (runs["g-stale"] / HEARTBEAT_FILE).touch()
        beating = cli("top", "g-stale", "--once")
        assert "node-a: alive (its last sign of life" in beating.stdout, beating.stdout
        beat = runs["g-fresh"] / HEARTBEAT_FILE  # (its last beat 2 minutes ago)
        beat.touch()
        os.utime(beat, (time.time() - 120, time.time() - 120))
        dead = cli("top", "g-fresh", "--once")
        assert "DEAD: runner pid 4242 on host node-a last showed a sign of life 1" in dead.stdout, \
            dead.stdout
        newest = cli("top", "--once")  # (none runs here; those of node-a are named)
        assert newest.returncode == 1 and "no graph is running on this host" in newest.stdout
        assert "g-fresh (node-a" in newest.stdout and "g-stale (node-a" in newest.stdout
    finally:
        for run in runs.values():
            shutil.rmtree(run)
