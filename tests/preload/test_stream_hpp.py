"""include/instride/stream.hpp: C++17 streams over the C API (libinstride.so), no shim loaded."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
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


def guard(build: Builder, scenario: str, arg: Path, env: dict) -> None:
    """Run one scenario of stream_guards.cpp; it checks itself and prints PASS."""
    proc = run(build("stream_guards.cpp"), scenario, arg, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == f"PASS {scenario}"


def test_ifstream_holds_a_stream_frame(shim: Shim, build: Builder, plain_env: dict) -> None:
    """An open ifstream holds a frame's shared flock (as instride_open_read does); close frees it."""
    guard(build, "hold", shim.dir / "s" / "frame_000000001.isf", plain_env)


#: A bounded stream (retain=1, drop-oldest) whose frame 0 a C++ reader (argv[1]) holds while
#: the producer appends 4 more frames; prints the reader's two lines.
RECYCLING_PRODUCER = """
import os, subprocess, sys
import numpy as np
from instride.stream import FRAME_FORMAT, Stream
s = Stream("s", mode="w", retain=1, on_full="drop-oldest")
s.append(np.full((1000, 3), 1.0, dtype=np.float32))
key = os.path.join(os.environ["INSTRIDE_DIR"], "s", FRAME_FORMAT.format(0))
reader = subprocess.Popen([sys.argv[1], "reader", key], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
print(reader.stdout.readline().strip(), flush=True)
for i in range(2, 6):
    s.append(np.full((1000, 3), float(i), dtype=np.float32))
reader.stdin.write("go\\n")
reader.stdin.flush()
print(reader.stdout.readline().strip(), flush=True)
reader.wait(timeout=30)
s.close()
"""


def test_ifstream_frame_is_not_recycled_under_its_reader(shim: Shim, build: Builder,
                                                        plain_env: dict) -> None:
    """A bounded stream's producer rewrites a retired frame's file only when no reader holds it:
    the bytes an ifstream reads never change under it."""
    exe = build("stream_guards.cpp")
    env = {k: v for k, v in plain_env.items() if k != "INSTRIDE_REDIS_URL"}
    proc = subprocess.run([sys.executable, "-c", RECYCLING_PRODUCER, str(exe)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ready, after = proc.stdout.split("\n")[:2]
    assert ready.startswith("READY 12128 "), proc.stdout
    assert after == ready.replace("READY", "AFTER") + " same", proc.stdout


def test_ofstream_unwinding_aborts(shim: Shim, build: Builder, plain_env: dict) -> None:
    """An exception unwinding through an ofstream aborts its key: nothing partial is published
    and the retry publishes; a stream opened during unwinding still publishes on scope exit."""
    guard(build, "unwind", shim.dir / "run" / "f.txt", plain_env)
    assert shim.temps() == []


def test_ofstream_forked_child_publishes_nothing(shim: Shim, build: Builder,
                                                plain_env: dict) -> None:
    """A forked child leaving an ofstream's scope neither publishes nor removes the parent's key;
    the parent publishes it, whole, on its own close."""
    guard(build, "fork", shim.dir / "f.txt", plain_env)
    assert shim.temps() == []


def test_second_open_fails_and_keeps_the_first(shim: Shim, build: Builder,
                                               plain_env: dict) -> None:
    """open() on an open stream fails (std semantics), touching neither key."""
    guard(build, "reopen", shim.dir, plain_env)
    assert shim.temps() == []


def test_relative_path_too_long_is_refused(shim: Shim, build: Builder, plain_env: dict) -> None:
    """A key by a relative path whose absolute form exceeds PATH_MAX: ENAMETOOLONG, never a plain
    in-place write."""
    guard(build, "longrel", shim.dir, plain_env)  # (it checks that no temp was left)
    shutil.rmtree(shim.dir / ("d" * 200))  # (fd-relative: no path over PATH_MAX)


def test_a_failing_open_with_exceptions_lets_the_key_go(shim: Shim, build: Builder,
                                                        plain_env: dict) -> None:
    """With ``exceptions(failbit)``, an ``open()`` whose std open failed after the key was
    taken (out of descriptors) threw before letting the key go: ``error()`` 0, the key's
    descriptor (or temp file) held, and every later ``open()`` refused with EBUSY. It lets
    the key go and says why, then the stream opens again."""
    guard(build, "throwing", shim.dir, plain_env)
