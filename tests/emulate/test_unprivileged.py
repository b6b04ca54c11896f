"""Emulated nodes whose processes run without capabilities, as a user's processes on a cluster
node do: data servers, producers and readers work across nodes with no privilege at all.

Needs root (the namespaces), iproute2, redis-server and setpriv (util-linux).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster

pytestmark = pytest.mark.root

PY = sys.executable

#: the effective capabilities of a process (hex, from /proc/<pid>/status)
CAPS = "import sys; print(next(l.split()[1] for l in open(sys.argv[1]) if l.startswith('CapEff')))"

PRODUCE = textwrap.dedent(
    """
    import hashlib, numpy as np, instride
    rng = np.random.default_rng(7)
    out = []
    with instride.Stream("bounded", mode="w", layout="paper", retain=4, groups=["g"]) as b, \\
            instride.Stream("kept", mode="w", layout="paper") as k:
        for i in range(40):
            pos = rng.random((5000, 3)) * 50
            b.append(pos, step=i)
            k.append(-pos, step=i)
            out.append(hashlib.sha256(pos.tobytes()).hexdigest())
    with instride.open("files/x.bin", "wb") as fh:
        fh.write(b"unprivileged" * 1000)
    print(" ".join(out))
    """
)
CONSUME = textwrap.dedent(
    """
    import hashlib, numpy as np, instride
    print(open("/proc/self/status").read().split("CapEff:")[1].split()[0])
    got = [hashlib.sha256(np.ascontiguousarray(f.positions).tobytes()).hexdigest()
           for f in instride.Stream("bounded", timeout=60, group="g")]
    kept = [hashlib.sha256(np.ascontiguousarray(-f.positions).tobytes()).hexdigest()
            for f in instride.Stream("kept", timeout=60)]
    data = instride.open("files/x.bin", timeout=60).read()
    print(" ".join(got))
    print(" ".join(kept))
    print(data == b"unprivileged" * 1000, instride.get_client().cluster.transfers > 0)
    """
)


def test_nodes_without_capabilities_move_frames_between_them(tmp_path: Path) -> None:
    """Every node process has no capability (the data servers and the programs started on
    the nodes); a bounded stream read as a group from the other node, an unbounded one and a
    file arrive exact; the idle helper's prefault is off there, and says why."""
    with EmulatedCluster(nodes=2, name="u" + secrets.token_hex(5), base_dir=tmp_path / "b",
                         unprivileged=True) as c:
        status = c.status()
        assert status["unprivileged"] is True
        for node in status["nodes"]:
            caps = subprocess.run([PY, "-c", CAPS, f"/proc/{node['server']['pid']}/status"],
                                  capture_output=True, text=True, check=True).stdout.strip()
            assert int(caps, 16) == 0, f"{node['name']}'s data server has capabilities {caps}"
        reader = c.popen(2, [PY, "-c", CONSUME], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        try:
            producer = c.run(1, [PY, "-c", PRODUCE], capture_output=True, text=True, timeout=120)
            assert producer.returncode == 0, producer.stderr
            out, err = reader.communicate(timeout=120)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.communicate()
        assert reader.returncode == 0, err
        caps, got, kept, checks = out.splitlines()
        sent = producer.stdout.split()
        assert int(caps, 16) == 0
        assert got.split() == sent and kept.split() == sent and len(sent) == 40
        assert checks == "True True"  # the file's bytes, fetched from node 1
        info = c.run(1, [PY, "-m", "instride", "info", "--json"], capture_output=True, text=True,
                     check=True, timeout=60).stdout
        assert json.loads(info)["prefault"].startswith("off")
        # another process attaching to it (`instride cluster exec`) runs its nodes' commands
        # the same way
        again = EmulatedCluster.attach(c.name)
        assert again.unprivileged and again.command(1, ["true"])[-3:] == ["--no-new-privs", "--",
                                                                           "true"]
