"""Running graphs with local processes: end of stream, broadcast, tokens, steering, failures."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from instride.cli import EXIT_ERROR
from instride.errors import ConfigError, InstrideError
from instride.flow import FlowError, FlowTimeout, Graph, Input, ModuleFailed, run, runner
from instride.flow.launchers import LocalLauncher
from instride.flow.runner import gc_stale, host, launcher_kind

from . import modules
from .conftest import pythonpath


def _sums_pipeline(name: str, source: object, n: int) -> Graph:
    """``source`` (``n`` frames) -> ``total`` (their sums) -> ``record`` (``sums-0.json``)."""
    g = Graph(name)
    src = g.module("src", source, outputs=["frames"], params={"n": n})
    tot = g.module("tot", modules.total, inputs=["frames"], outputs={"sums": "array"})
    rec = g.module("rec", modules.record, inputs={"in": "array"}, params={"name": "sums"})
    g.connect(src.output("frames"), tot.input("frames"))
    g.connect(tot.output("sums"), rec.input("in"))
    return g


def test_pipeline_end_of_stream_and_trace(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    result = run(_sums_pipeline("pipe", modules.count, 6), out=out, timeout=120)
    got = json.loads((out / "sums-0.json").read_text())
    # 4 atoms x 3 coordinates filled with k: sum 12 k, stamped with the producer's step
    assert got == [[10 * k, [12.0 * k]] for k in range(6)]
    assert result.instance("tot")["inputs"]["frames"]["msgs"] == 6
    assert result.instance("src")["outputs"]["frames"]["msgs"] == 6
    trace = json.loads((out / "trace.json").read_text())
    regions = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"wait", "get", "put"} <= regions
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {"src[0] on local", "tot[0] on local", "rec[0] on local"}
    arrows = [e for e in trace["traceEvents"] if e["ph"] in "sf"]
    assert len(arrows) == 2 * 12  # put -> get of 6 frames and of 6 sums
    starts = {e["id"]: e for e in arrows if e["ph"] == "s"}
    for end in (e for e in arrows if e["ph"] == "f"):
        assert starts[end["id"]]["ts"] <= end["ts"]  # published before it was taken
    assert (out / "timeline.png").stat().st_size > 1000
    assert (out / "logs" / "tot.0.log").exists()


def test_broadcast_to_instances(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("bcast")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 4})
    rec = g.module("rec", modules.record, inputs={"in": "array"}, instances=3)
    g.connect(src.output("out"), rec.input("in"))
    run(g, out=out, timeout=120)
    for i in range(3):
        got = json.loads((out / f"record-{i}.json").read_text())
        assert got == [[10 * k, [float(k)]] for k in range(4)]


def test_cycle_unlocked_by_initial_token(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("loop")
    a = g.module("a", modules.ping, inputs={"back": "json"}, outputs={"out": "json"},
                 params={"n": 4})
    b = g.module("b", modules.pong, inputs={"in": "json"}, outputs={"out": "json"})
    g.connect(a.output("out"), b.input("in"))
    g.connect(b.output("out"), a.input("back"), initial=1)
    run(g, out=out, timeout=120)
    seen = json.loads((out / "ping.json").read_text())
    assert seen == [[-1, True], [0, False], [1, False], [2, False]]


def test_control_messages_on_non_blocking_port(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("steer")
    s = g.module("s", modules.steerable, inputs={"control": Input("json", blocking=False)},
                 outputs={"out": "array"}, params={"n": 100_000, "delay": 0.01})
    c = g.module("c", modules.controller, inputs={"in": "array"}, outputs={"control": "json"})
    g.connect(s.output("out"), c.input("in"))
    g.connect(c.output("control"), s.input("control"))
    run(g, out=out, timeout=120)
    got = json.loads((out / "steerable.json").read_text())
    assert got["controls"] == [{"every": 5}, {"stop": True}]
    assert got["sent"][-1] < 100_000 - 1  # stopped by the controller, not by running out


def test_failing_module_stops_the_graph(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("crash")
    src = g.module("src", modules.numbers, outputs={"out": "array"},
                   params={"n": 1000, "delay": 0.02})
    g.module("idle", modules.sleeper)
    bad = g.module("bad", modules.crash_after, inputs={"in": "array"},
                   params={"n": 2, "after_pid_of": "sleeper"})
    g.connect(src.output("out"), bad.input("in"))
    with pytest.raises(ModuleFailed) as info:
        run(g, out=out, timeout=120)
    err = info.value
    assert isinstance(err, InstrideError)
    assert (err.module, err.instance, err.returncode) == ("bad", 0, 1)
    assert "boom: analysis diverged" in str(err)
    pids = [int(p.name.split("-")[1].split(".")[0]) for p in out.glob("sleeper-*.pid")]
    assert len(pids) == 1
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # the idle module was stopped with the graph


def test_command_module_finds_its_ports_in_the_environment(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    code = textwrap.dedent("""
        import os, json, instride
        frames = instride.Stream(os.environ["INSTRIDE_FLOW_IN_FRAMES"], timeout=60)
        steps = [f.step for f in frames]
        out = os.path.join(os.environ["INSTRIDE_FLOW_OUT_DIR"], "cmd.json")
        open(out, "w").write(json.dumps(steps))
    """)
    g = Graph("cmd")
    src = g.module("src", modules.count, outputs=["frames"], params={"n": 3})
    cmd = g.module("cmd", command=[sys.executable, "-c", code], inputs=["frames"])
    g.connect(src.output("frames"), cmd.input("frames"))
    run(g, out=out, timeout=120)
    assert json.loads((out / "cmd.json").read_text()) == [0, 10, 20]


def test_unknown_function_fails_before_start(flow_env: dict[str, Path]) -> None:
    g = Graph("nofn")
    g.module("m", "tests.flow.modules:does_not_exist")
    with pytest.raises(InstrideError, match="does_not_exist"):
        run(g, timeout=60)


def test_class_module(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("cls")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 3})
    sc = g.module("scale", modules.ScaleModule, inputs={"in": "array"},
                  outputs={"out": "array"}, params={"factor": 10.0})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(src.output("out"), sc.input("in"))
    g.connect(sc.output("out"), rec.input("in"))
    run(g, out=out, timeout=120)
    assert json.loads((out / "record-0.json").read_text()) == [
        [0, [0.0]], [10, [10.0]], [20, [20.0]]]
    assert (out / "scale.json").read_text() == "3"


def test_timeout_stops_the_graph(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("slow")
    g.module("idle", modules.sleeper)
    with pytest.raises(FlowTimeout, match="idle"):
        run(g, out=out, timeout=3)
    (pidfile,) = out.glob("sleeper-*.pid")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pidfile.name.split("-")[1].split(".")[0]), 0)


def test_the_runner_shows_a_sign_of_life_while_the_graph_runs(
        flow_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`instride top` on another host cannot check the runner's pid: the runner touches its
    run's ``alive`` file every ``HEARTBEAT`` s while the graph runs (it had no sign of life
    of its own: a run killed there and a quiet live one looked the same)."""
    import threading

    monkeypatch.setattr(runner, "HEARTBEAT", 0.2)
    seen: set[int] = set()
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for alive in flow_env["state"].glob(f"beat-*/{runner.HEARTBEAT_FILE}"):
                with contextlib.suppress(OSError):
                    seen.add(alive.stat().st_mtime_ns)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    g = Graph("beat")
    g.module("idle", modules.sleeper)
    try:
        with pytest.raises(FlowTimeout):
            run(g, out=flow_env["out"], timeout=2)
    finally:
        stop.set()
        watcher.join()
    assert len(seen) >= 4, seen  # (~2 s of beats every 0.2 s)


def test_runner_killed_leaves_no_instance(flow_env: dict[str, Path], tmp_path: Path) -> None:
    """SIGTERM to `instride flow run` stops the graph; SIGKILL still takes the instances along
    (parent-death signal), and what they started (the run's watchdog)."""
    graph = tmp_path / "g.py"
    out = flow_env["out"]
    out.mkdir(parents=True)
    graph.write_text(textwrap.dedent("""
        from instride.flow import Graph
        from tests.flow import modules
        graph = Graph("killed")
        graph.module("idle", modules.sleeper, instances=2)
        # a command whose program is a grandchild of the runner
        graph.module("shell", command=["sh", "-c", "sleep 600 & echo $! > OUT/grandchild.pid; wait"])
        src = graph.module("src", modules.numbers, outputs={"out": "array"},
                           params={"n": 10000, "delay": 0.01})
        rec = graph.module("rec", modules.record, inputs={"in": "array"})
        graph.connect(src.output("out"), rec.input("in"))
    """).replace("OUT", str(out)))
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in [*out.glob("sleeper-*.pid"), *out.glob("grandchild.pid")]:
            p.unlink()
        proc = subprocess.Popen([sys.executable, "-m", "instride", "flow", "run", str(graph),
                                 "--out", str(out), "-q"], env=env, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 60
        streams = flow_env["managed"] / "flow"
        # wait for the instances and a first published message (a wait that fails removes
        # the directories it created, so only a message makes a stream outlive the runner)
        while ((len(list(out.glob("sleeper-*.pid"))) < 2
                or not any(p.is_file() for p in streams.rglob("*"))
                or _pid_in(out / "grandchild.pid") is None)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        pids = [int(p.name.split("-")[1].split(".")[0]) for p in out.glob("sleeper-*.pid")]
        assert len(pids) == 2
        pids.append(_pid_in(out / "grandchild.pid"))
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:
            assert proc.returncode == EXIT_ERROR and b"received signal 15" in err
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids), sig
    # a SIGKILLed runner could not clean up; the next run removes what it left
    assert any(flow_env["state"].iterdir()) and (flow_env["managed"] / "flow").exists()
    (left,) = [json.loads(p.read_text()) for p in flow_env["state"].glob("*/run.json")]
    assert (left["host"], left["launcher"]) == (host(), "local")
    g = Graph("next")
    g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 1})
    run(g, timeout=60)  # the fixture checks that nothing is left


def _pid_in(path: Path) -> int | None:
    """The PID written in ``path``, or ``None`` while there is none (yet)."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is gone for our purposes
        return fh.read().split(") ")[1][0] != "Z"


def test_mpi_module_ranks_are_instances(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("mpi")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 3})
    rec = g.module("rec", modules.record, inputs={"in": "array"}, instances=3, mpi=True)
    g.connect(src.output("out"), rec.input("in"))
    run(g, out=out, timeout=120)
    for i in range(3):  # every rank found its instance (and its input) from PMI_RANK
        assert json.loads((out / f"record-{i}.json").read_text()) == [
            [10 * k, [float(k)]] for k in range(3)]


def test_mpi_command_module_gets_its_ports_per_rank(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    code = textwrap.dedent("""
        import os, json, instride
        i = os.environ["INSTRIDE_FLOW_INSTANCE"]
        frames = instride.Stream(os.environ["INSTRIDE_FLOW_IN_FRAMES"],
                                 group=os.environ["INSTRIDE_FLOW_GROUP_FRAMES"], timeout=60)
        steps = [f.step for f in frames]
        seen = [os.environ["PMI_RANK"], os.environ["INSTRIDE_FLOW_IN_FRAMES"], steps]
        open(os.path.join(os.environ["INSTRIDE_FLOW_OUT_DIR"], f"cmd-{i}.json"), "w").write(
            json.dumps(seen))
        # (one write: the ranks share a log, and unbuffered print() writes piece by piece)
        os.write(1, f"rank {os.environ['PMI_RANK']}\\n".encode())
    """)
    g = Graph("mpicmd")
    src = g.module("src", modules.count, outputs=["frames"], instances=2, params={"n": 3})
    cmd = g.module("cmd", command=[sys.executable, "-c", code], inputs=["frames"], instances=2,
                   mpi=True)
    g.connect(src.output("frames"), cmd.input("frames"))
    result = run(g, out=out, timeout=120)
    for i in range(2):  # rank i is instance i, reading instance i of src
        rank, stream, steps = json.loads((out / f"cmd-{i}.json").read_text())
        assert (rank, steps) == (str(i), [0, 10, 20])
        assert stream == f"{result.prefix}/src.{i}/frames"
    log = (out / "logs" / "cmd.0.log").read_text()  # the ranks share one log
    assert "rank 0" in log and "rank 1" in log
    assert not (out / "logs" / "cmd.1.log").exists()


def test_missing_program_stops_what_started(flow_env: dict[str, Path]) -> None:
    g = Graph("noprog")
    g.module("idle", modules.sleeper)
    g.module("c", command=["/no/such/prog"])
    events: list[str] = []
    with pytest.raises(FlowError, match="module 'c' instance 0 could not be started.*"
                                        "/no/such/prog"):
        run(g, out=flow_env["out"], timeout=60, on_event=events.append)
    (started,) = [e for e in events if e.startswith("started idle[0]")]
    pid = int(started.rsplit("pid ", 1)[1].rstrip(")"))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the instance that had started was stopped (and reaped)


def test_failed_setup_leaves_no_state(flow_env: dict[str, Path], tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    state = flow_env["state"]
    g = Graph("setup")
    g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 1})
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="cannot make the output directory"):
        run(g, out=afile, timeout=60)
    assert not state.exists() or list(state.iterdir()) == []
    def boom(nodes: object) -> None:
        raise OSError("disk full")
    monkeypatch.setattr(g, "placement", boom)  # fails after the state directory was made
    with pytest.raises(OSError, match="disk full"):
        run(g, timeout=60)
    assert state.is_dir() and list(state.iterdir()) == []


class _Unnamed:
    """A launcher with the four methods and no ``name``."""

    def __init__(self) -> None:
        self.local = LocalLauncher()

    def nodes(self) -> list[str]:
        return self.local.nodes()

    def env(self, node: str) -> dict[str, str]:
        return self.local.env(node)

    def start(self, *args: object) -> subprocess.Popen[bytes]:
        return self.local.start(*args)  # type: ignore[arg-type]

    def cleanup(self, prefix: str) -> None:
        self.local.cleanup(prefix)


def test_launcher_without_a_name(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = Graph("unnamed")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 2})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(src.output("out"), rec.input("in"))
    assert launcher_kind(_Unnamed()) == "_Unnamed"
    run(g, out=out, launcher=_Unnamed(), timeout=60)
    assert json.loads((out / "record-0.json").read_text()) == [[0, [0.0]], [10, [1.0]]]


class _Interrupting(LocalLauncher):
    """Receives SIGTERM and Ctrl-C while it removes the run's streams."""

    cleaned = False

    def cleanup(self, prefix: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        super().cleanup(prefix)
        self.cleaned = True


def test_second_signal_does_not_cut_the_teardown_short(flow_env: dict[str, Path]) -> None:
    g = Graph("again")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 2})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(src.output("out"), rec.input("in"))
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    launcher = _Interrupting()
    run(g, out=flow_env["out"], launcher=launcher, timeout=60)
    assert launcher.cleaned  # the fixture checks that streams and state are gone
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def _record(root: Path, name: str, pid: int, **extra: object) -> Path:
    (root / name).mkdir(parents=True)
    (root / name / "run.json").write_text(json.dumps(
        {"graph": "g", "prefix": f"flow/{name}", "pid": pid, "started": 0.0, **extra}))
    return root / name


class _Recording(LocalLauncher):
    def __init__(self) -> None:
        super().__init__()
        self.cleaned: list[str] = []

    def cleanup(self, prefix: str) -> None:
        self.cleaned.append(prefix)


def test_gc_collects_only_dead_runs_of_this_host_and_kind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    root = tmp_path / "shared"
    here = {"host": host(), "launcher": "local"}
    mine = _record(root, "mine", dead.pid, **here)
    other_host = _record(root, "other-host", dead.pid, host="cn999", launcher="local")
    other_kind = _record(root, "other-kind", dead.pid, host=host(), launcher="slurm")
    alive = _record(root, "alive", os.getpid(), **here)
    legacy = _record(root, "legacy", dead.pid, launcher="local")  # no host: an older version
    launcher = _Recording()
    assert gc_stale(launcher, root) == ["flow/mine"] == launcher.cleaned
    assert not mine.exists()
    assert other_host.is_dir() and other_kind.is_dir() and alive.is_dir() and legacy.is_dir()
    # only this host writes the per-user temp dir: there a record without a host is ours
    monkeypatch.setattr(runner, "default_state_root", lambda: root)
    assert gc_stale(launcher, root) == ["flow/legacy"]
    assert not legacy.exists() and other_host.is_dir()


def test_a_module_that_exits_with_status_0_ends_its_outputs(flow_env: dict[str, Path]) -> None:
    """A module function that finishes with ``sys.exit(0)`` instead of returning has finished
    all the same: its outputs are ended, and its consumer gets every message and its end
    (it used to wait for that end for ever)."""
    out = flow_env["out"]
    run(_sums_pipeline("exits", modules.count_then_exit, 3), out=out, timeout=60)
    assert json.loads((out / "sums-0.json").read_text()) == [[10 * k, [12.0 * k]]
                                                             for k in range(3)]


def test_a_stride_longer_than_the_retention_does_not_deadlock(flow_env: dict[str, Path]) -> None:
    """``stride=k`` above the stream's retention: the reader waits for a message k ahead of
    the last it took, whose place it gives back only at its next take. The stream keeps at
    least k + 1 (it kept ``retain``: producer and reader then waited for each other until
    ``PortBlocked``)."""
    out = flow_env["out"]
    g = Graph("strided", retain=4)
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 21})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(src.output("out"), rec.input("in"), stride=5)
    run(g, out=out, timeout=60)
    got = json.loads((out / "record-0.json").read_text())
    assert [step for step, _ in got] == [0, 50, 100, 150, 200]


def test_connection_fields_of_a_graph_from_data_are_checked() -> None:
    """A graph rebuilt from data (``from_dict``, as instances and ``flow run`` files may)
    skips ``connect``'s checks: ``validate`` checks each connection's fields itself."""
    from instride.flow import GraphError

    g = Graph("data")
    src = g.module("src", modules.numbers, outputs={"out": "array"})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(src.output("out"), rec.input("in"))
    for field, bad in (("stride", 0), ("stride", "2"), ("initial", -3), ("sampling", "bogus"),
                       ("retain", 0)):
        data = g.to_dict()
        data["edges"][0][field] = bad
        with pytest.raises(GraphError, match=field):
            Graph.from_dict(data).validate()


#: a module of two flow functions: three numbers out, what came in written to got.json
_NUMS_AND_KEEP = textwrap.dedent("""
    import json, os
    import numpy as np

    def nums(ports, n=3):
        for k in range(n):
            ports.put("out", np.array([float(k)]), step=k)

    def keep(ports):
        got = []
        while ports.wait():
            msg = ports.get("in")
            got.append([msg.step, msg.data.tolist()])
        with open(os.path.join(os.environ["INSTRIDE_FLOW_OUT_DIR"], "got.json"), "w") as fh:
            json.dump(got, fh)
""")


def test_a_graph_files_sibling_modules_import_in_its_instances(
        flow_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph file that imports a module beside it (``from helpers import f``) validates (the
    file's directory is on the path where it is loaded), and its instances import it too, run
    from another directory (they got only the current directory on their ``PYTHONPATH``:
    ``ModuleNotFoundError``, the graph stopped)."""
    from instride.flow import load_graph

    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "helpers_beside_graph.py").write_text(_NUMS_AND_KEEP)
    (proj / "graph.py").write_text(textwrap.dedent("""
        from helpers_beside_graph import keep, nums
        from instride.flow import Graph

        graph = Graph("siblings")
        src = graph.module("src", nums, outputs={"out": "array"})
        rec = graph.module("rec", keep, inputs={"in": "array"})
        graph.connect(src.output("out"), rec.input("in"))
    """))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    out = flow_env["out"]
    run(load_graph(proj / "graph.py"), out=out, timeout=60)
    assert json.loads((out / "got.json").read_text()) == [[k, [float(k)]] for k in range(3)]


def test_a_module_a_graph_file_puts_on_its_path_imports_in_its_instances(
        flow_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph file that puts a library directory on ``sys.path`` itself: its functions
    passed ``validate()`` (imported with the runner's path) and failed in every instance
    (``ModuleNotFoundError``: not on their ``PYTHONPATH``)."""
    from instride.flow import load_graph

    lib, proj = tmp_path / "lib", tmp_path / "proj"
    lib.mkdir()
    proj.mkdir()
    (lib / "steps_on_a_path_of_its_own.py").write_text(_NUMS_AND_KEEP)
    (proj / "graph.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(lib)!r})
        from instride.flow import Graph

        graph = Graph("onpath")
        src = graph.module("src", "steps_on_a_path_of_its_own:nums", outputs={{"out": "array"}})
        rec = graph.module("rec", "steps_on_a_path_of_its_own:keep", inputs={{"in": "array"}})
        graph.connect(src.output("out"), rec.input("in"))
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # (the graph file's insert undone after)
    out = flow_env["out"]
    run(load_graph(proj / "graph.py"), out=out, timeout=60)
    assert json.loads((out / "got.json").read_text()) == [[k, [float(k)]] for k in range(3)]


@pytest.mark.parametrize("name", ["-rec", "réc", "a b", ""])
def test_names_a_consumer_group_could_not_carry_are_refused_at_once(name: str) -> None:
    """Module and port names make the consumer groups' names, which must begin with an ASCII
    letter, digit or ``_``: such a name is refused where it is given (a module named ``-rec``
    used to pass ``validate`` and fail at run time, its group refused)."""
    from instride.flow import GraphError

    g = Graph("names")
    with pytest.raises(GraphError, match="ASCII"):
        g.module(name, modules.record, inputs={"in": "array"})
    with pytest.raises(GraphError, match="ASCII"):
        g.module("ok", modules.record, inputs={name: "array"})


def test_a_long_chain_validates() -> None:
    """The search for a cycle without a token walks a chain of 3,000 modules (deeper than
    Python's recursion: it raised ``RecursionError``)."""
    g = Graph("chain")
    prev = g.module("m0", modules.numbers, outputs={"out": "array"})
    for k in range(1, 3000):
        m = g.module(f"m{k}", modules.total, inputs={"in": "array"}, outputs={"out": "array"})
        g.connect(prev.output("out"), m.input("in"))
        prev = m
    g.validate()  # (a cycle's naming: test_graph.py's test_cycle_without_token_is_a_deadlock)


#: A program (``command=``) that sends three frames and three arrays through its ports; by
#: its instance: 0 exits with status 0 leaving its outputs open (no ``ports.close()``), 1 ends
#: them itself, 2 exits before it reaches its ports (sends nothing).
_LEAVES_ITS_OUTPUTS_OPEN = textwrap.dedent("""
    import os, sys
    import numpy as np
    i = int(os.environ["INSTRIDE_FLOW_INSTANCE"])
    if i == 2:
        sys.exit(0)
    from instride.flow import from_env
    ports = from_env()
    for k in range(3):
        ports.put("frames", np.full((2, 3), float(k), dtype=np.float32), step=10 * k)
        ports.put("out", np.array([float(k)]), step=10 * k)
    if i == 1:
        ports.close()
""")


def programs_and_sinks(name: str, instances: int, *, mpi: bool = False,
                       nodes: tuple[list[str], list[str]] | None = None) -> Graph:
    """``instances`` of :data:`_LEAVES_ITS_OUTPUTS_OPEN`, each read by its own sink
    (``got-<i>.json``); ``nodes``: where the programs and where the sinks run."""
    g = Graph(name)
    cmd = g.module("cmd", command=[sys.executable, "-c", _LEAVES_ITS_OUTPUTS_OPEN],
                   outputs={"frames": "frame", "out": "array"}, instances=instances, mpi=mpi,
                   nodes=nodes[0] if nodes else None)
    rec = g.module("rec", modules.record_ports, inputs={"frames": "frame", "in": "array"},
                   instances=instances, nodes=nodes[1] if nodes else None)
    g.connect(cmd.output("frames"), rec.input("frames"))
    g.connect(cmd.output("out"), rec.input("in"))
    return g


#: What each sink of :func:`programs_and_sinks` gets from an instance that sent something.
SENT = {"frames": [[10 * k, [[float(k)] * 3] * 2] for k in range(3)],
         "in": [[10 * k, [float(k)]] for k in range(3)]}


def test_a_program_that_exits_without_closing_its_ports_ends_its_outputs(
        flow_env: dict[str, Path]) -> None:
    """A ``command=`` program that exits with status 0 without ``ports.close()`` has finished:
    the runner ends the output streams it left open, so its consumers take every message and
    then the end (they waited for ever; the run hung). The streams of an instance that ended
    them itself are left as they are, and one that sent nothing ends its consumers at once.
    The regions of the one that left them open are in the run's trace all the same."""
    out = flow_env["out"]
    events: list[str] = []
    run(programs_and_sinks("noclose", 3), out=out, timeout=60, on_event=events.append)
    trace = json.loads((out / "trace.json").read_text())
    threads = {e["pid"]: {} for e in trace["traceEvents"]}
    for e in trace["traceEvents"]:
        if e["name"] == "thread_name":
            threads[e["pid"]][e["tid"]] = e["args"]["name"]
    puts = {threads[e["pid"]][e["tid"]] for e in trace["traceEvents"]
            if e["ph"] == "X" and e["name"] == "put"}
    assert {"cmd[0] on local", "cmd[1] on local"} <= puts  # (0: no close(), its part at exit)
    for i, want in enumerate([SENT, SENT, {"frames": [], "in": []}]):
        assert json.loads((out / f"got-{i}.json").read_text()) == want, i
    assert {f"finished cmd[{i}]" for i in range(3)} <= set(events)
    logs = [(out / "logs" / f"cmd.{i}.log").read_text() for i in range(3)]
    assert "'frames' (3 messages) and 'out' (3 messages)" in logs[0]
    assert "ended by the runner" not in logs[1]  # (it had ended them)
    assert "'frames' (0 messages) and 'out' (0 messages)" in logs[2]


def test_an_mpi_program_that_exits_without_closing_its_ports_ends_its_outputs(
        flow_env: dict[str, Path]) -> None:
    """The same for the ranks of an ``mpi=True`` program: one ``mpiexec``, whose exit ends
    the outputs each rank (instance) left open."""
    out = flow_env["out"]
    run(programs_and_sinks("mpinoclose", 2, mpi=True), out=out, timeout=60)
    for i in range(2):
        assert json.loads((out / f"got-{i}.json").read_text()) == SENT, i


def test_a_program_that_stops_reading_early_releases_its_producer(
        flow_env: dict[str, Path]) -> None:
    """A program that takes one message and exits with status 0 without ``ports.close()``:
    the runner releases its consumer group, as ``close()`` does, so its producer, held back by
    the retention, goes on to its end (it waited for ever)."""
    code = "from instride.flow import from_env; p = from_env(); p.wait(); p.get('in')"
    g = Graph("early")
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 20})
    cmd = g.module("cmd", command=[sys.executable, "-c", code], inputs={"in": "array"})
    g.connect(src.output("out"), cmd.input("in"), retain=2)
    result = run(g, timeout=60)
    assert result.instance("src")["outputs"]["out"]["msgs"] == 20


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_a_python_module_gone_without_closing_its_ports_has_its_outputs_ended(
        flow_env: dict[str, Path]) -> None:
    """A Python module that leaves by ``os._exit(0)`` (no ``ports.close()``: its worker never
    returns) has finished: the runner ends its outputs, as a program's, and its consumer takes
    every message and ends. Only programs (``command=``) had them ended: the consumer waited
    for ever (here: until the timeout)."""
    out = flow_env["out"]
    g = Graph("quits")
    src = g.module("src", modules.quits, outputs={"out": "array"})
    rec = g.module("rec", modules.record_ports, inputs={"in": "array"})
    g.connect(src.output("out"), rec.input("in"))
    run(g, out=out, timeout=30)
    assert json.loads((out / "got-0.json").read_text()) == {"in": [[k, [float(k)]]
                                                                   for k in range(3)]}


def test_what_an_instance_left_running_is_stopped_with_the_graph(
        flow_env: dict[str, Path]) -> None:
    """A program that exits with status 0 leaving a child running (in its process group, and
    one in a session of its own): the runner stops both once the graph ends, as it stops the
    instances (they ran on, past the run, writing as they pleased)."""
    out = flow_env["out"]
    out.mkdir(parents=True)
    code = textwrap.dedent("""
        import os, subprocess, sys
        sleep = [sys.executable, "-c", "import time; time.sleep(300)"]
        kids = [subprocess.Popen(sleep), subprocess.Popen(sleep, start_new_session=True)]
        with open(os.path.join(os.environ["INSTRIDE_FLOW_OUT_DIR"], "kids"), "w") as f:
            f.write(" ".join(str(k.pid) for k in kids))
    """)
    g = Graph("leaves")
    g.module("cmd", command=[sys.executable, "-c", code])
    pids: list[int] = []
    try:
        run(g, out=out, timeout=60)
        pids = [int(p) for p in (out / "kids").read_text().split()]
        assert len(pids) == 2 and not [pid for pid in pids if _running(pid)]
    finally:
        for pid in pids:  # (the test's own cleanup, where the runner did not)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_teardown_that_fails_does_not_hide_why_the_graph_stopped(
        flow_env: dict[str, Path]) -> None:
    """An instance fails, then the teardown fails too (the launcher's cleanup): the run still
    raises ``ModuleFailed`` (its exit status, the log tail), the teardown's error a note on it.
    The teardown's error used to replace it."""

    class Failing(LocalLauncher):
        def cleanup(self, prefix: str) -> None:
            super().cleanup(prefix)
            raise RuntimeError("the cleanup broke")

    g = Graph("tears")
    g.module("bad", command=[sys.executable, "-c", "raise SystemExit(7)"])
    with pytest.raises(ModuleFailed) as info:
        run(g, launcher=Failing(), timeout=60)
    assert info.value.returncode == 7
    assert any("the cleanup broke" in n for n in getattr(info.value, "__notes__", []))


def test_a_failing_program_leaves_its_outputs_open_and_stops_the_graph(
        flow_env: dict[str, Path]) -> None:
    """A program that exits with an error stops the graph as any failing instance: its
    outputs are not ended (its consumers must not take what it sent for the whole), and
    its consumers are stopped, not left waiting."""
    out = flow_env["out"]
    code = textwrap.dedent("""
        import sys
        import numpy as np
        from instride.flow import from_env
        ports = from_env()
        for k in range(2):
            ports.put("out", np.array([float(k)]), step=k)
        sys.exit(3)
    """)
    g = Graph("badprog")
    cmd = g.module("cmd", command=[sys.executable, "-c", code], outputs={"out": "array"})
    rec = g.module("rec", modules.record, inputs={"in": "array"})
    g.connect(cmd.output("out"), rec.input("in"))
    events: list[str] = []
    with pytest.raises(ModuleFailed) as info:
        run(g, out=out, timeout=60, on_event=events.append)
    assert (info.value.module, info.value.instance, info.value.returncode) == ("cmd", 0, 3)
    assert not (out / "record-0.json").exists()  # stopped before any end reached it
    assert "finished rec[0]" not in events


# ---------------------------------------------------------------------- round 45's review
@pytest.mark.parametrize("how", ["writable", "link"])
def test_a_state_directory_others_could_write_is_refused(
        flow_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        how: str) -> None:
    """The runs' state directory (by default the predictable /tmp/instride-flow-UID) was
    used as found: a directory another user made first, writable by them or a link to one of
    theirs, let them rewrite a run's spec.json — whose targets every instance imports."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    root = theirs if how == "writable" else tmp_path / "link"
    if how == "link":
        root.symlink_to(theirs)
    monkeypatch.setenv("INSTRIDE_FLOW_STATE", str(root))
    # a planted record of a "dead run" naming a prefix of the user's: removed before the check
    precious = flow_env["managed"] / "precious"
    precious.mkdir()
    (precious / "data").write_bytes(b"keep")
    (theirs / "planted").mkdir()
    (theirs / "planted" / "run.json").write_text(json.dumps(
        {"graph": "g", "prefix": "precious", "pid": 2**22 + 17, "host": host(),
         "launcher": "local", "started": 0.0}))
    g = Graph("unsafe")
    g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 1})
    with pytest.raises(ConfigError, match="INSTRIDE_FLOW_STATE"):
        run(g, timeout=30)
    assert [p.name for p in theirs.iterdir()] == ["planted"]
    assert (precious / "data").read_bytes() == b"keep"
    shutil.rmtree(precious)


@pytest.mark.parametrize("bad", [float("nan"), -5.0])
def test_a_run_timeout_no_clock_reaches_is_refused(flow_env: dict[str, Path], bad: float) -> None:
    """``run(timeout=nan)`` never timed out (and became every writer's put timeout, which no
    wait reaches either); ``-5`` timed out at once."""
    g = Graph("nan")
    g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 1})
    with pytest.raises(ConfigError, match="timeout"):
        run(g, timeout=bad)


HUP_IN_TEARDOWN = textwrap.dedent(
    """
    import os, signal, sys
    from instride.flow import FlowError, Graph, run
    from instride.flow.launchers import LocalLauncher
    from tests.flow import modules

    class Hup(LocalLauncher):
        cleaned = False
        def cleanup(self, prefix):
            os.kill(os.getpid(), signal.SIGHUP)  # (the terminal closes during the teardown)
            super().cleanup(prefix)
            Hup.cleaned = True

    g = Graph("hup")
    g.module("idle", modules.sleeper)
    signal.signal(signal.SIGALRM, lambda *a: os.kill(os.getpid(), signal.SIGHUP))
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        run(g, out=sys.argv[1], launcher=Hup(), timeout=60)
    except FlowError as exc:
        print("stopped:", exc, "cleaned:", Hup.cleaned, flush=True)
    """
)


def test_sighup_stops_a_run_with_its_teardown(flow_env: dict[str, Path]) -> None:
    """SIGHUP (the terminal or ssh session closing) killed the runner at once, and one during
    the teardown of a run stopped by SIGTERM cut it short: streams and state left behind."""
    res = subprocess.run([sys.executable, "-c", HUP_IN_TEARDOWN, str(flow_env["out"])],
                         capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": pythonpath()})
    assert res.returncode == 0, (res.returncode, res.stderr[-3000:])
    assert "received signal 1" in res.stdout and "cleaned: True" in res.stdout, res.stdout


def test_an_explicit_no_limit_reaches_the_writers(flow_env: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``run(timeout=inf)`` (``flow run --timeout inf``) became "not given", and the writers'
    puts fell back to INSTRIDE_TIMEOUT: a consumer slower than that failed the run
    (PortBlocked), though no limit was asked for."""
    import math

    monkeypatch.setenv("INSTRIDE_TIMEOUT", "0.5")
    g = Graph("unlimited", retain=1)
    src = g.module("src", modules.numbers, outputs={"out": "array"}, params={"n": 3})
    rec = g.module("rec", modules.slow_record, inputs={"in": "array"}, params={"delay": 1.2})
    g.connect(src.output("out"), rec.input("in"))
    result = run(g, out=flow_env["out"], timeout=math.inf)
    assert result.instance("src")["outputs"]["out"]["msgs"] == 3


def test_a_shell_program_reads_a_port_named_with_a_dash(flow_env: dict[str, Path]) -> None:
    """A port ``my-in`` was only ``INSTRIDE_FLOW_IN_MY-IN``, which a shell cannot read
    (``${INSTRIDE_FLOW_IN_MY-IN}`` is a default value): given as ``..._MY_IN`` too."""
    out = flow_env["out"]
    g = Graph("dash")
    src = g.module("src", modules.numbers, outputs={"my-out": "array"},
                   params={"n": 1, "port": "my-out"})
    out.mkdir(parents=True, exist_ok=True)
    cmd = g.module("cmd", command=["sh", "-c", f'echo "$INSTRIDE_FLOW_IN_MY_IN" > {out}/name'],
                   inputs={"my-in": "array"})
    g.connect(src.output("my-out"), cmd.input("my-in"))
    run(g, out=out, timeout=120)
    assert (out / "name").read_text().strip().endswith("/src.0/my-out")
