"""``instride job``: options that do not go together are refused, never ignored."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PY = sys.executable


def _job(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "instride", "job", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def _start_time(pid: int) -> int:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return int(raw[raw.rfind(")") + 2:].split()[19])


@pytest.fixture
def recorded_service(tmp_path: Path) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes]]]:
    """A state directory recording a live "service" (a sleep) and its managed directory."""
    states = tmp_path / "states"
    states.mkdir(mode=0o700)
    managed = tmp_path / "managed"
    (managed / ".instride").mkdir(parents=True)
    (managed / "frame.bin").write_bytes(b"data")
    service = subprocess.Popen(["sleep", "300"])
    node = socket.gethostname().split(".")[0]
    (states / f"{node}.json").write_text(json.dumps(
        {"job": "42", "pid": service.pid, "start": _start_time(service.pid), "dir": str(managed)}))
    try:
        yield states, managed, service
    finally:
        service.kill()
        service.wait()


@pytest.mark.parametrize("extra", [
    ["--dry-run"],
    ["--", "echo", "never runs"],
    ["--launcher", "slurm"],
    ["--hostfile", "hosts"],
    ["--dir", "/dev/shm/x-%n"],
    ["--port", "7000"],
    ["--iface", "lo"],
    ["--mpiexec", "mpiexec"],
])
def test_cleanup_refuses_options_it_would_ignore_and_touches_nothing(
        recorded_service: tuple[Path, Path, subprocess.Popen[bytes]], extra: list[str]) -> None:
    """`--cleanup --dry-run` used to run the cleanup: the live service killed, its managed
    directory removed, exit status 0; other options were silently ignored the same way."""
    states, managed, service = recorded_service
    out = _job("--cleanup", "--state-dir", str(states), *extra)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--cleanup" in out.stderr
    time.sleep(0.2)
    assert service.poll() is None  # still running
    assert (managed / "frame.bin").read_bytes() == b"data"
    assert len(list(states.iterdir())) == 1  # the record kept


def test_only_job_without_cleanup_is_refused() -> None:
    out = _job("--only-job", "42", "--dry-run")
    assert out.returncode == 2 and "--only-job" in out.stderr, out.stderr


@pytest.mark.parametrize("option", ["--hostfile", "--mpiexec"])
def test_mpiexec_options_with_the_slurm_launcher_are_refused(option: str) -> None:
    out = _job("--launcher", "slurm", option, "x", "--dry-run")
    assert out.returncode == 2 and option in out.stderr, out.stderr


@pytest.mark.parametrize("kind", ["open to others", "a file"])
def test_an_unusable_state_dir_is_a_bad_option(tmp_path: Path, kind: str) -> None:
    """An unusable --state-dir (mode 1777, a file) exited 1, not the documented 2."""
    states = tmp_path / "states"
    if kind == "a file":
        states.write_text("")
    else:
        states.mkdir()
        os.chmod(states, 0o1777)
    out = _job("--cleanup", "--state-dir", str(states))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--state-dir" in out.stderr and str(states) in out.stderr


def test_cleanup_still_stops_the_recorded_service(
        recorded_service: tuple[Path, Path, subprocess.Popen[bytes]]) -> None:
    states, managed, service = recorded_service
    out = _job("--cleanup", "--state-dir", str(states), "--only-job", "42")
    assert out.returncode == 0, out.stderr
    assert "stopped the service of job 42" in out.stdout
    assert service.wait(10) is not None and not managed.exists()
