"""End-to-end runs of every backend on one node and on two emulated nodes.

Real MPI (the venv's mpiexec), real processes, real emulated nodes (network namespaces, per-node
data servers, Redis) for the two-node runs. Each run checks that every frame arrived intact
(the consumer verifies checksums and MD steps) and that the timing table is complete and
consistent.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from instride.bench.report import OUTCOMES
from instride.bench.results import expected_regions, read_timings
from instride.bench.workflow_run import RunConfig, run

FRAMES = 4
PAIRS = 2


def _require_multinode() -> None:
    missing = [what for what, ok in (
        ("root", os.geteuid() == 0),
        ("iproute2 (ip)", shutil.which("ip") or os.path.exists("/usr/sbin/ip")),
        ("redis-server", shutil.which("redis-server")),
    ) if not ok]
    if missing:
        raise RuntimeError(f"two-node bench tests need {', '.join(missing)} "
                           "(`make test` installs them; run as root)")


def check_run(out: Path, summary: dict, backend: str, nodes: int, reps: int = 1,
              sync: str = "serialized") -> None:
    # every frame arrived intact
    assert summary["frames"] == {"expected": reps * PAIRS * FRAMES,
                                 "verified": reps * PAIRS * FRAMES}
    rows = read_timings(out / "timings.csv")
    with open(out / "ranks.csv", newline="") as fh:
        ranks = list(csv.DictReader(fh))
    assert len(ranks) == reps * 2 * PAIRS
    # one row per expected rank x frame x region, and nothing else
    counts = Counter((r["rep"], r["rank"], r["frame"], r["region"]) for r in rows)
    expected = set()
    for rank in ranks:
        regions = expected_regions(backend, rank["role"], sync)
        for frame in range(FRAMES):
            for region in regions:
                expected.add((int(rank["rep"]), int(rank["rank"]), frame, region))
    assert set(counts) == expected
    assert all(c == 1 for c in counts.values())
    # no negative times; movement + idle never exceeds the rank's wall time
    assert all(r["duration_s"] >= 0 and r["start_s"] >= 0 for r in rows)
    busy: dict[tuple[int, int], float] = defaultdict(float)
    for r in rows:
        if r["category"] in ("movement", "idle"):
            busy[(r["rep"], r["rank"])] += r["duration_s"]
    for rank in ranks:
        key = (int(rank["rep"]), int(rank["rank"]))
        assert 0 < busy[key] <= float(rank["wall_s"])
        total = sum(r["duration_s"] for r in rows if (r["rep"], r["rank"]) == key)
        assert total <= float(rank["wall_s"]) * 1.001  # regions never overlap
    # every consumer verified all its frames; every producer wrote them
    for rank in ranks:
        if rank["role"] == "consumer":
            assert int(rank["frames_verified"]) == FRAMES
        else:
            assert int(rank["bytes_written"]) == FRAMES * (128 + 28 * 500)
    # placement: producers and consumers on different nodes (and namespaces) when nodes >= 2
    roles_nodes = {(r["role"], r["node"]) for r in ranks}
    if nodes == 1:
        assert roles_nodes == {("producer", "node1"), ("consumer", "node1")}
    else:
        assert roles_nodes == {("producer", "node1"), ("consumer", "node2")}
        netns = {r["role"]: set() for r in ranks}
        for r in ranks:
            netns[r["role"]].add(r["netns"])
        assert netns["producer"].isdisjoint(netns["consumer"])
    if backend == "instride":
        assert {r["mode"] for r in ranks} == {"cluster" if nodes > 1 else "local"}
    # the summary names the role and the component
    for role in ("producer", "consumer"):
        s = summary[role]
        assert s["movement_s"] > 0 and s["idle_s"] >= 0
        assert s["overall_s"] == pytest.approx(s["movement_s"] + s["idle_s"])
    if backend != "instride":
        assert summary["producer"]["regions"]["produce.sync"]["count"] == reps * PAIRS * FRAMES
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["consumer"]["idle_s"] == summary["consumer"]["idle_s"]
    # every mean has its spread over repetitions; steady idle leaves the first frame out
    for role in ("producer", "consumer"):
        s = summary[role]
        for name in ("movement_s", "idle_s", "overall_s", "compute_s", "idle_first_s",
                     "idle_steady_s", "overall_steady_s"):
            assert s[f"{name}_std"] is not None and s[f"{name}_std"] >= 0, name
        idle_rows = [r for r in rows if r["role"] == role and r["category"] == "idle"]
        per_rank = reps * PAIRS
        first = sum(r["duration_s"] for r in idle_rows if r["frame"] == 0) / per_rank
        rest = sum(r["duration_s"] for r in idle_rows if r["frame"] > 0) / per_rank
        assert s["idle_first_s"] == pytest.approx(first)
        assert s["idle_steady_s"] == pytest.approx(rest / (FRAMES - 1))
        assert s["overall_steady_s"] == pytest.approx(s["movement_s"] + s["idle_steady_s"])
    # deserializing (and verifying) a frame is compute, not data movement
    assert {r["category"] for r in rows if r["region"] == "consume.deserialize"} == {"compute"}
    assert summary["config"]["sync"] == sync
    if backend != "instride" and sync == "serialized":
        check_serialized(rows, ranks)


def check_serialized(rows: list[dict], ranks: list[dict]) -> None:
    """No producer starts the MD of frame k before its consumer finished analysing frame k-1.

    Rows hold times from each rank's own start; ``origin_s`` (a CLOCK_MONOTONIC reading, one
    clock for every process) puts them on one time line.
    """
    origin = {(int(r["rep"]), int(r["rank"])): float(r["origin_s"]) for r in ranks}
    md_start: dict[tuple[int, int, int], float] = {}
    analysed: dict[tuple[int, int, int], float] = {}
    for r in rows:
        t0 = origin[(r["rep"], r["rank"])] + r["start_s"]
        if r["region"] == "produce.md":
            md_start[(r["rep"], r["pair"], r["frame"])] = t0
        elif r["region"] == "consume.analytics":
            analysed[(r["rep"], r["pair"], r["frame"])] = t0 + r["duration_s"]
    checked = 0
    for (rep, pair, frame), start in md_start.items():
        if frame > 0:
            assert start >= analysed[(rep, pair, frame - 1)] - 1e-6, (rep, pair, frame)
            checked += 1
    assert checked == len(md_start) - len({(rep, pair) for rep, pair, _ in md_start})


def _config(backend: str, nodes: int, **kw) -> RunConfig:
    return RunConfig(atoms=500, frames=FRAMES, pairs=PAIRS, nodes=nodes, backend=backend,
                     time_scale=0.005, timeout=60.0, **kw)


@pytest.mark.parametrize("backend", ["instride", "localfs", "sharedfs"])
def test_one_node(backend: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    summary = run(_config(backend, 1, repetitions=2, workdir=str(tmp_path / "work")), out,
                  progress=False)
    check_run(out, summary, backend, 1, reps=2)
    # consumed frames are deleted; the run leaves no data behind
    leftovers = [p for p in (tmp_path / "work").rglob("*.isf")]
    assert leftovers == []


def test_pipelined_variant_has_one_barrier_per_frame(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _config("localfs", 1, sync="pipelined", workdir=str(tmp_path / "work"))
    assert cfg.name.startswith("localfs_pipelined-")
    summary = run(cfg, out, progress=False)
    check_run(out, summary, "localfs", 1, sync="pipelined")
    regions = {r["region"] for r in read_timings(out / "timings.csv")}
    assert "produce.sync_done" not in regions and "consume.sync_done" not in regions


@pytest.mark.root
@pytest.mark.parametrize("backend", ["instride", "sharedfs"])
def test_two_nodes(backend: str, tmp_path: Path) -> None:
    _require_multinode()
    out = tmp_path / "out"
    summary = run(_config(backend, 2), out, progress=False)
    check_run(out, summary, backend, 2)
    if backend == "instride":  # the consumer's frames crossed nodes: the fetch took time
        assert summary["consumer"]["regions"]["consume.fetch"]["mean_s"] > 0


@pytest.mark.parametrize("backend", ["instride", "localfs"])
def test_wait_beyond_timeout_fails_the_run(backend: str, tmp_path: Path) -> None:
    from instride.bench.workflow_run import BenchRunError

    # frames come every 0.82 s but no wait may exceed 0.2 s: the consumer's wait (instride) or
    # barrier (localfs) gives up, its rank fails, and the run fails with a typed error
    cfg = RunConfig(atoms=500, frames=2, pairs=1, backend=backend, time_scale=1.0, timeout=0.2,
                    workdir=str(tmp_path / "work"))
    from instride.bench.workflow_run import segments_in_use

    def leftovers() -> set[str]:  # (MPICH's segments, Hydra's topology files: always in /tmp)
        return {str(p) for p in [*Path("/dev/shm").glob("mpich_shm_*"),
                                 *Path("/tmp").glob("hydra_hwloc_xmlfile_*")]}

    before = leftovers()
    with pytest.raises(BenchRunError, match="mpiexec exited") as info:
        run(cfg, tmp_path / "out", progress=False)
    assert "Timeout" in str(info.value)
    # what the aborted job left is gone too (others' live jobs may add theirs)
    new = leftovers() - before
    assert new - segments_in_use(new) == set(), new


def test_cli_run_and_tiny_study(tmp_path: Path) -> None:
    exe = [sys.executable, "-m", "instride"]
    out = tmp_path / "run"
    proc = subprocess.run(
        [*exe, "bench", "run", "--backend", "localfs", "--atoms", "500", "--frames", "3",
         "--pairs", "1", "--time-scale", "0.005", "--out", str(out), "-q"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "frames verified: 3/3" in proc.stdout
    assert (out / "timings.csv").exists() and (out / "summary.json").exists()
    bad = subprocess.run([*exe, "bench", "run", "--model", "lysozyme", "--out", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 4 and "unknown model" in bad.stderr  # invalid input
    rep = tmp_path / "study"
    proc = subprocess.run(
        [*exe, "bench", "study", "--preset", "tiny", "--experiments", "single_node",
         "--out", str(rep), "-q"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = (rep / "report.md").read_text()
    assert "paper 192.9×; here" in report
    findings = re.findall(r"^(\d)\. \*[^*]+\* — \*\*([a-z ]+)\*\*", report, re.MULTILINE)
    assert len(findings) == 1 and findings[0][0] == "1", findings  # single_node only
    assert findings[0][1] in OUTCOMES
    assert (rep / "figures" / "single_node.png").stat().st_size > 1000
    with open(rep / "tables" / "single_node.csv", newline="") as fh:
        assert {r["backend"] for r in csv.DictReader(fh)} == {"instride", "localfs"}


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # the caller's PYTHONPATH (a checkout's src) reaches the command and, through mpiexec, its
    # ranks: the code under test is what runs
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_cli_run_defaults_to_jac(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = _cli("bench", "run", "--backend", "localfs", "--frames", "2", "--time-scale", "0.001",
                "--out", str(out), "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("localfs-JAC-s880-p1-n1:")
    config = json.loads((out / "summary.json").read_text())["config"]
    assert (config["model"], config["atoms"]) == ("JAC", 23558)
    # --atoms alone still means a custom model with JAC's timing
    proc = _cli("bench", "run", "--backend", "localfs", "--atoms", "500", "--frames", "2",
                "--time-scale", "0.001", "--out", str(tmp_path / "atoms"), "-q")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("localfs-atoms500-s880-p1-n1:")


@pytest.mark.parametrize(("setting", "value"), [
    ("time_scale", float("inf")), ("time_scale", float("nan")), ("time_scale", -1.0),
    ("steps_per_second", float("inf")), ("steps_per_second", float("nan")),
    ("steps_per_second", 0.0), ("timeout", float("nan")), ("timeout", 0.0),
    ("sync", "eventually"),
])
def test_non_finite_and_unknown_settings_are_config_errors(setting: str, value: object) -> None:
    from instride.bench.molecules import BenchConfigError

    with pytest.raises(BenchConfigError, match=setting):
        RunConfig(**{setting: value}).validate()


def test_cli_rejects_non_finite_numbers_without_a_traceback(tmp_path: Path) -> None:
    for option, value in (("--time-scale", "inf"), ("--steps-per-second", "nan"),
                          ("--timeout", "nan")):
        proc = _cli("bench", "run", option, value, "--out", str(tmp_path / "never"), timeout=60)
        assert proc.returncode == 4, proc.stderr  # invalid input
        assert "bad benchmark setting" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "never").exists()


def test_timeout_inf_means_no_limit(tmp_path: Path) -> None:
    cfg = _config("localfs", 1, workdir=str(tmp_path / "work"))
    cfg = RunConfig(**{**cfg.__dict__, "timeout": float("inf")})
    assert cfg.validate().wait_limit is None and cfg.time_budget() is None
    summary = run(cfg, tmp_path / "out", progress=False)
    check_run(tmp_path / "out", summary, "localfs", 1)
    spec = json.loads((tmp_path / "out" / "raw" / "rep0" / "spec.json").read_text())
    assert spec["timeout"] is None  # the ranks wait without a limit


def _leftovers() -> set[str]:
    """MPICH's shared-memory segments and Hydra's topology files now there."""
    return {str(p) for p in [*Path("/dev/shm").glob("mpich_shm_*"),
                             *Path("/tmp").glob("hydra_hwloc_xmlfile_*")]}


def test_interrupted_run_kills_its_job_and_removes_its_segments(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from instride.bench import workflow_run
    from instride.bench.workflow_run import segments_in_use

    before = _leftovers()

    def interrupted(self: subprocess.Popen, timeout: float | None = None) -> tuple[bytes, bytes]:
        # Ctrl-C once the ranks are up and hold their segments
        deadline = time.monotonic() + 60
        while not any("mpich_shm_" in p for p in _leftovers() - before):
            assert time.monotonic() < deadline, "the job never created its shared memory"
            time.sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(workflow_run.subprocess.Popen, "communicate", interrupted)
    cfg = RunConfig(atoms=500, frames=50, pairs=1, backend="localfs", time_scale=1.0,
                    workdir=str(tmp_path / "work"))
    with pytest.raises(KeyboardInterrupt):
        run(cfg, tmp_path / "out", progress=False)
    new = _leftovers() - before
    assert new - segments_in_use(new) == set(), new  # (others' live jobs may add theirs)
    assert not (tmp_path / "out").exists()  # nothing partial left, not even the directory made


def test_failed_run_leaves_the_previous_results_alone(tmp_path: Path) -> None:
    from instride.bench.workflow_run import BenchRunError

    out = tmp_path / "out"
    (tmp_path / "out").mkdir()
    (out / "notes.txt").write_text("mine")  # not the run's: never touched
    first = run(_config("localfs", 1, repetitions=2, workdir=str(tmp_path / "work")), out,
                progress=False)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # frames every 0.82 s, waits limited to 0.2 s: the second run fails in its first repetition
    failing = RunConfig(atoms=500, frames=2, pairs=1, backend="localfs", time_scale=1.0,
                        timeout=0.2, workdir=str(tmp_path / "work"))
    with pytest.raises(BenchRunError):
        run(failing, out, progress=False)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # no raw/rep0 of the failed run beside the first run's summary
    assert json.loads((out / "summary.json").read_text())["config"]["repetitions"] == 2
    # a successful run replaces every part of the earlier result (one repetition: no rep1)
    run(_config("localfs", 1, workdir=str(tmp_path / "work")), out, progress=False)
    assert sorted(p.name for p in (out / "raw").iterdir()) == ["rep0"]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "ranks.csv", "raw",
                                                     "summary.json", "timings.csv"]
    assert first["config"]["repetitions"] == 2


def test_failed_study_leaves_the_previous_report_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from instride.bench import study as study_mod
    from instride.bench.workflow_run import BenchRunError

    from .test_report import summary as fake_summary

    out = tmp_path / "study"
    (out / "runs" / "old").mkdir(parents=True)
    (out / "report.md").write_text("old report")
    (out / "study.json").write_text("{}")
    calls: list[str] = []
    fail_at = [2]  # the second configuration fails

    def fake_run(cfg: RunConfig, run_dir: Path, **_: object) -> dict:
        calls.append(cfg.name)
        if len(calls) == fail_at[0]:
            raise BenchRunError(cfg.name, "failed on purpose")
        Path(run_dir).mkdir(parents=True)
        (Path(run_dir) / "summary.json").write_text("{}")
        return fake_summary(cfg.backend, cm=0.5, ci=1.0)

    monkeypatch.setattr(study_mod, "run", fake_run)
    with pytest.raises(BenchRunError):
        study_mod.run_study("tiny", out, experiments=("single_node",), progress=False)
    assert (out / "report.md").read_text() == "old report"
    assert sorted(p.name for p in out.iterdir()) == ["report.md", "runs", "study.json"]
    assert [p.name for p in (out / "runs").iterdir()] == ["old"]
    # a complete study replaces the old one, runs included
    calls.clear()
    fail_at[0] = 0
    study_mod.run_study("tiny", out, experiments=("single_node",), progress=False)
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["single_node"]
    assert (out / "report.md").read_text().startswith("# instride reproduction")
    assert json.loads((out / "study.json").read_text())["load_average"]["start"]


def _stop_consumer_rank(out: Path, work: Path, stopped: list[int], done: threading.Event
                        ) -> None:
    """SIGSTOP the consumer rank (PMI_RANK 1) of the run writing to ``out`` once frames
    appear in ``work`` (every rank is past MPI's start-up and the start line then)."""
    while not done.is_set() and not stopped:
        if not any(work.rglob("frame_*.isf")):
            time.sleep(0.02)
            continue
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes()
                env = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"instride.bench.workflow" in cmd and str(out).encode() in cmd \
                    and b"PMI_RANK=1" in env and b"python" in cmd.split(b"\0")[0]:
                os.kill(int(proc.name), signal.SIGSTOP)
                stopped.append(int(proc.name))
                return
        time.sleep(0.02)


def test_hung_consumer_fails_the_run_within_the_wait_limit(tmp_path: Path) -> None:
    from instride.bench.workflow_run import BenchRunError

    # instride: the producer waits for nobody while it writes, only at the start and end
    # lines; a consumer that hangs (SIGSTOP) must fail the run after about --timeout there,
    # not after the repetition's whole time budget
    cfg = RunConfig(atoms=500, frames=40, pairs=1, backend="instride", time_scale=0.05,
                    timeout=3.0, workdir=str(tmp_path / "work"))
    out = tmp_path / "out"
    stopped: list[int] = []
    done = threading.Event()
    watcher = threading.Thread(target=_stop_consumer_rank,
                               args=(out, tmp_path / "work", stopped, done))
    watcher.start()
    start = time.monotonic()
    try:
        with pytest.raises(BenchRunError) as info:
            run(cfg, out, progress=False)
    finally:
        done.set()
        watcher.join()
        for pid in stopped:  # (killed with the job's process group; in case it was not)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert stopped, "the consumer rank was never found"
    assert "SyncTimeout" in str(info.value), str(info.value)
    assert time.monotonic() - start < 0.5 * cfg.time_budget(), str(info.value)


class _ShortBudget(RunConfig):
    """A configuration whose repetition may run 3 s, far less than its frames take."""

    def time_budget(self, slack: float = 60.0) -> float | None:
        return 3.0


def test_repetition_over_its_budget_reports_the_ranks_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from instride.bench.workflow_run import BenchRunError

    # every rank writes its import times to stderr as it starts: output to report
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    cfg = _ShortBudget(atoms=500, frames=200, pairs=1, backend="localfs", time_scale=0.05,
                       timeout=60.0, workdir=str(tmp_path / "work"))
    before = _leftovers()
    with pytest.raises(BenchRunError, match="exceeded 3 s") as info:
        run(cfg, tmp_path / "out", progress=False)
    assert "import time:" in str(info.value), str(info.value)
    new = _leftovers() - before
    from instride.bench.workflow_run import segments_in_use
    assert new - segments_in_use(new) == set(), new


@pytest.mark.parametrize("backend", ["instride", "localfs"])
def test_keep_frames_keeps_the_frames_in_the_workdir(backend: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    summary = run(_config(backend, 1, repetitions=2, keep_frames=True, workdir=str(work)),
                  tmp_path / "out", progress=False)
    assert len(list(work.rglob("*.isf"))) == 2 * PAIRS * FRAMES  # every frame of both reps
    kept = [Path(p) for p in summary["frames_kept"]]
    assert len(kept) == 2 and all(p.is_relative_to(work) for p in kept)  # one per repetition
    for where in kept:
        frames = sorted(where.rglob("*.isf"))
        assert len(frames) == PAIRS * FRAMES, frames
    # without --keep-frames nothing stays
    summary = run(_config(backend, 1, workdir=str(tmp_path / "work2")), tmp_path / "out2",
                  progress=False)
    assert summary["frames_kept"] == []
    assert list((tmp_path / "work2").rglob("*.isf")) == []


def test_time_budget_allows_for_moving_the_frames() -> None:
    # the paper preset's largest scaling run: 16 STMV pairs through one sshfs server. Moving
    # its frames (write + read, one server at an optimistic 200 MB/s) alone takes longer
    # than three frame periods per frame
    cfg = RunConfig(model="STMV", frames=128, pairs=16, nodes=2, backend="sharedfs")
    frame_bytes = cfg.resolved_model().frame_bytes("paper")
    moving = cfg.frames * cfg.pairs * 2 * frame_bytes / 200e6
    assert cfg.time_budget() >= cfg.frames * cfg.frame_period + moving
