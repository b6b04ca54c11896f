"""Nothing escapes the managed directory through the preload library, the C API or the C++
streams, and every refusal has its documented errno (docs/preload.md, "Errors").

Layout made by the fixture (without the shim), with ``E = <outside>/elsewhere``:
``$D/s/link -> E`` (E holds ``y``), ``$D/lk -> E/y``, ``$D/adir/`` and the FIFO ``$D/fifo``.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .conftest import HOLDING_READER, Builder, Shim

ELOOP_TEXT = os.strerror(errno.ELOOP).encode()


@pytest.fixture
def trap(shim: Shim) -> Path:
    """Make the symbolic links, the directory key and the FIFO; return E."""
    elsewhere = shim.outside / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "y").write_text("outside\n")
    (shim.dir / "s").mkdir()
    (shim.dir / "s" / "link").symlink_to(elsewhere)
    (shim.dir / "lk").symlink_to(elsewhere / "y")
    (shim.dir / "adir").mkdir()
    os.mkfifo(shim.dir / "fifo")
    return elsewhere


def untouched(elsewhere: Path) -> None:
    assert sorted(p.name for p in elsewhere.iterdir()) == ["y"]
    assert (elsewhere / "y").read_text() == "outside\n"


def test_cp_through_a_symlink_is_refused(shim: Shim, trap: Path) -> None:
    src = shim.outside / "x.bin"
    src.write_bytes(b"payload")
    for dest in ("s/link/y2", "s/link/new/y", "lk"):
        proc = shim.run(["cp", src, shim.dir / dest])
        assert proc.returncode != 0, dest
        assert ELOOP_TEXT in proc.stderr, proc.stderr
    untouched(trap)
    assert shim.temps() == []


def test_mv_through_a_symlink_is_refused(shim: Shim, trap: Path) -> None:
    src = shim.outside / "x.bin"
    src.write_bytes(b"payload")
    proc = shim.run(["mv", src, shim.dir / "s" / "link" / "moved"])
    assert proc.returncode != 0 and ELOOP_TEXT in proc.stderr, proc.stderr
    assert src.exists()
    # a directory is not published, but it may not leave through the link either
    tree = shim.outside / "tree"
    tree.mkdir()
    (tree / "f").write_text("f")
    proc = shim.run(["mv", "-T", tree, shim.dir / "s" / "link" / "tree"])
    assert proc.returncode != 0 and ELOOP_TEXT in proc.stderr, proc.stderr
    assert (tree / "f").exists()
    untouched(trap)
    shim.run(["mv", "-T", tree, shim.dir / "tree"], check=True)  # elsewhere it is allowed
    assert (shim.dir / "tree" / "f").read_text() == "f"


def test_cat_through_a_symlink_is_refused(shim: Shim, trap: Path) -> None:
    for key in ("s/link/y", "lk"):
        proc = shim.run(["cat", shim.dir / key])
        assert proc.returncode != 0 and proc.stdout == b"", key
        assert ELOOP_TEXT in proc.stderr
    # the same paths without the shim do reach the outside file: the refusal is instride's
    assert subprocess.run(["cat", shim.dir / "lk"], capture_output=True).stdout == b"outside\n"


def test_dotdot_through_a_symlink_is_refused(shim: Shim, trap: Path) -> None:
    """``$D/s/link/../k`` would land beside E (the kernel resolves the link, then ``..``)."""
    for mode in ("w", "r"):
        code = (
            "import errno\n"
            f"try:\n    open({str(shim.dir / 's' / 'link' / '..' / 'k')!r}, {mode!r})\n"
            "except OSError as e:\n    raise SystemExit(0 if e.errno == errno.ELOOP else 3)\n"
            "raise SystemExit(4)\n"
        )
        assert shim.py(code).returncode == 0, mode
    assert not (shim.outside / "k").exists() and not (shim.dir / "s" / "k").exists()
    # a plain ".." inside the managed directory stays allowed (resolved lexically)
    shim.run(["cp", "/etc/hostname", shim.dir / "adir" / ".." / "ok"], check=True)
    assert (shim.dir / "ok").read_bytes() == Path("/etc/hostname").read_bytes()


def test_directory_key_and_fifo(shim: Shim, trap: Path) -> None:
    code = (
        "import errno, os\n"
        f"try:\n    os.open({str(shim.dir / 'adir')!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
        "except OSError as e:\n    assert e.errno == errno.EISDIR, e\nelse:\n    raise SystemExit(3)\n"
        f"fd = os.open({str(shim.dir / 'adir')!r}, os.O_RDONLY)  # directories open as in libc\n"
        "os.close(fd)\n"
    )
    shim.py(code, check=True)
    proc = shim.run(["cat", shim.dir / "fifo"], timeout=20)  # would block forever without instride
    assert proc.returncode != 0 and os.strerror(errno.EINVAL).encode() in proc.stderr


def test_a_path_ending_in_dot_or_dotdot_fails_as_in_libc(shim: Shim) -> None:
    """``key/.`` and ``dir/missing/..`` name no file: libc fails them (ENOENT, ENOTDIR). The
    library normalized them as text and took them for a key: ``newkey/.`` opened for writing
    published a file ``newkey``, and a read of ``missing/.`` waited for a key."""
    (shim.dir / "run").mkdir()
    (shim.dir / "run" / "f.dat").write_bytes(b"published")
    d = str(shim.dir)
    code = (
        "import os\n"
        "w = os.O_WRONLY | os.O_CREAT | os.O_TRUNC\n"
        f"for p, flags in [({d!r} + '/newkey/.', w), ({d!r} + '/run/missing/..', w),\n"
        f"                 ({d!r} + '/run/f.dat/.', os.O_RDONLY),\n"
        f"                 ({d!r} + '/run/f.dat/..', os.O_RDONLY),\n"
        f"                 ({d!r} + '/run/missing/.', os.O_RDONLY)]:\n"
        "    try:\n"
        "        os.close(os.open(p, flags, 0o644))\n"
        "        print('opened', p)\n"
        "    except OSError as e:\n"
        "        print(os.strerror(e.errno), p)\n"
        f"print(sorted(os.listdir({d!r})), sorted(os.listdir({d!r} + '/run')))\n"
    )
    plain = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    expected = subprocess.run([sys.executable, "-I", "-c", code], env=plain,
                              capture_output=True, timeout=60, check=True)
    assert b"opened" not in expected.stdout, expected.stdout  # (libc fails every one)
    seen = shim.with_env(INSTRIDE_TIMEOUT="2").py(code, check=True, timeout=60)
    assert seen.stdout.decode() == expected.stdout.decode()
    assert shim.temps() == []


def test_consume_timeout_is_etimedout_with_a_message(shim: Shim) -> None:
    proc = shim.with_env(INSTRIDE_TIMEOUT="0.3", INSTRIDE_DEBUG="1").run(
        ["cat", shim.dir / "run" / "never.bin"])
    assert proc.returncode != 0
    err = proc.stderr.decode()
    assert os.strerror(errno.ETIMEDOUT) in err  # what cat prints for ETIMEDOUT
    assert "instride: key run/never.bin was not published within INSTRIDE_TIMEOUT=0.3 s" in err
    quiet = shim.with_env(INSTRIDE_TIMEOUT="0.3").run(["cat", shim.dir / "run" / "never.bin"])
    assert b"instride:" not in quiet.stderr  # the diagnostic only with INSTRIDE_DEBUG=1


def test_c_api_confinement(shim: Shim, trap: Path, build: Builder) -> None:
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(build("api.c", api=True)), "confine", str(shim.dir),
                           str(shim.outside)], env=env, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    untouched(trap)
    assert shim.temps() == []


@pytest.mark.parametrize(("how", "key", "err"), [
    ("w", "s/link/new.txt", errno.ELOOP), ("r", "s/link/y", errno.ELOOP),
    ("r", "lk", errno.ELOOP), ("w", "adir", errno.EISDIR), ("r", "fifo", errno.EINVAL),
])
def test_cpp_streams_confinement(shim: Shim, trap: Path, build: Builder, how: str, key: str,
                                 err: int) -> None:
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    proc = subprocess.run([str(build("streams.cpp")), "refuse", how, str(shim.dir / key),
                           str(err)], env=env, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.startswith(b"instride: key ")
    untouched(trap)
    assert shim.temps() == []


def test_without_openat2_the_walk_confines(shim: Shim, trap: Path, build: Builder) -> None:
    """On a kernel without openat2 (emulated with seccomp) the O_NOFOLLOW walk takes over."""
    wrap = build("no_openat2.c", api=False)
    probe = shim.run([wrap, sys.executable, "-I", "-c",
                      "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
                      "assert libc.syscall(437, -100, b'/', None, 0) == -1\n"
                      "assert ctypes.get_errno() == 38, ctypes.get_errno()"])
    assert probe.returncode == 0, probe.stderr  # openat2 really is gone: ENOSYS
    src = shim.outside / "x.bin"
    src.write_bytes(b"payload")
    for dest in ("s/link/y2", "s/link/new/y", "lk"):
        proc = shim.run([wrap, "cp", src, shim.dir / dest])
        assert proc.returncode != 0 and ELOOP_TEXT in proc.stderr, (dest, proc.stderr)
    for key, text in (("s/link/y", ELOOP_TEXT), ("lk", ELOOP_TEXT),
                      ("fifo", os.strerror(errno.EINVAL).encode())):
        proc = shim.run([wrap, "cat", shim.dir / key], timeout=20)
        assert proc.returncode != 0 and text in proc.stderr, (key, proc.stderr)
    untouched(trap)
    # ordinary keys still work: produce into a new directory, read back
    shim.run([wrap, "cp", src, shim.dir / "fresh" / "deep" / "k.bin"], check=True)
    out = shim.run([wrap, "cat", shim.dir / "fresh" / "deep" / "k.bin"], check=True)
    assert out.stdout == b"payload"
    assert shim.temps() == []


def test_managed_directory_below_a_symlink_not_created_yet(shim: Shim) -> None:
    """Links *above* the managed directory are the user's choice: keys still work there,
    even when the directory and its parents do not exist when the program starts."""
    real = shim.outside / "real"
    real.mkdir()
    (shim.outside / "ln").symlink_to(real)
    managed = shim.outside / "ln" / "a" / "b" / "c"
    env = shim.with_env(INSTRIDE_DIR=str(managed))
    env.run(["cp", "/etc/hostname", managed / "k" / "x"], check=True)
    assert (real / "a" / "b" / "c" / "k" / "x").read_bytes() == Path("/etc/hostname").read_bytes()
    out = env.run(["cat", managed / "k" / "x"], check=True)
    assert out.stdout == Path("/etc/hostname").read_bytes()


def test_symlink_made_above_the_managed_directory_after_start(shim: Shim, build: Builder) -> None:
    managed = shim.outside / "late" / "ln" / "d"
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    env["INSTRIDE_DIR"] = str(managed)
    proc = subprocess.run([str(build("api.c", api=True)), "late_link", str(managed),
                           str(shim.outside)], env=env, capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()




def test_a_bounded_streams_frame_opened_by_path_is_held(
    shim: Shim, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unmodified program that opens a bounded stream's frame by its path holds it as a
    stream's reader does: the frame retired meanwhile, its file is not rewritten for a later
    frame while the program has it open; closed, the file is reused. A frame file locked for
    rewriting is never opened."""
    import fcntl

    import numpy as np

    from instride import Client, Stream
    from instride.config import Settings

    monkeypatch.setenv("INSTRIDE_DIR", str(shim.dir))
    monkeypatch.delenv("INSTRIDE_REDIS_URL", raising=False)
    client = Client(Settings.from_env())
    pos = np.zeros((500, 3), np.float32)
    with Stream("held", mode="w", retain=2, on_full="drop-oldest", client=client) as s:
        s.append(pos, step=0)
        path = shim.dir / s.frame_key(0)
        ino = os.stat(path).st_ino
        reader = shim.popen([sys.executable, "-I", "-c", HOLDING_READER, path],
                            stdin=subprocess.PIPE)
        try:
            assert reader.stdout is not None and reader.stdin is not None
            assert reader.stdout.readline() == b"read\n"
            for i in range(1, 40):  # frame 0 retired: its file is not reused while open
                pos[:, 0] = i
                s.append(pos, step=i)
            assert not path.exists()
            assert ino not in {os.stat(shim.dir / s.frame_key(i)).st_ino for i in (38, 39)}
            reader.stdin.write(b"go\n")
            reader.stdin.flush()
            out, err = reader.communicate(timeout=30)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        assert reader.returncode == 0, err
        assert out.split() == [b"same"], out
        reused = set()
        for i in range(40, 60):  # closed: its storage comes back into use
            s.append(pos, step=i)
            reused.add(os.stat(shim.dir / s.frame_key(i)).st_ino)
        assert ino in reused
    (shim.dir / "held" / "frame_000000099.isf").write_bytes(b"being rewritten")
    rewriting = os.open(shim.dir / "held" / "frame_000000099.isf", os.O_RDONLY)
    try:
        fcntl.flock(rewriting, fcntl.LOCK_EX)
        proc = shim.py(f"open({str(shim.dir / 'held' / 'frame_000000099.isf')!r}, 'rb')")
    finally:
        os.close(rewriting)
    assert proc.returncode != 0 and b"FileNotFoundError" in proc.stderr, proc.stderr
    client.close()


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_managed_directory_others_may_write_is_refused(shim: Shim, mode: int) -> None:
    """The Python client refuses a managed directory its group or every user may write (they
    could plant or take keys: its default name is predictable); the preload library used it
    anyway, and a ``cat`` read the file another user had planted. Refused now with EINVAL (a
    refused setting), naming the directory."""
    planted = shim.dir / "planted"
    planted.write_text("not yours\n")
    os.chmod(shim.dir, mode)
    try:
        proc = shim.with_env(INSTRIDE_DEBUG="1").run(["cat", planted])
    finally:
        os.chmod(shim.dir, 0o700)
    assert proc.returncode != 0 and b"not yours" not in proc.stdout
    assert os.strerror(errno.EINVAL).encode() in proc.stderr, proc.stderr
    assert b"writable by" in proc.stderr and str(shim.dir).encode() in proc.stderr


def test_a_managed_directory_the_library_makes_is_private(shim: Shim) -> None:
    """The managed directory, made by the preload library (a first write), was 0777 less
    the umask — readable by every user (the Python client makes it 0700)."""
    root = shim.outside / "fresh"
    proc = shim.with_env(INSTRIDE_DIR=str(root)).run(["cp", "/etc/hostname", root / "a" / "k"])
    assert proc.returncode == 0, proc.stderr
    assert (root / "a" / "k").exists()
    assert root.stat().st_mode & 0o777 == 0o700


def test_a_key_path_too_long_to_confine_is_refused_not_written_in_place(shim: Shim) -> None:
    """A relative path from a deep working directory under the managed directory, whose
    absolute form is PATH_MAX or longer: the preload library cannot confine it, and **wrote
    it in place as a plain file** (visible under its name half-written, not write-once). It
    is refused with ENAMETOOLONG; a short key from there still works as a key."""
    code = textwrap.dedent(f"""
        import errno, os
        os.chdir({str(shim.dir)!r})
        name = "d" * 200
        for _ in range(21):
            os.mkdir(name)
            os.chdir(name)
        try:
            os.open("k.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            print("opened")
        except OSError as exc:
            print(errno.errorcode[exc.errno])
        print(os.path.exists("k.txt"))
        """)
    proc = shim.py(code)
    assert proc.stdout.split() == [b"ENAMETOOLONG", b"False"], (proc.stdout, proc.stderr)


def test_a_managed_directory_that_is_a_link_is_refused(shim: Shim) -> None:
    """The Python client refuses a managed directory that is itself a symbolic link; the
    preload library followed it (the two disagreed: ``instride run --dir LINK`` refused,
    plain ``LD_PRELOAD`` with the same directory worked). Refused with EINVAL, named."""
    (shim.dir / "k").write_text("in the real directory\\n")
    link = shim.outside / "link"
    link.symlink_to(shim.dir)
    proc = shim.with_env(INSTRIDE_DIR=str(link), INSTRIDE_DEBUG="1").run(["cat", link / "k"])
    assert proc.returncode != 0 and b"in the real" not in proc.stdout
    assert os.strerror(errno.EINVAL).encode() in proc.stderr and b"symbolic link" in proc.stderr
