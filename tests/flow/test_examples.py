"""The shipped examples under examples/flow/ run as they are (with short OpenMM runs)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from instride.flow import load_graph, run

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "flow"


def test_ensemble_example(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = load_graph(EXAMPLES / "ensemble.py", {"replicas": 2, "steps": 40, "interval": 10})
    run(g, out=out, timeout=300)
    rows = list(csv.DictReader((out / "ensemble.csv").open()))
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40]
    for r in rows:  # the reduction tree delivered both replicas' values of each step
        values = [float(r["rg0"]), float(r["rg1"])]
        assert min(values) > 5.0 and max(values) < 15.0  # villin's Rg is ~9.4 Å
        assert abs(float(r["mean_rg"]) - sum(values) / 2) < 1e-3
    assert (out / "ensemble.png").stat().st_size > 1000
    drawn = json.loads((out / "live.json").read_text())["steps_drawn"]
    assert drawn == sorted(drawn) and drawn[-1] == 40  # newest sampling ends on the newest
    assert (out / "live.png").exists()


def test_steering_example_changes_interval_then_stops_openmm(flow_env: dict[str, Path]) -> None:
    out = flow_env["out"]
    g = load_graph(EXAMPLES / "steering.py",
                   {"steps": 100_000, "interval": 10, "factor": 5, "densify_at": -1.0,
                    "max_frames": 5})
    run(g, out=out, timeout=300)
    log = json.loads((out / "sim-0.json").read_text())
    controls = [c for _, c in log["controls"]]
    assert controls == [{"interval": 2}, {"stop": True}]
    intervals = [i for _, i in log["published"]]
    assert intervals[0] == 10 and intervals[-1] == 2  # the simulation obeyed ...
    assert log["published"][-1][0] < 1000  # ... and stopped long before its 100,000 steps
    lines = (out / "watch.csv").read_text().splitlines()
    assert "{'interval': 2}" in lines[1] and any("{'stop': True}" in x for x in lines)
