"""instride.interception.preload: locating the library and building environments."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from instride.interception.preload import LIBRARY_NAME, preload_env, preload_path

WRAPPED = [
    "open", "open64", "openat", "openat64", "__open_2", "__open64_2", "__openat_2",
    "__openat64_2", "creat", "creat64", "fopen", "fopen64", "freopen", "freopen64", "close",
    "fclose", "dup", "dup2", "dup3", "fcntl", "fcntl64", "rename", "renameat", "renameat2",
    "close_range", "closefrom", "mmap", "mmap64", "munmap", "mkstemp", "mkstemp64", "mkostemp",
    "mkostemp64", "mkstemps", "mkstemps64", "mkostemps", "mkostemps64", "unlink", "unlinkat",
    "remove", "link", "linkat", "symlink", "symlinkat", "truncate", "truncate64",
]


def test_preload_path_is_the_built_library() -> None:
    path = preload_path()
    assert path.name == LIBRARY_NAME
    assert path.is_absolute() and path.is_file()
    assert path.parent == Path(__import__("instride").__file__).resolve().parent


def test_library_exports_exactly_the_wrappers() -> None:
    out = subprocess.run(["nm", "-D", "--defined-only", str(preload_path())],
                         capture_output=True, text=True, check=True).stdout
    exported = sorted(line.split()[-1] for line in out.splitlines()
                      if line.split()[-2:-1] in (["T"], ["W"]))
    assert exported == sorted(WRAPPED)  # -fvisibility=hidden: no internal symbol leaks


def test_preload_env_prepends_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = str(preload_path())
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    env = preload_env({"INSTRIDE_TIMEOUT": "3"})
    assert env["LD_PRELOAD"] == f"{lib}:/opt/other.so"
    assert env["INSTRIDE_TIMEOUT"] == "3"
    monkeypatch.setenv("LD_PRELOAD", f"/opt/a.so {lib}")
    assert preload_env()["LD_PRELOAD"] == f"{lib}:/opt/a.so"
    monkeypatch.delenv("LD_PRELOAD")
    assert preload_env()["LD_PRELOAD"] == lib


def test_preload_env_does_not_touch_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    preload_env({"INSTRIDE_DIR": "/x"})
    assert "LD_PRELOAD" not in os.environ
    assert os.environ.get("INSTRIDE_DIR") != "/x"
