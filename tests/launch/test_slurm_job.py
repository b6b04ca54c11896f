"""``instride job`` inside real Slurm batch jobs on emulated nodes.

Each emulated node is a network namespace with its own host name and its own ``slurmd``; the
jobs run producers on one node and consumers on another through the preload library and the
Python API, and the tests check the results, the job states (``scontrol show job``/``squeue``)
and that nothing is left behind: no process but ``slurmd`` on any node, no managed directory,
no service record.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from instride.emulate import netns as nn
from instride.emulate.slurm import EmulatedSlurm

from .conftest import PY, job_script, settle, tree

pytestmark = pytest.mark.root


def _wait_for(path: Path, text: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s:\n"
                         f"{path.read_text() if path.exists() else '(no file)'}")


def _build_streams(out: Path) -> Path:
    """Compile the C++ stream test driver (tests/preload/c/streams.cpp)."""
    root = Path(__file__).resolve().parents[2]
    gxx = shutil.which("g++")
    assert gxx, "g++ is required (apt-get install g++)"
    exe = out / "streams"
    from instride.interception.preload import build_flags  # stream.hpp links libinstride.so

    proc = subprocess.run([gxx, "-std=c++17", "-O1", "-o", str(exe),
                           str(root / "tests" / "preload" / "c" / "streams.cpp"), "-pthread",
                           *build_flags()],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return exe


def test_slurm_job_moves_files_between_nodes(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    """Producers on one node, consumers on the other: Python API, preload library, C++ streams.

    Two steps per node, each node one CPU: the steps wait for each other's files, so they must
    run at the same time (``--overlap``); without it Slurm runs them one after the other and the
    job's progress hangs on srun's retry back-off (seen once: still RUNNING after 120 s).
    """
    states = tmp_path / "states"
    out = tmp_path / "out.txt"
    consumer = textwrap.dedent("""
        import os, instride
        with instride.open("run/py.dat", "wb") as f:
            f.write(("python-" + os.environ["INSTRIDE_NODE"]).encode())
        print("api-read", instride.open("run/pre.dat", timeout=60).read().decode().strip())
        print("api-read-cpp", instride.open("run/cpp.txt", timeout=60).read().decode().split())
    """)
    (tmp_path / "consumer.py").write_text(consumer)
    cpp = _build_streams(tmp_path)  # include/instride/stream.hpp's test driver
    body = f"""
{PY} -m instride job --dir {scratch}/%n/job%j -- sh -c '
  srun --overlap -N1 -n1 --relative=1 {PY} {tmp_path}/consumer.py &
  srun --overlap -N1 -n1 --relative=1 sh -c "echo cpp-read \\$({cpp} consume \\$INSTRIDE_DIR/run/pre.dat)" &
  srun --overlap -N1 -n1 --relative=0 sh -c "{cpp} produce \\$INSTRIDE_DIR/run/cpp.txt 2" &
  srun --overlap -N1 -n1 --relative=0 {PY} -m instride run -- sh -c \\
    "echo preload-\\$INSTRIDE_NODE > \\$INSTRIDE_DIR/run/pre.dat && \\
     echo preload-read \\$(cat \\$INSTRIDE_DIR/run/py.dat)"
  wait
'
echo "job rc=$?"
"""
    job = slurm.sbatch(job_script(slurm, body, states=states), "-N", "2", f"--output={out}")
    state = slurm.wait(job, timeout=120)
    text = out.read_text()
    info = slurm.job(job)
    assert state == "COMPLETED", text
    assert info["ExitCode"] == "0:0"
    assert "job rc=0" in text
    nodes = slurm.run(["scontrol", "show", "hostnames", info["NodeList"]], capture_output=True,
                      text=True).stdout.split()
    producer_node, consumer_node = nodes[0], nodes[1]
    assert f"api-read preload-{producer_node}" in text
    assert f"preload-read python-{consumer_node}" in text
    assert f"cpp-read preload-{producer_node}" in text
    assert "api-read-cpp ['line', '0', 'line', '1']" in text
    assert all(row["id"] != str(job) for row in slurm.squeue())
    assert settle(slurm) == {}
    assert tree(scratch) == []  # every node's managed directory removed
    assert tree(states) == []


def test_slurm_scancel_mid_run_cleans_up(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    states = tmp_path / "states"
    out = tmp_path / "out.txt"
    waiter = ("import instride; print('waiting', flush=True); "
              "instride.open('never/published', timeout=600)")
    body = (f"{PY} -m instride job --iface eth0 --dir {scratch}/%n/job%j -- "
            f"srun -N3 -n3 {PY} -c \"{waiter}\"")
    job = slurm.sbatch(job_script(slurm, body, states=states), "-N", "3", f"--output={out}")
    text = _wait_for(out, "waiting")
    assert "services up on 3 node(s)" in text
    assert len(list(scratch.glob("node*/job*/.instride/node.env"))) == 3
    slurm.scancel(job)
    assert slurm.wait(job, timeout=60) == "CANCELLED"
    assert settle(slurm) == {}
    assert tree(scratch) == []
    assert tree(states) == []


def test_slurm_failing_command_keeps_its_status(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    states = tmp_path / "states"
    out = tmp_path / "out.txt"
    # Placement and GPU settings meant for the job's steps (both tasks on the first node, a
    # task per GPU) must not move or break the services: still one agent per node; nor may a
    # site's SLURM_EXPORT_ENV=NONE keep the job's variables from the agents.
    steps_env = "unset SLURM_NTASKS_PER_GPU SLURM_EXPORT_ENV"
    body = (f"{PY} -m instride job --dry-run --dir {scratch}/%n/job%j\n"
            f"printf 'node1\\nnode1\\n' > {tmp_path}/hosts\n"
            f"export SLURM_HOSTFILE={tmp_path}/hosts SLURM_DISTRIBUTION=arbitrary\n"
            "export SLURM_NTASKS_PER_GPU=1 SLURM_EXPORT_ENV=NONE\n"
            f"{PY} -m instride job --dir {scratch}/%n/job%j -- "
            f"sh -c '{steps_env}; srun -n2 --overcommit sh -c \"echo step-on \\$INSTRIDE_NODE\"; "
            # a step where no service runs for its job id: the task prolog unsets the batch
            # host's (node1's) settings instead of leaving them
            "INSTRIDE_JOB_ID=none srun -n1 sh -c "
            "\"echo no-service \\${INSTRIDE_DIR-unset} \\${INSTRIDE_NODE-unset}\"; exit 7'")
    job = slurm.sbatch(job_script(slurm, body, states=states), "-N", "2", f"--output={out}",
                       "-w", "node1,node2")
    assert slurm.wait(job, timeout=120) == "FAILED", out.read_text()
    assert slurm.job(job)["ExitCode"] == "7:0"
    text = out.read_text()
    assert "launcher:  slurm" in text and "srun --overlap --nodes=2 --ntasks=2" in text
    assert "--export=ALL" in text
    assert "services up on 2 node(s)" in text, text
    assert text.count("step-on node1") == 2
    assert "instride: no instride service on node1 for job none" in text
    assert "no-service unset unset" in text
    assert settle(slurm) == {}
    assert tree(scratch) == []
    assert tree(states) == []


def test_slurm_bad_input_gives_typed_errors_and_leaves_nothing(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    """Redis unreachable, a node whose server cannot start, a live and a dead stale service."""
    states = tmp_path / "states"
    (scratch / "node1").mkdir(parents=True)
    (scratch / "node2").write_text("a file where node2's directory should go\n")
    states.mkdir(mode=0o700)  # a state directory open to others is refused
    (tmp_path / "other").mkdir()
    out = tmp_path / "out.txt"
    # node2's data server port is taken by another program.
    busy = nn.in_netns(slurm.node(2).netns, lambda: socket.create_server(("0.0.0.0", 0)))
    busy_port = busy.getsockname()[1]
    live = subprocess.Popen(["sleep", "300"])
    try:
        stat = Path(f"/proc/{live.pid}/stat").read_text()
        start = int(stat[stat.rfind(")") + 2:].split()[19])
        # node3 still runs the service of an earlier job (a live process; recorded by the
        # script before the third `instride job`) ...
        record = (f'{{"job": "999", "node": "node3", "dir": "/nonexistent", "pid": {live.pid}, '
                  f'"start": {start}}}')
        # ... node1's earlier service died and left its directory behind.
        dead_dir = scratch / "node1" / "job-old"
        (dead_dir / ".instride").mkdir(parents=True)
        (dead_dir / "frame.dat").write_text("stale")
        (states / "node1.json").write_text(
            f'{{"job": "old", "node": "node1", "dir": "{dead_dir}", "pid": 999999999, '
            f'"start": 1}}')
        job_cmd = f"{PY} -m instride job --dir {scratch}/%n/job%j --ready-timeout 30"
        body = f"""
INSTRIDE_REDIS_URL=redis://{slurm.hub_ip}:1/0 {job_cmd} -- true 2>&1; echo "== redis rc=$?"
{job_cmd} -- true 2>&1; echo "== node2 rc=$?"
{job_cmd} --dir {scratch}/{"x" * 90}/%n/job%j -- true 2>&1; echo "== long rc=$?"
{job_cmd} --iface nope0 -- true 2>&1; echo "== iface rc=$?"
{job_cmd} --dir {tmp_path}/other/%n/p%j --port {busy_port} -- true 2>&1; echo "== port rc=$?"
echo '{record}' > {states}/node3.json
{job_cmd} --dir {tmp_path}/other/%n/ok%j -- true 2>&1; echo "== stale rc=$?"
{job_cmd} --dir /tmp/instride-slurm-bad -- true 2>&1; echo "== pattern rc=$?"
"""
        job = slurm.sbatch(job_script(slurm, body, states=states), "-N", "3",
                           f"--output={out}")
        assert slurm.wait(job, timeout=120) == "COMPLETED"
        text = out.read_text()
        assert "== redis rc=6" in text
        assert f"metadata service redis://{slurm.hub_ip}:1/0 unavailable" in text
        assert "== node2 rc=6" in text
        assert "instride service of node node2 did not start" in text
        assert "cannot create its managed directory" in text
        assert "== stale rc=6" in text
        assert f"node node3 did not start: it still runs the service of job 999 (pid {live.pid})"\
            in text
        assert "== pattern rc=2" in text and "must contain %j" in text
        assert "== long rc=6" in text and "too long for the data server's Unix socket" in text
        assert "== iface rc=6" in text and "network interface 'nope0' has no IPv4 address" in text
        assert "== port rc=6" in text
        assert re.search(r"node node2 did not start: `instride serve` on \S+:" + str(busy_port)
                         + r" exited with status \d+: .*[Aa]ddress already in use", text), text
        assert settle(slurm) == {}
        assert live.poll() is None  # a live earlier service is never touched
        # The dead service's leftovers went (the first job's node1 agent removed them).
        assert not dead_dir.exists()
        assert tree(scratch) == ["node1", "node2"]
        assert tree(tmp_path / "other") == []  # parents it created went too
        assert tree(states) == ["node3.json"]
        # `instride job --cleanup` on node3 stops the recorded service (by PID) and its record.
        proc = subprocess.run(
            slurm.node_command(3, [PY, "-m", "instride", "job", "--cleanup",
                                   "--state-dir", str(states)]),
            capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "stopped the service of job 999" in proc.stdout
        assert live.wait(10) == -15
        assert tree(states) == []
    finally:
        busy.close()
        live.kill()
        live.wait()


def test_slurm_service_lost_mid_run_stops_the_command(
    slurm: EmulatedSlurm, tmp_path: Path, scratch: Path
) -> None:
    """A node's data server dies while the command runs: the command is stopped (not left
    to go on without services), the error names the node, the exit status is 6.

    (The step does not use instride: a client still polling node2's directory after its
    service removed it would re-create part of it.)
    """
    states = tmp_path / "states"
    out = tmp_path / "out.txt"
    body = (f"{PY} -m instride job --dir {scratch}/%n/job%j -- "
            "srun -N3 -n3 sh -c 'echo waiting; exec sleep 600'\necho \"job rc=$?\"")
    job = slurm.sbatch(job_script(slurm, body, states=states), "-N", "3", f"--output={out}",
                       "-w", "node1,node2,node3")
    _wait_for(out, "waiting")
    servers = [pid for pid in slurm.node_pids(2)
               if b"instride\x00serve" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(servers) == 1
    os.kill(servers[0], signal.SIGKILL)
    assert slurm.wait(job, timeout=120) == "COMPLETED", out.read_text()
    text = out.read_text()
    assert "the services ended under the command (node node2); stopping it" in text
    assert "job rc=6" in text, text
    assert "the instride service of node node2 ended while the command ran" in text, text
    assert "the data server ended on its own" in text
    assert settle(slurm) == {}
    assert tree(scratch) == []
    assert tree(states) == []
