"""End-to-end runs of every backend on one node and on two emulated nodes.

Real MPI (the venv's mpiexec), real processes, real emulated nodes (network namespaces, per-node
data servers, Redis) for the two-node runs. Each run checks that every frame arrived intact
(the consumer verifies checksums and MD steps) and that the timing table is complete and
consistent.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

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


def check_run(out: Path, summary: dict, backend: str, nodes: int, reps: int = 1) -> None:
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
        regions = expected_regions(backend, rank["role"])
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
    assert "paper 192.9×; here" in report and "**" in report
    assert (rep / "figures" / "single_node.png").stat().st_size > 1000
    with open(rep / "tables" / "single_node.csv", newline="") as fh:
        assert {r["backend"] for r in csv.DictReader(fh)} == {"instride", "localfs"}
