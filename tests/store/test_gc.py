"""instride gc: a running writer's temporary file is left alone, judged from any PID namespace."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from instride.interception.preload import preload_path
from instride.keys import TMP_PATTERN

#: a writer through instride's file API (argv[1] "api") or an unmodified Python program under
#: the preload library ("plain": the builtin open on the managed path), holding its file open
WRITER = textwrap.dedent(
    """
    import os, sys
    kind, root = sys.argv[1], sys.argv[2]
    if kind == "api":
        import instride
        fh = instride.open("held/k.bin", "wb")
    else:
        fh = open(os.path.join(root, "held", "k.bin"), "wb")
    fh.write(b"x" * 100_000)
    fh.flush()
    print("writing", flush=True)
    sys.stdin.readline()
    fh.write(b"y")
    fh.close()
    print("closed", flush=True)
    """
)


def _temps(root: Path) -> list[Path]:
    return [p for p in (root / "held").iterdir() if TMP_PATTERN.match(p.name)]


@pytest.mark.parametrize("kind", ["api", "plain"])
def test_gc_in_another_pid_namespace_leaves_a_running_writers_file(managed_dir: Path,
                                                                   kind: str) -> None:
    # the writer locks its temporary file (shared) while it writes: a gc run where its process
    # id names nothing (a new PID namespace) leaves the file, and the writer publishes it
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    env = dict(os.environ)
    if kind == "plain":
        (managed_dir / "held").mkdir()
        env["LD_PRELOAD"] = str(preload_path())
    proc = subprocess.Popen([sys.executable, "-c", WRITER, kind, str(managed_dir)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "writing"
        [temp] = _temps(managed_dir)
        assert str(proc.pid) in temp.name
        gc = [unshare, "--pid", "--fork", sys.executable, "-m", "instride", "gc"]
        out = subprocess.run(gc, capture_output=True, text=True, check=True)
        assert temp.exists(), out.stdout
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "closed"
        assert (managed_dir / "held" / "k.bin").read_bytes() == b"x" * 100_000 + b"y"
        assert _temps(managed_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_gc_removes_a_killed_writers_file_from_another_pid_namespace(managed_dir: Path) -> None:
    # the lock goes with the writer however it ends: killed, its file is collected, also by a
    # gc that cannot see its process id (the id then looks dead: a new PID namespace)
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed (apt-get install util-linux)"
    assert os.geteuid() == 0, "a new PID namespace needs root"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, "api", str(managed_dir)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
        [temp] = _temps(managed_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        gc = [unshare, "--pid", "--fork", sys.executable, "-m", "instride", "gc"]
        out = subprocess.run(gc, capture_output=True, text=True, check=True)
        assert str(temp) in out.stdout and not temp.exists()
        assert not (managed_dir / "held" / "k.bin").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
