"""The public API in local mode, with real processes: open / publish / consume / consume_bytes."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import instride
from instride.errors import ConsumeTimeout, KeyExistsError, UnsupportedModeError
from instride.keys import TMP_PATTERN
from tests.conftest import finish, spawn_py

CONSUMER = textwrap.dedent(
    """
    import hashlib, sys, instride
    with instride.open(sys.argv[1], timeout=60) as fh:
        data = fh.read()
    print(len(data), hashlib.sha256(data).hexdigest())
    """
)
PRODUCER = textwrap.dedent(
    """
    import os, sys, hashlib, instride
    data = os.urandom(int(sys.argv[2]))
    with instride.open(sys.argv[1], "wb") as fh:
        fh.write(data)
    print(len(data), hashlib.sha256(data).hexdigest())
    """
)


def _run(code: str, *args: str) -> object:
    import subprocess

    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def test_write_read_roundtrip_text_and_binary(client: instride.Client) -> None:
    with client.open("t/hello.txt", "w") as fh:
        fh.write("héllo\n")
    with client.open("t/hello.txt", "r") as fh:
        assert fh.read() == "héllo\n"
    with client.open("t/blob.bin", "wb") as fh:
        fh.write(b"\x00\x01" * 1000)
    assert client.consume("t/blob.bin").read_bytes() == b"\x00\x01" * 1000


def test_consumer_started_before_producer(managed_dir: Path) -> None:
    consumer = _run(CONSUMER, "pairs/early.bin")
    time.sleep(0.5)
    assert consumer.poll() is None, "consumer must block until the key is published"
    producer = _run(PRODUCER, "pairs/early.bin", "3000000")
    _, pout, perr = finish(producer)
    rc, cout, cerr = finish(consumer)
    assert rc == 0, cerr
    assert cout == pout


def test_consumer_started_after_producer(managed_dir: Path) -> None:
    _, pout, _ = finish(_run(PRODUCER, "pairs/late.bin", "100000"))
    rc, cout, cerr = finish(_run(CONSUMER, "pairs/late.bin"))
    assert rc == 0, cerr
    assert cout == pout


def test_eight_concurrent_pairs(managed_dir: Path) -> None:
    consumers = [_run(CONSUMER, f"pairs/p{i}.bin") for i in range(8)]
    producers = [_run(PRODUCER, f"pairs/p{i}.bin", str(100_000 * (i + 1))) for i in range(8)]
    outs = [finish(p)[1] for p in producers]
    for i, c in enumerate(consumers):
        rc, out, err = finish(c)
        assert rc == 0, err
        assert out == outs[i]


def test_no_wakeup_is_lost_under_racing_publications(client: instride.Client) -> None:
    # Consumers start waiting at the same moment their key is published, many times over:
    # a publication between the existence check and arming the watch must never be missed.
    errors: list[BaseException] = []

    def consume(key: str) -> None:
        try:
            client.consume(key, timeout=10)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    for i in range(200):
        key = f"race/k{i}"
        t = threading.Thread(target=consume, args=(key,))
        t.start()
        with client.open(key, "wb") as fh:
            fh.write(b"x")
        t.join(15)
        assert not t.is_alive()
    assert errors == []


def test_reader_never_sees_a_partial_file(managed_dir: Path) -> None:
    hammer = spawn_py(textwrap.dedent(
        """
        import os, sys, time
        root = os.environ["INSTRIDE_DIR"]
        seen = partial = 0
        deadline = time.time() + 60
        while time.time() < deadline:
            for i in range(20):
                p = os.path.join(root, "big", f"f{i}.bin")
                try:
                    with open(p, "rb") as fh:
                        data = fh.read()
                except FileNotFoundError:
                    continue
                seen += 1
                if len(data) != 8_000_000 or data[-1:] != b"E":
                    partial += 1
            if os.path.exists(os.path.join(root, "big", "done")):
                break
        print(seen, partial)
        """
    ))
    for i in range(20):
        with instride.open(f"big/f{i}.bin", "wb") as fh:
            for _ in range(7):
                fh.write(os.urandom(1_000_000))
            fh.write(b"\0" * 999_999 + b"E")
    with instride.open("big/done", "wb"):
        pass
    rc, out, err = finish(hammer, 90)
    assert rc == 0, err
    seen, partial = map(int, out.split())
    assert seen > 0
    assert partial == 0


def test_timeout_names_key_and_seconds(client: instride.Client) -> None:
    start = time.monotonic()
    with pytest.raises(ConsumeTimeout) as info:
        client.consume("never/there", timeout=0.3)
    assert time.monotonic() - start < 5
    assert isinstance(info.value, TimeoutError)
    assert info.value.key == "never/there"
    assert info.value.waited >= 0.3
    assert "never/there" in str(info.value) and "0.3" in str(info.value)


def test_timeout_from_environment(managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSTRIDE_TIMEOUT", "0.2")
    with pytest.raises(ConsumeTimeout):
        instride.consume("env/timeout")


def test_waiting_does_not_busy_wait(managed_dir: Path) -> None:
    proc = spawn_py(textwrap.dedent(
        """
        import resource, instride
        try:
            instride.consume("idle/key", timeout=2.0)
        except instride.ConsumeTimeout:
            pass
        ru = resource.getrusage(resource.RUSAGE_SELF)
        print(ru.ru_utime + ru.ru_stime)
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    # Interpreter start-up and imports cost CPU; two seconds of polling would cost ~2 s.
    assert float(out) < 1.0


def test_write_once_and_overwrite(client: instride.Client) -> None:
    with client.open("w/once", "wb") as fh:
        fh.write(b"v1")
    with pytest.raises(KeyExistsError):
        client.open("w/once", "wb")
    with client.open("w/once", "wb", overwrite=True) as fh:
        fh.write(b"v2")
    assert client.consume("w/once").read_bytes() == b"v2"
    with pytest.raises(KeyExistsError):
        client.open("w/once", "xb", overwrite=True)


def test_exception_in_with_block_publishes_nothing(client: instride.Client) -> None:
    with pytest.raises(RuntimeError):
        with client.open("crash/frame", "wb") as fh:
            fh.write(b"half a frame")
            raise RuntimeError("simulation crashed")
    assert not (client.root / "crash" / "frame").exists()
    assert not any(TMP_PATTERN.match(p.name) for p in (client.root / "crash").iterdir())


def test_read_write_mode_then_publish(client: instride.Client) -> None:
    with client.open("rw/file", "w+b") as fh:
        fh.write(b"abcdef")
        fh.seek(0)
        assert fh.read() == b"abcdef"
    assert client.consume("rw/file").read_bytes() == b"abcdef"


@pytest.mark.parametrize("mode", ["a", "ab", "r+", "r+b", "q"])
def test_append_and_update_refused(client: instride.Client, mode: str) -> None:
    with pytest.raises(UnsupportedModeError):
        client.open("modes/x", mode)
    assert not (client.root / "modes").exists()


def test_sigkilled_producer_leaves_nothing_and_gc_cleans(managed_dir: Path) -> None:
    proc = spawn_py(textwrap.dedent(
        """
        import sys, instride
        fh = instride.open("killed/frame.bin", "wb")
        fh.write(b"x" * 1_000_000)
        fh.flush()
        print("writing", flush=True)
        import time; time.sleep(60)
        """
    ))
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()
    d = managed_dir / "killed"
    assert not (d / "frame.bin").exists()
    leftovers = [p for p in d.iterdir() if TMP_PATTERN.match(p.name)]
    assert len(leftovers) == 1
    with pytest.raises(ConsumeTimeout):
        instride.consume("killed/frame.bin", timeout=0.2)
    import subprocess

    out = subprocess.run([sys.executable, "-m", "instride", "gc"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert str(leftovers[0]) in out.stdout
    assert list(d.iterdir()) == []


def test_publish_file_written_by_other_means(client: instride.Client, tmp_path: Path) -> None:
    src = tmp_path / "outside.dat"
    src.write_bytes(b"legacy output")
    key = client.publish(src, "legacy/out.dat")
    assert key == "legacy/out.dat"
    assert not src.exists()
    assert client.consume(key).read_bytes() == b"legacy output"
    other = tmp_path / "again.dat"
    other.write_bytes(b"no")
    with pytest.raises(KeyExistsError):
        client.publish(other, "legacy/out.dat")
    assert other.exists()  # a refused publication keeps its source
    inplace = client.root / "legacy" / "inplace.dat"
    inplace.write_bytes(b"in place")
    assert client.publish(inplace) == "legacy/inplace.dat"
    with pytest.raises(FileNotFoundError):
        client.publish(tmp_path / "missing")


def test_consume_bytes_is_a_zero_copy_view(client: instride.Client) -> None:
    import mmap

    with client.open("cb/data", "wb") as fh:
        fh.write(b"0123456789")
    view = client.consume_bytes("cb/data")
    assert bytes(view) == b"0123456789"
    assert isinstance(view.obj, mmap.mmap)
    assert view.readonly
    with client.open("cb/empty", "wb"):
        pass
    assert bytes(client.consume_bytes("cb/empty")) == b""


def test_module_functions_follow_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("a", "b"):
        monkeypatch.setenv("INSTRIDE_DIR", str(tmp_path / name))
        with instride.open("k", "wb") as fh:
            fh.write(name.encode())
    assert (tmp_path / "a" / "k").read_bytes() == b"a"
    assert (tmp_path / "b" / "k").read_bytes() == b"b"


def test_failed_write_publishes_nothing(managed_dir: Path) -> None:
    # A write that fails at close (the file-size limit stands in for a full disk): the key
    # must not appear, truncated or otherwise, and no temporary file may remain.
    proc = spawn_py(textwrap.dedent(
        """
        import resource, signal, instride
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        f = instride.open("full/frame.bin", "wb")
        f.write(b"x" * 3000)          # buffered: nothing reaches the file yet
        f.write(b"y" * 3000)
        try:
            f.close()                 # the flush fails with EFBIG
            print("closed")
        except OSError as e:
            print("error", e.errno)
        g = instride.open("full/direct.bin", "wb")
        try:
            g.write(b"z" * 100000)    # larger than the buffer: goes straight to the file
        except OSError as e:
            print("write error", e.errno)
        try:
            g.close()
        except OSError as e:
            print("close error", e.errno)
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("error")
    assert lines[1].startswith("write error") and lines[2].startswith("close error")
    assert list((managed_dir / "full").iterdir()) == []


def test_publication_between_check_and_watch_is_not_missed(
    client: instride.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Deterministic version of the race: the file is published exactly after the first
    # existence check and before the inotify watch is armed. Only the re-check after arming
    # can see it (no event will ever come).
    from instride.store import wait as local

    original = local._watcher.watch
    published = []

    def publish_then_arm(directory: Path) -> None:
        if not published:
            with client.open("race/exact", "wb") as fh:
                fh.write(b"1")
            published.append(True)
        original(directory)

    monkeypatch.setattr(local._watcher, "watch", publish_then_arm)
    start = time.monotonic()
    assert client.consume("race/exact", timeout=5) == client.root / "race" / "exact"
    assert time.monotonic() - start < 2  # found by the re-check, not by the timeout
    assert published


def test_wait_does_not_burn_cpu(managed_dir: Path) -> None:
    proc = spawn_py(textwrap.dedent(
        """
        import resource, instride
        instride.get_client()
        before = resource.getrusage(resource.RUSAGE_SELF)
        try:
            instride.consume("idle/cpu", timeout=1.5)
        except instride.ConsumeTimeout:
            pass
        after = resource.getrusage(resource.RUSAGE_SELF)
        print(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert float(out) < 0.1  # a polling loop would use a large part of the 1.5 s


def test_wait_any_validates_keys(client: instride.Client, tmp_path: Path) -> None:
    from instride.errors import KeyValidationError

    with pytest.raises(KeyValidationError):
        client.wait_any(["ok/key", "../../escape/x"], timeout=0.1)
    assert not (client.root.parent.parent / "escape").exists()


def test_publish_refuses_symlinks(client: instride.Client, tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"t")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(UnsupportedModeError, match="symbolic link"):
        client.publish(link, "sym/k")
    assert not (client.root / "sym" / "k").exists()


def test_managed_dir_must_be_private(tmp_path: Path) -> None:
    from instride.config import Settings
    from instride.errors import ConfigError

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    with pytest.raises(ConfigError, match="owned by uid 4242"):
        instride.Client(Settings(dir=theirs))
    target = tmp_path / "real"
    target.mkdir()
    (tmp_path / "sym").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        instride.Client(Settings(dir=tmp_path / "sym"))
    fresh = tmp_path / "fresh" / "dir"
    instride.Client(Settings(dir=fresh))
    assert fresh.stat().st_mode & 0o777 == 0o700
