"""``instride job -- instride flow run GRAPH.py`` in a real Slurm batch job on emulated nodes:
the slurm launcher is chosen from ``SLURM_JOB_ID``, places instances by node index as
``srun --overlap`` steps (also the end of the outputs a ``command=`` program left open, on its
node), and leaves nothing behind, whether the graph ends or fails."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from instride.emulate.slurm import EmulatedSlurm
from instride.flow import FlowError, SlurmLauncher
from tests.launch.conftest import PY, settle, tree

GRAPH = '''
import json, sys, time
import numpy as np
from instride.flow import Graph

def produce(ports, n=5):
    for step in range(n):
        ports.put("out", np.array([step, 10.0 * step]), step=step)
    ports.put("where", {"node": ports.node}, step=0)

def consume(ports):
    rows = []
    while ports.wait():
        msg = ports.get("out")
        if msg is None:
            break
        rows.append([msg.step, msg.data.tolist()])
    where = ports.get("where")
    with open(ports.out_dir / "result.json", "w") as f:
        json.dump({"rows": rows, "producer": where.data["node"] if where else None,
                   "consumer": ports.node}, f)

def hang(ports):
    print("hanging", flush=True)
    time.sleep(600)

def boom(ports):
    time.sleep(1)
    raise SystemExit(3)

#: a program (command=) that sends three arrays and exits with status 0 without ports.close()
NOCLOSE = """
from instride.flow import from_env
import numpy as np
ports = from_env()
for step in range(3):
    ports.put("out", np.array([step, 10.0 * step]), step=step)
ports.put("where", {"node": ports.node}, step=0)
"""

def build(fail=False, noclose=False):
    g = Graph("slurmflow")
    if noclose:  # (the runner ends its outputs on its node: an srun step of its own)
        src = g.module("src", command=[sys.executable, "-c", NOCLOSE],
                       outputs={"out": "array", "where": "json"}, nodes=[0])
        dst = g.module("dst", consume, inputs={"out": "array", "where": "json"}, nodes=[1])
        g.connect(src.output("out"), dst.input("out"))
        g.connect(src.output("where"), dst.input("where"))
        return g
    if fail:
        g.module("hang", hang, nodes=[0])
        g.module("boom", boom, nodes=[1])
        return g
    src = g.module("src", produce, outputs={"out": "array", "where": "json"}, nodes=[0])
    dst = g.module("dst", consume, inputs={"out": "array", "where": "json"}, nodes=[1])
    g.connect(src.output("out"), dst.input("out"))
    g.connect(src.output("where"), dst.input("where"))
    return g
'''


@pytest.fixture(scope="module")
def slurm() -> Iterator[EmulatedSlurm]:
    with EmulatedSlurm(nodes=2, kill_wait=8) as cluster:
        yield cluster
        leftovers = settle(cluster)
    assert leftovers == {}


@pytest.mark.root
def test_slurm_flow_run_across_two_nodes(slurm: EmulatedSlurm, tmp_path: Path) -> None:
    (tmp_path / "graph.py").write_text(GRAPH)
    scratch, states, flow_state = tmp_path / "s", tmp_path / "states", tmp_path / "flowstate"
    out = tmp_path / "job.txt"
    job_cmd = f"{PY} -m instride job --dir {scratch}/%n/j%j --"
    body = textwrap.dedent(f"""\
        #!/bin/sh
        export INSTRIDE_JOB_STATE_DIR={states} INSTRIDE_FLOW_STATE={flow_state}
        cd {tmp_path}
        {job_cmd} sh {tmp_path}/ok.sh
        {job_cmd} {PY} -m instride flow run graph.py -p noclose=true --out {tmp_path}/nc \\
            --timeout 60
        echo "== noclose rc=$?"
        {job_cmd} {PY} -m instride flow run graph.py -p fail=true --out {tmp_path}/bad \\
            --timeout 60
        echo "== fail rc=$?"
        squeue -h -s -j $SLURM_JOB_ID -o "step %i %j"
        """)
    # the graph, then what its run left in each node's managed directory (nothing)
    (tmp_path / "ok.sh").write_text(textwrap.dedent(f"""\
        {PY} -m instride flow run graph.py --out {tmp_path}/ok --timeout 60
        echo "== ok rc=$?"
        srun --overlap -N2 -n2 --ntasks-per-node=1 sh -c \
          'echo "left on $INSTRIDE_NODE: [$(ls -A $INSTRIDE_DIR $INSTRIDE_DIR/.instride/streams \
           2>/dev/null | grep -cx flow)]"'
        """))
    job = slurm.sbatch(body, "-N", "2", f"--output={out}")
    assert slurm.wait(job, timeout=120) == "COMPLETED", out.read_text()
    text = out.read_text()
    info = slurm.job(job)
    nodes = slurm.run(["scontrol", "show", "hostnames", info["NodeList"]], capture_output=True,
                      text=True).stdout.split()
    assert "== ok rc=0" in text, text
    assert f"started src[0] on {nodes[0]}" in text and f"started dst[0] on {nodes[1]}" in text
    assert f"left on {nodes[0]}: [0]" in text and f"left on {nodes[1]}: [0]" in text, text
    result = json.loads((tmp_path / "ok" / "result.json").read_text())
    assert result == {"rows": [[s, [float(s), 10.0 * s]] for s in range(5)],
                      "producer": nodes[0], "consumer": nodes[1]}
    assert (tmp_path / "ok" / "trace.json").exists()
    # a program that exited 0 without ports.close(): its outputs ended on its node (an srun
    # step of `python -m instride.flow.worker --end`), its consumer took all and finished
    assert "== noclose rc=0" in text, text
    assert "finished src[0]" in text and "finished dst[0]" in text, text
    result = json.loads((tmp_path / "nc" / "result.json").read_text())
    assert result == {"rows": [[s, [float(s), 10.0 * s]] for s in range(3)],
                      "producer": nodes[0], "consumer": nodes[1]}
    assert "ended by the runner" in (tmp_path / "nc" / "logs" / "src.0.log").read_text()
    # the failing graph: boom fails on node 1, the hanging step on node 0 is stopped
    assert "== fail rc=1" in text, text
    assert "FAILED boom[0] (exit status 3)" in text
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert steps and not [line for line in steps if "flow-" in line]  # only the batch step
    assert "hanging" in (tmp_path / "bad" / "logs" / "hang.0.log").read_text()
    assert settle(slurm) == {}  # no step, agent, server or Redis left on any node
    assert tree(scratch) == [] and tree(states) == [] and tree(flow_state) == []


def test_slurm_launcher_outside_a_job_is_refused() -> None:
    with pytest.raises(FlowError, match="SLURM_JOB_ID is not set"):
        SlurmLauncher(env={"PATH": "/usr/bin"})
    with pytest.raises(FlowError, match="instride job"):
        SlurmLauncher(env={"PATH": "/usr/bin", "SLURM_JOB_ID": "7"})


def test_slurm_launcher_with_cluster_is_refused(tmp_path: Path) -> None:
    import subprocess

    (tmp_path / "graph.py").write_text(GRAPH)
    proc = subprocess.run([PY, "-m", "instride", "flow", "run", "graph.py", "--launcher", "slurm",
                           "--cluster", "c1"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--cluster is for the emulated launcher" in proc.stderr
