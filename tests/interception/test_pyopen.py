"""Python's open routed through instride: in-process (intercept()) and for unmodified scripts
(INSTRIDE_PATCH_OPEN=1, installed by the package's .pth hook)."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import instride
from instride.errors import ConsumeTimeout, KeyValidationError, UnsafePathError, UnsupportedModeError


def test_intercept_routes_managed_paths_only(managed_dir: Path, tmp_path: Path) -> None:
    original = builtins.open
    outside = tmp_path / "plain.txt"
    with instride.intercept():
        assert builtins.open is not original
        with open(managed_dir / "py" / "a.txt", "w") as fh:  # noqa: PTH123
            fh.write("managed")
            # not visible until closed
            assert not (managed_dir / "py" / "a.txt").exists()
        with open(outside, "w") as fh:  # noqa: PTH123
            fh.write("plain")
        assert open(managed_dir / "py" / "a.txt").read() == "managed"  # noqa: PTH123,SIM115
        with pytest.raises(ConsumeTimeout):
            instride.get_client().settings  # noqa: B018
            os.environ["INSTRIDE_TIMEOUT"] = "0.2"
            try:
                open(managed_dir / "py" / "missing.txt")  # noqa: PTH123,SIM115
            finally:
                del os.environ["INSTRIDE_TIMEOUT"]
        with pytest.raises(UnsupportedModeError):
            open(managed_dir / "py" / "a.txt", "a")  # noqa: PTH123,SIM115
        fd = os.open(outside, os.O_RDONLY)
        with open(fd, closefd=True) as fh:  # noqa: PTH123 - file descriptors pass straight through
            assert fh.read() == "plain"
    assert builtins.open is original
    assert outside.read_text() == "plain"


def test_relative_paths_resolve_against_cwd(managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(managed_dir)
    with instride.intercept():
        with open("rel.bin", "wb") as fh:  # noqa: PTH123
            fh.write(b"r")
    assert (managed_dir / "rel.bin").read_bytes() == b"r"


def test_unmodified_script_with_patch_open(managed_dir: Path) -> None:
    reader = textwrap.dedent(
        """
        import sys
        print(open(sys.argv[1]).read())
        print("instride" in sys.modules)
        """
    )
    writer = textwrap.dedent(
        """
        import sys, time
        f = open(sys.argv[1], "w")
        f.write("written by a script that never imports instride")
        time.sleep(0.3)
        f.close()
        """
    )
    env = dict(os.environ, INSTRIDE_PATCH_OPEN="1", INSTRIDE_TIMEOUT="30")
    target = str(managed_dir / "scripts" / "out.txt")
    r = subprocess.Popen([sys.executable, "-c", reader, target], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert r.poll() is None  # the reader waits for the publication
    subprocess.run([sys.executable, "-c", writer, target], env=env, check=True, timeout=60)
    out, err = r.communicate(timeout=60)
    assert r.returncode == 0, err
    assert out.splitlines() == ["written by a script that never imports instride", "True"]
    # without the variable, nothing is patched
    res = subprocess.run([sys.executable, "-c", "import sys; print('instride' in sys.modules)"],
                         env=dict(os.environ), capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"


def test_internal_files_pass_through(managed_dir: Path) -> None:
    internal = managed_dir / ".instride" / "cache" / "x.json"
    internal.parent.mkdir(parents=True)
    with instride.intercept():
        with open(internal, "w") as fh:  # noqa: PTH123
            fh.write("{}")
        assert open(internal).read() == "{}"  # noqa: PTH123,SIM115


def test_an_opener_on_a_managed_path_is_refused(managed_dir: Path, tmp_path: Path) -> None:
    """``open(key, "wb", opener=...)`` went to the original open: the file was visible before
    its close, and a second one truncated the published key. It is refused, naming it; an
    opener on any other path works as before."""
    with instride.intercept():
        with pytest.raises(UnsupportedModeError, match="opener"):
            open(managed_dir / "o.bin", "wb", opener=os.open)  # noqa: PTH123, SIM115
        with open(tmp_path / "plain", "w", opener=os.open) as fh:  # noqa: PTH123
            fh.write("plain")
    assert not (managed_dir / "o.bin").exists() and (tmp_path / "plain").read_text() == "plain"


def test_the_managed_directory_through_a_link_above_it(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """INSTRIDE_DIR names the directory through a symbolic link above it, and the script works
    in it (``getcwd()`` gives the physical path): its relative opens are managed too (the
    written file used to be visible before its close, unpublished)."""
    (tmp_path / "real" / "m").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("INSTRIDE_DIR", str(tmp_path / "link" / "m"))
    for var in ("INSTRIDE_REDIS_URL", "INSTRIDE_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path / "link" / "m")
    assert os.getcwd() == str(tmp_path / "real" / "m")
    with instride.intercept():
        with open("k.bin", "wb") as fh:  # noqa: PTH123
            fh.write(b"data")
            assert not (tmp_path / "real" / "m" / "k.bin").exists()  # (not before its close)
    assert (tmp_path / "real" / "m" / "k.bin").read_bytes() == b"data"


def test_bad_settings_fail_managed_opens_only(managed_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad INSTRIDE_* setting made every open of the process fail (the client was built for
    any path); now only the managed ones, which need it."""
    (tmp_path / "plain").write_text("plain")
    (managed_dir / "k.txt").write_text("key")
    monkeypatch.setenv("INSTRIDE_TIMEOUT", "-1")
    with instride.intercept():
        with open(tmp_path / "plain") as fh:  # noqa: PTH123
            assert fh.read() == "plain"
        with pytest.raises(instride.ConfigError, match="INSTRIDE_TIMEOUT"):
            open(managed_dir / "k.txt")  # noqa: PTH123, SIM115


def test_a_managed_name_that_is_no_key_is_refused(managed_dir: Path) -> None:
    """A name under the managed directory that is no valid key (a component over 200 bytes,
    a control character, bytes that are no UTF-8) went to the builtin open: the file was
    written in place, seen half-written by its readers (the preload library takes it for a
    key and waits for it), and never recorded. It is a KeyValidationError now, as from
    instride.open; instride's own names still pass through."""
    (managed_dir / "run").mkdir()
    with instride.intercept():
        for name in ("x" * 210 + ".dat", "bad\x01name.dat", "latin\udcff.dat"):
            with pytest.raises(KeyValidationError), open(managed_dir / "run" / name, "w"):
                pass
        assert os.listdir(managed_dir / "run") == []
        with open(managed_dir / ".instride-notes", "w") as fh:  # (instride's own: in place)
            fh.write("kept")
    assert (managed_dir / ".instride-notes").read_text() == "kept"


def test_a_path_the_kernel_resolves_elsewhere_publishes_nothing(managed_dir: Path,
                                                                tmp_path: Path) -> None:
    """Paths normalized as text published under a key the kernel would not reach: a trailing
    '/' (the builtin open refuses a directory's name) and '..' after a symbolic link (the
    kernel goes up from the link's target, outside the directory)."""
    (managed_dir / "s").mkdir()
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (managed_dir / "s" / "link").symlink_to(outside / "sub")
    with instride.intercept():
        # (IsADirectoryError or FileNotFoundError: the builtin's)
        with pytest.raises(OSError), open(f"{managed_dir}/s/x.dat/", "w"):
            pass
        with pytest.raises(UnsafePathError, match="symbolic link before"), \
                open(f"{managed_dir}/s/link/../k.dat", "w"):
            pass
        with open(f"{managed_dir}/s/../s/plain.dat", "w") as fh:  # ('..' after a directory)
            fh.write("ok")
    assert sorted(os.listdir(managed_dir / "s")) == ["link", "plain.dat"]
    assert os.listdir(outside) == ["sub"]


def test_a_managed_path_with_a_leading_double_slash_is_managed(
        managed_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``//dir/k`` (as ``"/" + path`` makes it) names the same file as ``/dir/k`` on Linux, and
    the preload library takes it for the key; the patched open took it for an unmanaged path:
    a writer wrote in place (seen half-written), a read of a missing key did not wait."""
    (managed_dir / "run").mkdir()
    with instride.intercept():
        with open("/" + str(managed_dir / "run" / "frame.dat"), "wb") as fh:  # noqa: PTH123
            fh.write(b"first half")
            fh.flush()
            assert not (managed_dir / "run" / "frame.dat").exists()
        assert (managed_dir / "run" / "frame.dat").read_bytes() == b"first half"
        monkeypatch.setenv("INSTRIDE_TIMEOUT", "0.2")
        with pytest.raises(ConsumeTimeout):
            open("/" + str(managed_dir / "run" / "missing.dat"), "rb")  # noqa: PTH123,SIM115
    assert os.listdir(managed_dir / "run") == ["frame.dat"]


def test_a_path_ending_in_dotdot_is_the_builtins(managed_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``dir/missing/..`` names no file (the builtin open fails it), but its text normalizes
    to ``dir``: the patched open wrote a file ``x`` for ``x/missing/..``. Such a path, and a
    bare ``.`` or ``..``, goes to the builtin open, as ``key/.`` already did (and as the
    preload library does)."""
    (managed_dir / "a" / "b").mkdir(parents=True)
    monkeypatch.chdir(managed_dir / "a" / "b")
    with instride.intercept():
        for path in (f"{managed_dir}/x/missing/..", f"{managed_dir}/a/missing/..", "..", "."):
            with pytest.raises(OSError) as info, open(path, "w"):  # noqa: PTH123
                pass
            assert type(info.value) in (FileNotFoundError, IsADirectoryError), info.value
    assert sorted(os.listdir(managed_dir)) == ["a"]
    assert os.listdir(managed_dir / "a") == ["b"]


def test_open_mode_spellings_of_the_builtin(managed_dir: Path) -> None:
    """The builtin open's other spellings of a mode ("bw", "br", "+wb") were refused with
    UnsupportedModeError on managed paths."""
    with instride.intercept():
        with open(managed_dir / "m.dat", "bw") as fh:
            fh.write(b"bytes")
        with open(managed_dir / "m.dat", "br") as fh:
            assert fh.read() == b"bytes"


def test_a_bad_patch_open_setting_fails_managed_opens(managed_dir: Path, tmp_path: Path) -> None:
    """``INSTRIDE_PATCH_OPEN=ture`` printed one traceback at start-up and ran the script
    unpatched: its writes of managed paths landed in place, seen half-written by readers.
    Every open of a managed path now raises that ConfigError; other paths are untouched."""
    script = textwrap.dedent(
        """
        import sys
        with open(sys.argv[2], "w") as fh:
            fh.write("unmanaged")
        with open(sys.argv[1], "w") as fh:
            fh.write("managed")
        """
    )
    target, other = managed_dir / "bad" / "out.txt", tmp_path / "other.txt"
    env = dict(os.environ, INSTRIDE_PATCH_OPEN="ture")
    res = subprocess.run([sys.executable, "-c", script, str(target), str(other)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "INSTRIDE_PATCH_OPEN" in res.stderr, res.stderr
    assert "ConfigError" in res.stderr.splitlines()[-1]
    assert other.read_text() == "unmanaged" and not target.exists()
