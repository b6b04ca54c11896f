"""Unmodified programs (cp, cat, dd, mv, ls, python) under the shim, local mode."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from pathlib import Path

from .conftest import Shim


def payload(n: int, seed: int = 1) -> bytes:
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


def test_cp_in_cat_out_identical(shim: Shim) -> None:
    src = shim.outside / "src.bin"
    src.write_bytes(payload(3 * 1024 * 1024 + 17))
    key = shim.dir / "run1" / "frame_000001.bin"
    shim.run(["cp", src, key], check=True)
    assert key.read_bytes() == src.read_bytes()
    out = shim.run(["cat", key], check=True)
    assert out.stdout == src.read_bytes()
    assert shim.temps() == []


def test_dd_in_and_out(shim: Shim) -> None:
    src = shim.outside / "src.bin"
    src.write_bytes(payload(1_000_000, seed=3))
    key = shim.dir / "dd" / "a.bin"
    shim.run(["dd", f"if={src}", f"of={key}", "bs=64k", "status=none"], check=True)
    back = shim.outside / "back.bin"
    shim.run(["dd", f"if={key}", f"of={back}", "bs=4k", "status=none"], check=True)
    assert back.read_bytes() == src.read_bytes()
    assert shim.temps() == []


def test_python_writer_and_reader_without_instride(shim: Shim) -> None:
    key = shim.dir / "py" / "data.bin"
    write = (
        f"import sys\n"
        f"with open({str(key)!r}, 'wb') as f:\n"
        f"    for i in range(64):\n"
        f"        f.write(bytes([i]) * 4096)\n"
        f"sys.exit('instride' in sys.modules)\n"
    )
    read = (
        f"import hashlib, sys\n"
        f"print(hashlib.sha256(open({str(key)!r}, 'rb').read()).hexdigest())\n"
        f"sys.exit('instride' in sys.modules)\n"
    )
    shim.py(write, check=True)
    out = shim.py(read, check=True)
    import hashlib

    expect = hashlib.sha256(b"".join(bytes([i]) * 4096 for i in range(64))).hexdigest()
    assert out.stdout.decode().strip() == expect


def test_consumer_started_before_producer_gets_everything(shim: Shim) -> None:
    key = shim.dir / "late" / "frame.bin"
    chunks = [payload(200_000, seed=s) for s in range(3)]
    consumer = shim.popen(["cat", key])
    time.sleep(0.5)
    assert consumer.poll() is None, "the consumer must wait for the key"
    produce = (
        "import time\n"
        "def payload(n, seed):\n"
        "    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))\n"
        f"f = open({str(key)!r}, 'wb')\n"
        "for s in range(3):\n"
        "    f.write(payload(200_000, s)); f.flush(); time.sleep(0.2)\n"
        "f.close()\n"
    )
    shim.py(produce, check=True)
    out, err = consumer.communicate(timeout=20)
    assert consumer.returncode == 0, err
    assert out == b"".join(chunks)


def test_timeout_is_etimedout_and_quick(shim: Shim) -> None:
    fast = shim.with_env(INSTRIDE_TIMEOUT="0.5")
    t0 = time.monotonic()
    proc = fast.run(["cat", shim.dir / "never" / "there.bin"])
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert os.strerror(errno.ETIMEDOUT).encode() in proc.stderr
    assert 0.4 < elapsed < 3.0
    code = (
        "import errno\n"
        "try:\n"
        f"    open({str(shim.dir / 'never' / 'py.bin')!r}, 'rb')\n"
        "except OSError as e:\n"
        "    raise SystemExit(0 if e.errno == errno.ETIMEDOUT else 1)\n"
        "raise SystemExit(2)\n"
    )
    assert fast.py(code).returncode == 0


def test_timeout_zero_does_not_wait_and_negative_is_refused(shim: Shim) -> None:
    """INSTRIDE_TIMEOUT=0 means what ``--timeout 0`` means: fail at once, never wait forever."""
    now = shim.with_env(INSTRIDE_TIMEOUT="0")
    code = (
        "import errno\n"
        "try:\n"
        f"    open({str(shim.dir / 'zero' / 'missing.bin')!r}, 'rb')\n"
        "except OSError as e:\n"
        "    raise SystemExit(0 if e.errno == errno.ETIMEDOUT else 1)\n"
        "raise SystemExit(2)\n"
    )
    proc = now.py(code, timeout=20)  # a wait forever would be killed here, and fail
    assert proc.returncode == 0, proc.stderr.decode()
    (shim.dir / "zero").mkdir(exist_ok=True)
    (shim.dir / "zero" / "here.bin").write_bytes(b"here")
    assert now.run(["cat", shim.dir / "zero" / "here.bin"], check=True).stdout == b"here"
    for bad in ("-1", "nan", "soon"):
        proc = shim.with_env(INSTRIDE_TIMEOUT=bad, INSTRIDE_DEBUG="1").run(
            ["cat", shim.dir / "zero" / "here.bin"], timeout=20)
        assert proc.returncode != 0 and proc.stdout == b""
        assert os.strerror(errno.EINVAL).encode() in proc.stderr
        assert b"INSTRIDE_TIMEOUT must be >= 0" in proc.stderr


def test_failed_wait_removes_the_directories_it_made(shim: Shim) -> None:
    """A read that waited in vain leaves nothing behind: the directories it made to watch
    are removed again (deepest first, while empty), those that were there stay."""
    (shim.dir / "p").mkdir()
    (shim.dir / "p" / "other.txt").write_text("stays")
    for timeout in ("0", "0.2"):
        proc = shim.with_env(INSTRIDE_TIMEOUT=timeout).run(
            ["cat", shim.dir / "p" / "q" / "r" / "k"], timeout=20)
        assert proc.returncode != 0 and b"timed out" in proc.stderr
        assert sorted(p.name for p in (shim.dir / "p").iterdir()) == ["other.txt"]
        proc = shim.with_env(INSTRIDE_TIMEOUT=timeout).run(["cat", shim.dir / "s" / "t" / "k"],
                                                          timeout=20)
        assert proc.returncode != 0
        assert sorted(p.name for p in shim.dir.iterdir()) == ["p"]


def test_write_once_second_cp_fails_eexist(shim: Shim) -> None:
    a = shim.outside / "a.txt"
    b = shim.outside / "b.txt"
    a.write_text("first\n")
    b.write_text("second\n")
    key = shim.dir / "once.txt"
    shim.run(["cp", a, key], check=True)
    proc = shim.run(["cp", b, key])
    assert proc.returncode != 0
    assert os.strerror(errno.EEXIST).encode() in proc.stderr
    assert key.read_text() == "first\n"
    assert shim.temps() == []


def test_overwrite_mode_replaces(shim: Shim) -> None:
    ow = shim.with_env(INSTRIDE_OVERWRITE="1")
    key = shim.dir / "ow.txt"
    for text in ("one\n", "two, longer\n", "3\n"):
        src = shim.outside / "src.txt"
        src.write_text(text)
        ow.run(["cp", src, key], check=True)
        assert key.read_text() == text
    assert shim.temps() == []


def test_append_is_eperm_and_update_erofs(shim: Shim) -> None:
    """Append: EPERM; a read-write update ("r+"): EROFS (what runtimes retry read-only on)."""
    key = shim.dir / "imm" / "a.txt"
    shim.py(f"open({str(key)!r}, 'w').write('published')", check=True)
    fresh = shim.dir / "imm" / "not-yet.txt"
    for path in (key, fresh):
        for mode, err in (("a", "EPERM"), ("ab", "EPERM"), ("a+", "EPERM"), ("r+", "EROFS"),
                          ("r+b", "EROFS")):
            code = (
                "import errno\n"
                "try:\n"
                f"    open({str(path)!r}, {mode!r})\n"
                "except OSError as e:\n"
                f"    raise SystemExit(0 if e.errno == errno.{err} else 1)\n"
                "raise SystemExit(2)\n"
            )
            assert shim.py(code).returncode == 0, (path, mode)
    # the shell's >> is an O_APPEND open too
    proc = shim.run(["sh", "-c", f"echo more >> {key}"])
    assert proc.returncode != 0
    assert key.read_text() == "published"
    assert not fresh.exists()


def test_killed_producer_leaves_nothing_under_the_key(shim: Shim) -> None:
    key = shim.dir / "dead" / "frame.bin"
    code = (
        "import sys, time\n"
        f"f = open({str(key)!r}, 'wb')\n"
        "f.write(b'x' * 100000); f.flush()\n"
        "print('written', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = shim.popen([sys.executable, "-I", "-c", code])
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"written"
    assert not key.exists()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert not key.exists()
    # the consumer does not see a partial file: it times out
    proc2 = shim.with_env(INSTRIDE_TIMEOUT="0.3").run(["cat", key])
    assert proc2.returncode != 0 and proc2.stdout == b""
    # what is left is a hidden temp that names the dead producer's pid
    assert [p.name.split(".instride-")[1].split("-")[0] for p in shim.temps()] == [str(proc.pid)]


def test_python_producer_starting_a_subprocess_still_publishes(shim: Shim) -> None:
    """Python's subprocess forks with vfork and closes every fd in the child (close_range):
    the parent's open key must still be published, with its bytes, by its own close."""
    key = shim.dir / "sub" / "k.bin"
    code = (
        "import subprocess, os\n"
        f"f = open({str(key)!r}, 'wb')\n"
        "f.write(b'before ')\n"
        "subprocess.run(['true'], check=True)\n"
        "subprocess.run(['true'], check=True, close_fds=False)\n"
        f"assert not os.path.exists({str(key)!r})\n"
        "f.write(b'after')\n"
        "f.close()\n"
        "print('closed')\n"
    )
    proc = shim.py(code, check=True)
    assert proc.stdout.decode().strip() == "closed"
    assert key.read_bytes() == b"before after"
    assert shim.temps() == []


def test_non_managed_paths_untouched(shim: Shim) -> None:
    plain = shim.outside / "plain.txt"
    code = (
        "import os\n"
        f"f = open({str(plain)!r}, 'w')\n"
        f"assert os.path.exists({str(plain)!r})\n"  # exists under its own name while open
        "f.write('one'); f.close()\n"
        f"open({str(plain)!r}, 'a').write(' two')\n"
        f"os.rename({str(plain)!r}, {str(plain) + '.2'!r})\n"
        f"os.rename({str(plain) + '.2'!r}, {str(plain)!r})\n"
    )
    shim.py(code, check=True)
    assert plain.read_text() == "one two"
    assert sorted(p.name for p in shim.outside.iterdir()) == ["plain.txt"]
    # missing non-managed files fail at once, they are not waited for
    t0 = time.monotonic()
    proc = shim.run(["cat", shim.outside / "missing"])
    assert proc.returncode != 0 and b"No such file" in proc.stderr
    assert time.monotonic() - t0 < 2


def test_mv_into_managed_dir_publishes(shim: Shim) -> None:
    src = shim.outside / "made-elsewhere.bin"
    src.write_bytes(payload(50_000))
    key = shim.dir / "moved" / "a.bin"
    consumer = shim.popen(["cat", key])
    time.sleep(0.3)
    assert consumer.poll() is None
    shim.run(["mv", src, key], check=True)
    out, _ = consumer.communicate(timeout=20)
    assert out == payload(50_000)
    assert not src.exists()


def test_rename_across_file_systems(shim: Shim, tmp_path: Path) -> None:
    """Managed dir on /dev/shm (tmpfs), source on tmp_path's file system: EXDEV path."""
    import shutil
    import uuid

    shm = Path("/dev/shm") / f"instride-test-{uuid.uuid4().hex}"
    shm.mkdir()
    try:
        xs = Shim(shm, shim.outside, dict(shim.env, INSTRIDE_DIR=str(shm)))
        src = shim.outside / "x.bin"
        src.write_bytes(payload(300_000))
        code = f"import os; os.rename({str(src)!r}, {str(shm / 'k' / 'x.bin')!r})"
        xs.py(code, check=True)
        assert (shm / "k" / "x.bin").read_bytes() == payload(300_000)
        assert not src.exists()
        assert xs.temps() == []
    finally:
        shutil.rmtree(shm)


def test_directory_listing_and_instride_internals_pass_through(shim: Shim) -> None:
    (shim.dir / "d").mkdir()
    (shim.dir / "d" / "k.txt").write_text("k")
    out = shim.run(["ls", shim.dir / "d"], check=True)
    assert out.stdout.split() == [b"k.txt"]
    # instride's own names are not keys: written in place, read without waiting
    internal = shim.dir / ".instride" / "state.txt"
    tmp = shim.dir / "d" / ".k2.txt.instride-1-abc.tmp"
    code = (
        "import os\n"
        f"os.makedirs({str(internal.parent)!r}, exist_ok=True)\n"
        f"f = open({str(internal)!r}, 'w'); f.write('s')\n"
        f"assert os.path.exists({str(internal)!r}); f.close()\n"
        f"open({str(tmp)!r}, 'w').write('t')\n"
        f"open({str(internal)!r}, 'a').write('2')\n"
    )
    shim.py(code, check=True)
    assert internal.read_text() == "s2"
    assert tmp.read_text() == "t"


def test_lexical_normalization(shim: Shim) -> None:
    """`..`, `.` and `//` spellings of a key are the key; a look-alike prefix is not."""
    weird = f"{shim.outside}/../{shim.dir.name}//sub/./x/../k.txt"
    key = shim.dir / "sub" / "k.txt"
    consumer = shim.popen(["cat", f"/{shim.dir}/sub/k.txt"])
    time.sleep(0.3)
    assert consumer.poll() is None
    shim.py(f"f = open({weird!r}, 'w'); f.write('normal'); f.close()", check=True)
    out, _ = consumer.communicate(timeout=20)
    assert out == b"normal"
    assert key.read_text() == "normal"
    # <managed>-other is not under <managed>: plain file, created at once, no wait
    sibling = shim.dir.parent / (shim.dir.name + "-other") / "k.txt"
    sibling.parent.mkdir()
    code = (
        "import os\n"
        f"f = open({str(sibling)!r}, 'w'); assert os.path.exists({str(sibling)!r}); f.close()\n"
        f"open({str(sibling)!r}, 'a').write('x')\n"
    )
    shim.py(code, check=True)
    assert sibling.read_text() == "x"


def test_a_reader_waiting_while_a_directory_above_is_renamed_gets_the_key(shim: Shim) -> None:
    """A reader waits for ``run/sub/k``; ``run`` is renamed away (a restart's clean-up) and a
    new ``run/sub`` made, where the key is then published. The wait's watch went with the old
    directory, which gets no events: the reader slept for good. It looks every second now
    whether the directory at the path is still the one it watches."""
    (shim.dir / "run" / "sub").mkdir(parents=True)
    reader = shim.with_env(INSTRIDE_TIMEOUT="20").popen(["cat", shim.dir / "run" / "sub" / "k"])
    try:
        time.sleep(0.5)  # (waiting)
        (shim.dir / "run").rename(shim.dir / "run_old")
        (shim.dir / "run" / "sub").mkdir(parents=True, exist_ok=True)  # (the wait's look too)
        shim.run(["sh", "-c", f"printf published > {shim.dir / 'run' / 'sub' / 'k'}"],
                 check=True)
        out, err = reader.communicate(timeout=10)
        assert (reader.returncode, out) == (0, b"published"), err
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.communicate()

