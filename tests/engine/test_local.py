"""The local engine through the public API, with real processes: open / publish / consume /
consume_bytes / wait_any, settings from the environment, the managed directory's checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import instride
from instride.errors import ConsumeTimeout, KeyExistsError, UnsupportedModeError
from tests.conftest import finish

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


def test_timeout_from_environment(managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSTRIDE_TIMEOUT", "0.2")
    with pytest.raises(ConsumeTimeout):
        instride.consume("env/timeout")


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


def test_publish_names_a_source_that_is_no_regular_file(client: instride.Client,
                                                         tmp_path: Path) -> None:
    """A directory as the source was "no such file" (a bare ``FileNotFoundError``); it is a
    ``FileTypeError`` (``EISDIR``) now, a FIFO one with ``EINVAL``; a missing source stays a
    ``FileNotFoundError``, with its errno."""
    import errno

    from instride.errors import FileTypeError

    with pytest.raises(FileTypeError, match="is a directory; only a regular file") as info:
        client.publish(tmp_path, "src/d")
    assert info.value.errno == errno.EISDIR
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(FileTypeError, match="is a FIFO") as info:
        client.publish(tmp_path / "fifo", "src/f")
    assert info.value.errno == errno.EINVAL
    with pytest.raises(FileNotFoundError, match="no such file") as missing:
        client.publish(tmp_path / "none", "src/n")
    assert missing.value.errno == errno.ENOENT
    assert not (client.root / "src").exists()


def test_timeouts_given_as_text_are_parsed_or_refused(client: instride.Client) -> None:
    """``consume(key, timeout="abc")`` raised a bare ``TypeError`` (``"0"`` too), where a
    Stream's ``timeout=`` parses text: the same rules now (``ConfigError`` for what is not a
    number of seconds)."""
    from instride.errors import ConfigError, ConsumeTimeout

    for bad in ("abc", "-1", "nan", [1], 10**400):
        with pytest.raises(ConfigError, match="bad setting timeout="):
            client.consume("t/x", timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConsumeTimeout):
        client.consume("t/x", timeout="0")  # type: ignore[arg-type]


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
    # one its group may write (a shared project directory): refused too, as every user's
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o770)
    with pytest.raises(ConfigError, match="writable by its group"):
        instride.Client(Settings(dir=shared))


def test_the_engine_is_chosen_once_from_the_settings(client: instride.Client) -> None:
    from instride.engine import Engine
    from instride.engine.local import LocalEngine

    assert isinstance(client.engine, LocalEngine) and isinstance(client.engine, Engine)
    assert client.mode == "local" and client.cluster is None
    assert client.metadata is client.engine.metadata
    assert client.ready("ready/k") is None  # not published: nothing to read without waiting
    with client.open("ready/k", "wb") as fh:
        fh.write(b"here")
    assert client.ready("ready/k") == str(client.root / "ready" / "k")
    assert client.engine.wait_any(["ready/none", "ready/k"], 1) == "ready/k"
    client.close()  # releases connections; the client stays usable
    assert client.consume("ready/k", timeout=1).read_bytes() == b"here"


def test_publishing_the_keys_own_file_keeps_it(client: instride.Client, tmp_path: Path) -> None:
    """``publish(src, key, overwrite=True)`` with ``src`` the key's file itself (or another
    name of it): the rename of one name of a file onto another is no-op, so the hidden name
    stayed and the key's only visible name was removed — the file lost, the call successful."""
    with client.open("own/a.dat", "wb") as fh:
        fh.write(b"published")
    path = client.root / "own" / "a.dat"
    assert client.publish(path, "own/a.dat", overwrite=True) == "own/a.dat"
    alias = tmp_path / "alias.dat"
    os.link(path, alias)  # (another name of the key's file, outside the managed directory)
    assert client.publish(alias, "own/a.dat", overwrite=True) == "own/a.dat"
    assert client.consume("own/a.dat").read_bytes() == b"published"
    assert os.listdir(client.root / "own") == ["a.dat"]  # (no hidden name left)


def test_a_timeout_of_nan_is_a_config_error(client: instride.Client) -> None:
    """NaN passed every check of a timeout (no comparison is true): local waits raised an
    untyped ValueError, and a cluster wait for a node's fetch lock would never end."""
    with pytest.raises(instride.ConfigError, match="timeout"):
        client.consume("nan/key", timeout=float("nan"))


def test_a_negative_timeout_is_a_config_error_also_for_a_published_key(
        client: instride.Client) -> None:
    """``open(key, timeout=-1)`` was accepted when the key was already there (the timeout
    was checked only before a wait), and refused only when the open had to wait."""
    with client.open("neg/k.dat", "wb") as fh:
        fh.write(b"here")
    for call in (lambda: client.open("neg/k.dat", "rb", timeout=-1),
                 lambda: client.open("neg/missing.dat", "rb", timeout=-1),
                 lambda: client.consume("neg/k.dat", timeout=-1)):
        with pytest.raises(instride.ConfigError, match="timeout"):
            call()


def test_links_directories_and_special_files_are_no_keys(client: instride.Client,
                                                         tmp_path: Path) -> None:
    """``exists``, ``lookup`` and ``list`` followed symbolic links and counted directories:
    they reported keys that ``open`` refuses (UnsafePathError, FileTypeError), and the
    existence, size and time of files outside the managed directory. An absolute path as
    the prefix of ``list`` (accepted) listed nothing."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s" * 1234)
    with client.open("run7/frame.dat", "wb") as fh:
        fh.write(b"x")
    root = client.root
    (root / "s").symlink_to(outside)
    (root / "lnk").symlink_to(outside / "secret")
    (root / "run7" / "lnk").symlink_to(outside / "secret")
    (root / "run7" / "sub").symlink_to(outside)
    os.mkfifo(root / "run7" / "fifo")
    for key in ("run7", "s/secret", "lnk", "run7/lnk", "run7/fifo", "run7/sub/secret"):
        assert client.exists(key) is False, key
        assert client.lookup(key) is None, key
    assert client.exists("run7/frame.dat")
    record = client.lookup("run7/frame.dat")
    assert record is not None and record.size == 1
    assert client.list() == ["run7/frame.dat"]
    assert client.list("run7/") == ["run7/frame.dat"]
    assert client.list("s/") == [] and client.list("run7/sub/") == []
    assert client.list(f"{root}/run7/") == ["run7/frame.dat"]
    assert client.list(f"{root}/run7/fr") == ["run7/frame.dat"]
    assert sorted(os.listdir(outside)) == ["secret"]


def test_publish_fsyncs_the_directory_of_the_key(managed_dir: Path, tmp_path: Path) -> None:
    """With ``INSTRIDE_FSYNC=1``, ``publish(src, key)`` fsynced the staged file but not the
    directory its new name is in (a crash could lose the name), as writers do. A preloaded
    observer reports each fsync of a directory (the C library's fsync still does it)."""
    from tests.conftest import build_shim

    shim = build_shim(Path(__file__).parent / "c" / "fsync_dirs.c", tmp_path, "-ldl")
    src = tmp_path / "done.dat"
    src.write_bytes(b"finished")
    code = ("import sys, instride\n"
            "instride.Client().publish(sys.argv[1], 'pub/k.dat')\n")
    env = dict(os.environ, INSTRIDE_FSYNC="1", LD_PRELOAD=str(shim))
    proc = subprocess.run([sys.executable, "-c", code, str(src)], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert (managed_dir / "pub" / "k.dat").read_bytes() == b"finished"
    synced = [line.split(" ", 1)[1] for line in proc.stderr.splitlines()
              if line.startswith("fsync-dir ")]
    assert os.path.realpath(managed_dir / "pub") in synced, proc.stderr
