"""include/instride/stream.hpp: C++17 streams over the C API (libinstride.so), no shim loaded."""

from __future__ import annotations

import errno
import os
import subprocess
import time
from pathlib import Path

import pytest

from .conftest import Builder, Shim


@pytest.fixture
def plain_env(shim: Shim) -> dict[str, str]:
    """The shim fixture's settings, without LD_PRELOAD: the streams work without the shim."""
    return {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}


def run(exe: Path, *args: object, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *map(str, args)], env=env, capture_output=True, timeout=60)


def test_consumer_first_then_producer(shim: Shim, build: Builder, plain_env: dict) -> None:
    exe = build("streams.cpp")
    key = shim.dir / "cpp" / "frames.txt"
    consumer = subprocess.Popen([str(exe), "consume", str(key)], env=plain_env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(0.4)
    assert consumer.poll() is None, "the ifstream must wait for the key"
    producer = run(exe, "produce", key, 2000, 20, env=plain_env)  # checks not-visible-before-close
    assert producer.returncode == 0, producer.stderr
    out, err = consumer.communicate(timeout=30)
    assert consumer.returncode == 0, err
    assert out.decode() == "".join(f"line {i}\n" for i in range(2000))
    assert shim.temps() == []


def test_write_once_and_append(shim: Shim, build: Builder, plain_env: dict) -> None:
    exe = build("streams.cpp")
    key = shim.dir / "cpp" / "once.txt"
    assert run(exe, "produce", key, 1, env=plain_env).returncode == 0
    proc = run(exe, "eexist", key, env=plain_env)
    assert proc.returncode == 0, proc.stderr
    proc = run(exe, "append", key, env=plain_env)
    assert proc.returncode == 0, proc.stderr
    assert key.read_text() == "line 0\n"
    assert shim.temps() == []


def test_timeout(shim: Shim, build: Builder, plain_env: dict) -> None:
    exe = build("streams.cpp")
    t0 = time.monotonic()
    proc = run(exe, "consume", shim.dir / "never", env=dict(plain_env, INSTRIDE_TIMEOUT="0.5"))
    assert proc.returncode == 3
    assert f"ERRNO {errno.ETIMEDOUT} ".encode() in proc.stderr
    assert 0.4 < time.monotonic() - t0 < 3


def test_non_managed_path_is_plain(shim: Shim, build: Builder, plain_env: dict) -> None:
    exe = build("streams.cpp")
    path = shim.outside / "plain.txt"
    proc = run(exe, "plain", path, env=plain_env)
    assert proc.returncode == 0, proc.stderr
    assert path.read_text() == "plain\n"
    assert sorted(os.listdir(shim.outside)) == ["plain.txt"]


def test_header_and_shim_together(shim: Shim, build: Builder) -> None:
    """With the shim also loaded, the header's temp names pass through it untouched."""
    exe = build("streams.cpp")
    key = shim.dir / "both" / "a.txt"
    proc = shim.run([exe, "produce", key, 5], check=True)
    assert proc.returncode == 0
    out = shim.run([exe, "consume", key], check=True)
    assert out.stdout.decode() == "".join(f"line {i}\n" for i in range(5))
    assert shim.temps() == []
