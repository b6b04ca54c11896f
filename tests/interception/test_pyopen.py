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
from instride.errors import ConsumeTimeout, UnsupportedModeError


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
