"""Atomic publication (instride.store.publish), through the public API with real processes:
write-once and overwrite, nothing partial ever visible, failed or aborted writers publish
nothing, immutable keys, garbage collection of dead writers' temporary files."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import instride
from instride.errors import ConsumeTimeout, KeyExistsError, UnsupportedModeError
from instride.interception.preload import c_library_path, preload_path
from instride.keys import TMP_PATTERN
from tests.conftest import build_shim, finish, spawn_py


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


@pytest.mark.parametrize("via", ["client", "builtin open"])
def test_an_unbuffered_writer_left_by_an_exception_publishes_nothing(
        client: instride.Client, via: str) -> None:
    """``buffering=0`` hands out the raw writer itself: an exception leaving its ``with`` block
    discards the file, as it does for a buffered or text writer (not publish half of it)."""
    path = client.root / "crash" / "raw.bin"
    with instride.intercept(), pytest.raises(RuntimeError):
        fh = client.open("crash/raw.bin", "wb", buffering=0) if via == "client" \
            else open(path, "wb", 0)  # noqa: SIM115 (the patched builtin)
        with fh:
            fh.write(b"half of the data")
            raise RuntimeError("producer crashed mid-write")
    assert fh.closed
    assert not path.exists()
    assert list((client.root / "crash").iterdir()) == []


FORKED_WRITER = """
import gc, os, sys
import instride
action, mode, buffering = sys.argv[1], sys.argv[2], int(sys.argv[3])
root = instride.Client().root
piece = (lambda s: s.encode()) if "b" in mode else str

def parent(f, pid):
    os.waitpid(pid, 0)
    names = sorted(os.listdir(root / "run"))
    print("after the child:", names)  # (the key is not there yet, its temporary file is)
    f.write(piece("+part 2"))

if action in ("finalize", "collect"):  # the child drops the writer, or exits holding it
    f = instride.open("run/out.dat", mode, buffering=buffering)
    f.write(piece("part 1"))
    pid = os.fork()
    if pid == 0:
        if action == "collect":
            del f
            gc.collect()
            os._exit(0)
        sys.exit(0)
    parent(f, pid)
    f.close()
else:
    with instride.open("run/out.dat", mode, buffering=buffering) as f:
        f.write(piece("part 1"))
        pid = os.fork()
        if pid == 0:
            if action == "raise":
                sys.exit(0)  # (SystemExit leaves the with block)
            if action == "close":
                f.close()
                os._exit(0)
        else:
            parent(f, pid)
    if pid == 0:  # ("leave": the child left the with block normally)
        os._exit(0)
print("published:", (root / "run" / "out.dat").read_bytes())
print("left:", sorted(os.listdir(root / "run")))
"""


@pytest.mark.parametrize("action", ["leave", "raise", "close", "collect", "finalize"])
@pytest.mark.parametrize(("mode", "buffering"), [("wb", -1), ("wb", 0), ("w", -1)])
def test_a_forked_child_leaves_the_parents_writer_alone(
        managed_dir: Path, action: str, mode: str, buffering: int) -> None:
    """A child forked while a writer is open holds a copy of it: however the child lets go of
    it (leaves the ``with`` block, raises out of it, closes it, drops it, exits), the copy
    neither publishes the parent's unfinished file nor removes it, nor writes the child's copy
    of the buffer into it; the parent publishes its whole file once, on its own close."""
    proc = subprocess.run([sys.executable, "-c", FORKED_WRITER, action, mode, str(buffering)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, (proc.stdout, proc.stderr)
    assert lines[0].startswith("after the child: ['.out.dat.instride-"), lines
    assert lines[1:] == ["published: b'part 1+part 2'", "left: ['out.dat']"], lines
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_a_writer_with_a_bad_encoding_fails_cleanly(managed_dir: Path) -> None:
    """A text writer refused for its ``encoding=`` or ``newline=`` raises the refusal, leaves
    no temporary file and prints nothing at garbage collection (no "Exception ignored", no
    warning of a writer never closed: the caller never had one)."""
    proc = spawn_py(textwrap.dedent(
        """
        import gc, instride, warnings
        warnings.simplefilter("always")
        for kw in ({"encoding": "no-such-codec"}, {"newline": "zz"}):
            try:
                instride.open("enc/k.txt", "w", **kw)
            except (LookupError, ValueError) as e:
                print(type(e).__name__)
            gc.collect()
        """
    ))
    rc, out, err = finish(proc)
    assert rc == 0, err
    assert out.split() == ["LookupError", "ValueError"]
    assert err == ""
    assert list((managed_dir / "enc").iterdir()) == []


@pytest.mark.parametrize(("mode", "buffering"),
                         [("wb", 0), ("wb", -1), ("w+b", -1), ("w", -1), ("w", 1)],
                         ids=["raw", "buffered", "read-write", "text", "line-buffered"])
def test_a_writer_dropped_without_close_warns_once_and_publishes_nothing(
        client: instride.Client, mode: str, buffering: int) -> None:
    """A writer garbage-collected without ``close()`` publishes nothing (its content may be
    incomplete) and says so with one ``ResourceWarning`` naming its key, whatever layers
    ``open`` put over the raw file (a buffered or text writer said nothing: a lost file
    without a trace)."""
    fh = client.open("drop/k.bin", mode, buffering=buffering)
    fh.write(b"half" if "b" in mode else "half")
    with pytest.warns(ResourceWarning) as caught:
        del fh
        gc.collect()
    ours = [str(w.message) for w in caught if "drop/k.bin" in str(w.message)]
    assert ours == ["instride file for key 'drop/k.bin' was never closed; not published"]
    assert list((client.root / "drop").iterdir()) == []


@pytest.mark.parametrize("fails", [False, True])
def test_the_hidden_name_goes_after_the_announcement(tmp_path: Path, fails: bool) -> None:
    """A write-once publication announces the key (``on_publish``) while the hidden name it
    was written under still exists, and removes that name after, also when the announcement
    fails: its system calls no longer delay the announcement, and nothing is left behind."""
    from instride.store.publish import open_for_write

    final = tmp_path / "run" / "k.bin"
    final.parent.mkdir()
    seen: list[list[str]] = []

    def announce(key: str, path: str) -> None:
        seen.append(sorted(p.name for p in final.parent.iterdir()))
        if fails:
            raise RuntimeError("metadata refused")

    fh = open_for_write(str(final), "run/k.bin", "wb", overwrite=False, fsync=False,
                        on_publish=announce)
    fh.write(b"frame")
    if fails:
        with pytest.raises(RuntimeError, match="metadata refused"):
            fh.close()
    else:
        fh.close()
    assert len(seen) == 1 and "k.bin" in seen[0]
    assert any(TMP_PATTERN.match(name) for name in seen[0])  # (still there when announced)
    assert [p.name for p in final.parent.iterdir()] == ["k.bin"]
    assert final.read_bytes() == b"frame"


@pytest.mark.parametrize("close_after", [False, True])
@pytest.mark.parametrize("fails", [False, True])
def test_the_files_descriptor_is_closed_before_or_after_the_announcement(
    tmp_path: Path, close_after: bool, fails: bool,
) -> None:
    """Where a close may report a failed write (NFS), the writer closes the file before it is
    announced (and holds a copy of its descriptor, with its lock, across the rename); where it
    cannot (``close_after``: tmpfs), the file's own descriptor is the one held, closed after
    the announcement. Either way, announced or refused, no descriptor is left open."""
    from instride.errors import KeyExistsError
    from instride.store.publish import open_for_write

    def fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    final = tmp_path / "k.bin"
    open_at_announce: list[bool] = []
    before = fds()
    fh = open_for_write(str(final), "k.bin", "wb", overwrite=False, fsync=False,
                        close_after=close_after,
                        on_publish=lambda _k, _p: open_at_announce.append(not fh.raw.closed))
    fh.write(b"frame")
    if fails:
        final.write_bytes(b"another writer's")  # (taken meanwhile: the link is refused)
        with pytest.raises(KeyExistsError):
            fh.close()
        assert open_at_announce == [] and final.read_bytes() == b"another writer's"
    else:
        fh.close()
        assert open_at_announce == [close_after] and final.read_bytes() == b"frame"
    assert fh.closed and fds() == before
    assert [p.name for p in tmp_path.iterdir()] == ["k.bin"]


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


@pytest.mark.parametrize("overwrite", [False, True])
def test_publish_recreates_a_directory_removed_under_it(tmp_path: Path, overwrite: bool) -> None:
    """A consumer's failed wait removes the empty directory it made to watch, maybe just as a
    producer publishes into it: the publication re-creates the directory instead of failing."""
    from instride.store.publish import publish_file

    tmp = tmp_path / "slot-1"
    tmp.write_bytes(b"frame")
    final = tmp_path / "run" / "frame_0.isf"  # "run/" was removed (or never made)
    publish_file(tmp, final, "run/frame_0.isf", overwrite=overwrite)
    assert final.read_bytes() == b"frame" and not tmp.exists()
    with pytest.raises(FileNotFoundError):  # a missing source is still an error
        publish_file(tmp, tmp_path / "run" / "frame_1.isf", "run/frame_1.isf",
                     overwrite=overwrite)


@pytest.mark.parametrize("links", [True, False])
def test_write_once_by_link_or_by_renameat2_where_links_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, links: bool) -> None:
    """Write-once publication: a hard link and the temporary name removed; on a file system
    without hard links (``link`` refused with EPERM, as vfat does), ``renameat2`` with
    ``RENAME_NOREPLACE`` from then on. Either way the file ends with one name, and a key that
    exists is refused atomically: the temporary file removed, the published one untouched."""
    import errno

    from instride.store import publish as pub

    monkeypatch.setattr(pub, "_LINKS", [True])
    monkeypatch.setattr(pub, "_RENAMEAT2", pub._RENAMEAT2)  # (restored, should it be dropped)
    if not links:
        def refused(*_args: object, **_kw: object) -> None:
            raise OSError(errno.EPERM, "Operation not permitted")

        monkeypatch.setattr(pub.os, "link", refused)
    final = tmp_path / "k.bin"
    for i in range(2):
        tmp = tmp_path / f".k.bin.{i}.tmp"
        tmp.write_bytes(b"first" if i == 0 else b"second")
        if i == 0:
            pub.publish_file(tmp, final, "k.bin", overwrite=False)
        else:
            with pytest.raises(KeyExistsError):
                pub.publish_file(tmp, final, "k.bin", overwrite=False)
        assert not tmp.exists()
        assert final.read_bytes() == b"first" and os.stat(final).st_nlink == 1
    assert pub._LINKS[0] is links  # (refused once: not tried again)


def test_write_once_where_neither_links_nor_renameat2_exist_is_a_typed_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system without hard links whose ``rename`` takes no ``RENAME_NOREPLACE`` (some
    FUSE file systems) cannot make a name without possibly replacing one: the publication
    is refused with an error that says so and how to go on (errno EOPNOTSUPP, as the C
    library's), the temporary file removed and nothing published; ``overwrite=True`` (a
    plain ``rename``) still works there."""
    import ctypes
    import errno

    from instride.store import publish as pub

    def refused(*_args: object, **_kw: object) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    def no_flags(*_args: object) -> int:  # (renameat2 as such a file system answers it)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(pub, "_LINKS", [True])
    monkeypatch.setattr(pub, "_RENAMEAT2", no_flags)
    monkeypatch.setattr(pub.os, "link", refused)
    final = tmp_path / "run" / "k.bin"
    final.parent.mkdir()
    for _ in range(2):  # the first refusals, then with both known to be refused
        tmp = tmp_path / "run" / ".k.bin.tmp"
        tmp.write_bytes(b"frame")
        with pytest.raises(UnsupportedModeError) as err:
            pub.publish_file(tmp, final, "run/k.bin", overwrite=False)
        message = str(err.value)
        assert "'run/k.bin'" in message and "hard links" in message
        assert "RENAME_NOREPLACE" in message and "overwrite=True" in message
        assert str(final.parent) in message
        assert err.value.errno == errno.EOPNOTSUPP
        assert not tmp.exists() and not final.exists()
        assert pub._LINKS[0] is False and pub._RENAMEAT2 is None
    tmp.write_bytes(b"frame")
    pub.publish_file(tmp, final, "run/k.bin", overwrite=True)
    assert final.read_bytes() == b"frame" and not tmp.exists()


def test_links_refused_once_do_not_stop_publication_where_links_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether links and ``renameat2`` work is remembered per process, not per file system:
    after a refusal on one file system (or with a C library without ``renameat2``), a
    write-once publication on a file system that makes links still publishes, by ``link``."""
    from instride.store import publish as pub

    monkeypatch.setattr(pub, "_LINKS", [False])
    monkeypatch.setattr(pub, "_RENAMEAT2", None)
    tmp, final = tmp_path / ".k.tmp", tmp_path / "k"
    tmp.write_bytes(b"frame")
    pub.publish_file(tmp, final, "k", overwrite=False)
    assert final.read_bytes() == b"frame" and not tmp.exists() and os.stat(final).st_nlink == 1
    tmp.write_bytes(b"other")
    with pytest.raises(KeyExistsError):  # and still write-once
        pub.publish_file(tmp, final, "k", overwrite=False)
    assert final.read_bytes() == b"frame" and not tmp.exists()


def test_a_link_reported_as_existing_that_names_the_file_itself_is_published(
        tmp_path: Path) -> None:
    """On NFS, a ``link`` the client retried after the server made it reports EEXIST: the key
    then already names the producer's own file, which is a publication, not a conflict (here
    the link is made beforehand). Another file under the key is still a conflict."""
    from instride.store.publish import publish_file

    tmp, final = tmp_path / ".k.tmp", tmp_path / "k"
    tmp.write_bytes(b"mine")
    os.link(tmp, final)
    publish_file(tmp, final, "k", overwrite=False)
    assert final.read_bytes() == b"mine" and not tmp.exists() and os.stat(final).st_nlink == 1
    tmp.write_bytes(b"other")
    with pytest.raises(KeyExistsError):
        publish_file(tmp, final, "k", overwrite=False)
    assert final.read_bytes() == b"mine" and not tmp.exists()


NO_LINKS_WRITER = textwrap.dedent(
    """
    import ctypes, os, sys
    kind, path, api, src = sys.argv[1:5]
    lib = ctypes.CDLL(api, use_errno=True)
    if kind in ("rename", "capi-move"):  # a finished file moved in under its key
        with open(src, "wb") as fh:  # (outside the managed directory: not published itself)
            fh.write(b"x" * 1000)
    if kind == "preload":  # an unmodified program's write and close (the preload library)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        assert os.write(fd, b"x" * 1000) == 1000
        try:
            os.close(fd)
        except OSError as exc:
            print(exc.errno)
        else:
            print(0)
    elif kind == "rename":  # ... and its rename into the managed directory
        try:
            os.rename(src, path)
        except OSError as exc:
            print(exc.errno)
        else:
            print(0)
    elif kind == "capi":  # the C API: a writer, then its commit
        w = ctypes.c_void_p()
        assert lib.instride_create(path.encode(), 0, 0o644, ctypes.byref(w)) == 0
        assert os.write(lib.instride_writer_fd(w), b"x" * 1000) == 1000
        print(0 if lib.instride_commit(w) == 0 else ctypes.get_errno())
    else:  # the C API's publication of a finished file
        print(0 if lib.instride_publish(src.encode(), path.encode(), 0) == 0 else ctypes.get_errno())
    """
)


@pytest.fixture(scope="module")
def no_links(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``c/no_links.c`` built: a file system with neither hard links nor RENAME_NOREPLACE."""
    return build_shim(Path(__file__).resolve().parent / "c" / "no_links.c",
                      tmp_path_factory.mktemp("nolinks"))


@pytest.mark.parametrize("kind", ["preload", "rename", "capi", "capi-move"])
def test_the_c_library_names_a_file_system_that_cannot_publish_write_once(
        managed_dir: Path, tmp_path: Path, no_links: Path, kind: str) -> None:
    """The C library on a file system with neither hard links nor ``RENAME_NOREPLACE``, both
    ways a file is published (written under its key, or a finished file moved in; through the
    preload library and through the C API): the write-once publication fails with EOPNOTSUPP
    and a message that says why and what to do (not link's bare EPERM nor renameat2's
    EINVAL), nothing is published, no temporary file is left and a moved-in file stays where
    it was; with ``INSTRIDE_OVERWRITE=1`` the file is published by ``rename``."""
    import errno

    (managed_dir / "k").mkdir()
    preload = [str(preload_path())] if kind in ("preload", "rename") else []
    env = dict(os.environ, INSTRIDE_DEBUG="1", LD_PRELOAD=":".join([*preload, str(no_links)]))
    path, src = managed_dir / "k" / "frame.bin", tmp_path / "finished.bin"
    args = [sys.executable, "-c", NO_LINKS_WRITER, kind, str(path), str(c_library_path()),
            str(src)]
    refused = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 0, refused.stderr
    assert int(refused.stdout) == errno.EOPNOTSUPP, (refused.stdout, refused.stderr)
    assert "cannot publish key k/frame.bin write-once" in refused.stderr
    assert "hard links" in refused.stderr and "INSTRIDE_OVERWRITE=1" in refused.stderr
    assert list((managed_dir / "k").iterdir()) == []  # nothing published, no temporary file
    moved = kind in ("rename", "capi-move")
    assert src.exists() is moved  # (a file to move in is not lost)
    env["INSTRIDE_OVERWRITE"] = "1"
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and int(done.stdout) == 0, (done.stdout, done.stderr)
    assert path.read_bytes() == b"x" * 1000 and not src.exists()
    assert [p.name for p in (managed_dir / "k").iterdir()] == ["frame.bin"]


def test_a_writers_lock_is_taken_though_a_collectors_look_holds_it_off(tmp_path: Path) -> None:
    """``instride gc`` looks at a temporary file with an exclusive lock held for a moment: a
    writer locking its file (shared) at that very moment was refused, silently, and its file
    stayed unlocked for good — a later collector in another PID namespace (where the writer's
    process id names nothing) removed a live writer's file. The writer tries again."""
    import fcntl
    import threading

    from instride.store import mark_writing
    from instride.store.gc import being_written

    path = tmp_path / "f.tmp"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDWR)
    look = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(look, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the collector's look, right then
        done = threading.Event()
        threading.Timer(0.05, lambda: (os.close(look), done.set())).start()
        mark_writing(fd)
        assert done.wait(10)  # (the look is over)
        assert being_written(path)  # the writer's lock is there: no collector removes it
    finally:
        os.close(fd)
