"""The command-line contract: one meaning of ``--timeout`` and ``INSTRIDE_TIMEOUT`` (0: do not
wait; inf/unset: forever; negative: refused), distinct exit codes per kind of failure, and
failed waits that leave nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import instride
from instride import errors as e
from instride.cli import (
    EXIT_ERROR,
    EXIT_INTEGRITY,
    EXIT_INVALID,
    EXIT_REFUSED,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    exit_code,
)
from instride.errors import ConfigError, ConsumeTimeout
from tests.conftest import free_port


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_exit_code_table_is_distinct_per_kind() -> None:
    cases = {
        e.ConfigError("INSTRIDE_X", "v", "bad"): EXIT_USAGE,
        e.ConsumeTimeout("k", 1.0): EXIT_TIMEOUT,
        e.KeyValidationError("k/", "bad"): EXIT_INVALID,
        e.UnsafePathError("k", "link"): EXIT_INVALID,
        e.FileTypeError("k", "dir"): EXIT_INVALID,
        e.KeyExistsError("k"): EXIT_INVALID,
        e.KeyNotFoundError("k"): EXIT_INVALID,
        e.UnsupportedModeError("a", "no"): EXIT_INVALID,
        e.IntegrityError("k", "checksum"): EXIT_INTEGRITY,
        e.TransferError("k", "cut"): EXIT_INTEGRITY,
        e.PeerUnavailable("n", "down"): EXIT_UNAVAILABLE,
        e.MetadataUnavailable("redis://", "down"): EXIT_UNAVAILABLE,
        e.AuthenticationError("bad token"): EXIT_REFUSED,
        e.EndOfStream("s", 3): EXIT_ERROR,
        RuntimeError("bug"): EXIT_ERROR,
    }
    for exc, code in cases.items():
        assert exit_code(exc) == code, exc
    assert len({EXIT_USAGE, EXIT_TIMEOUT, EXIT_INVALID, EXIT_INTEGRITY, EXIT_UNAVAILABLE,
                EXIT_REFUSED, EXIT_ERROR}) == 7


def test_exit_codes_of_real_commands(managed_dir: Path) -> None:
    with instride.open("run/k.bin", "wb") as fh:
        fh.write(b"payload")
    assert _cli("wait", "run/k.bin", "--timeout", "0").returncode == 0
    assert _cli("cat", "run/k.bin").stdout == "payload"
    assert _cli("wait", "--no-such-flag", "k").returncode == EXIT_USAGE
    res = _cli("wait", "absent", "--timeout", "0.1")
    assert res.returncode == EXIT_TIMEOUT and "timed out" in res.stderr
    for key in ("run/", "../x", "run"):  # a trailing slash, traversal, a directory
        res = _cli("wait", key, "--timeout", "1")
        assert res.returncode == EXIT_INVALID, (key, res.stderr)
        assert "Traceback" not in res.stderr
    env = dict(os.environ, INSTRIDE_REDIS_URL=f"redis://127.0.0.1:{free_port()}/0",
               INSTRIDE_CONNECT_TIMEOUT="0.5")
    res = _cli("wait", "k", "--timeout", "5", env=env)
    assert res.returncode == EXIT_UNAVAILABLE, res.stderr


def test_timeout_zero_means_do_not_wait_for_both(managed_dir: Path) -> None:
    t0 = time.monotonic()
    by_flag = _cli("wait", "absent", "--timeout", "0")
    by_env = _cli("wait", "absent", env=dict(os.environ, INSTRIDE_TIMEOUT="0"))
    assert by_flag.returncode == by_env.returncode == EXIT_TIMEOUT
    assert time.monotonic() - t0 < 30  # two interpreter start-ups, no wait
    with pytest.raises(ConsumeTimeout):
        instride.consume("absent", timeout=0)


@pytest.mark.parametrize("value", ["-1", "-0.001", "nan", "soon", "-inf"])
def test_negative_or_bad_timeouts_are_refused(managed_dir: Path, value: str) -> None:
    res = _cli("wait", "k", f"--timeout={value}")
    assert res.returncode == EXIT_USAGE and "--timeout" in res.stderr
    res = _cli("wait", "k", env=dict(os.environ, INSTRIDE_TIMEOUT=value))
    assert res.returncode == EXIT_USAGE and "INSTRIDE_TIMEOUT" in res.stderr


def test_negative_timeout_in_python_is_refused(client: instride.Client) -> None:
    with pytest.raises(ConfigError, match="timeout"):
        client.consume("k", timeout=-1)


def test_inf_waits_until_published(managed_dir: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "instride", "wait", "late", "--timeout", "inf"],
                            stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        assert proc.poll() is None
        with instride.open("late", "wb") as fh:
            fh.write(b"1")
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip().endswith("late")


def test_failed_waits_leave_nothing_behind(managed_dir: Path, client: instride.Client) -> None:
    (managed_dir / "kept").mkdir()
    before = _tree(managed_dir)
    assert _cli("wait", "a/b/c/key", "--timeout", "0.1").returncode == EXIT_TIMEOUT
    with pytest.raises(ConsumeTimeout):
        client.consume("kept/x/y/key", timeout=0.05)
    with pytest.raises(ConsumeTimeout):
        client.wait_any(["p/q/k1", "p/r/k2"], timeout=0.05)
    with pytest.raises(ConsumeTimeout):
        instride.Stream("s9", timeout=0.05).read(0)
    assert _tree(managed_dir) == before
    # a directory that gained a file meanwhile is kept
    with instride.open("a/b/late", "wb") as fh:
        fh.write(b"x")
    with pytest.raises(ConsumeTimeout):
        client.consume("a/b/c/key", timeout=0.05)
    assert _tree(managed_dir) == sorted([*before, "a", "a/b", "a/b/late"])
