"""Locate instride's C libraries and headers, and build environments that preload the shim.

``libinstride_preload.so`` makes unmodified programs (``cp``, ``dd``, a Fortran
MD engine, a Python script that never imports instride) take part in instride:
opening a key under the managed directory for reading waits for it, and
closing a key opened for writing publishes it. See ``docs/preload.md``.

The same directory holds ``libinstride.so``, the C API of ``instride/instride.h``
that ``instride/stream.hpp`` (C++) is built on. C and C++ programs get their
compiler flags from :func:`build_flags` or from the command line::

    cc prog.c $(instride preload-path --cflags --libs)

Examples
--------
>>> import subprocess
>>> from instride.interception.preload import preload_env
>>> subprocess.run(["cp", "frame.bin", "/dev/shm/instride-1000/run7/frame.bin"],
...                env=preload_env({"INSTRIDE_TIMEOUT": "30"}), check=True)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping

__all__ = [
    "C_LIBRARY_NAME", "LIBRARY_NAME", "build_flags", "c_library_path", "include_dir",
    "preload_env", "preload_path",
]

LIBRARY_NAME = "libinstride_preload.so"
C_LIBRARY_NAME = "libinstride.so"
_PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def preload_path() -> pathlib.Path:
    """Return the absolute path of the installed ``libinstride_preload.so``.

    Raises
    ------
    FileNotFoundError
        If the library was not built (the package was not installed with
        ``pip install``, or the C build failed).
    """
    path = _PACKAGE / LIBRARY_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the preload library is built when the package is "
            "installed; run `pip install -e .` (or `pip install .`) with a C compiler available"
        )
    return path


def preload_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Return a copy of ``os.environ`` (updated with *extra*) that preloads the shim.

    The library is put first in ``LD_PRELOAD`` (entries already there are kept
    after it; it is never listed twice).

    Parameters
    ----------
    extra : mapping, optional
        Variables to set on top of the current environment, e.g.
        ``{"INSTRIDE_DIR": ..., "INSTRIDE_TIMEOUT": "30"}``. An ``LD_PRELOAD``
        given here is kept after the shim.

    Returns
    -------
    dict
        An environment for :mod:`subprocess` or :func:`os.execve`.
    """
    env = dict(os.environ)
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    lib = str(preload_path())
    rest = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p and p != lib]
    env["LD_PRELOAD"] = ":".join([lib, *rest])
    return env


def c_library_path() -> pathlib.Path:
    """Return the absolute path of ``libinstride.so``, the C API library.

    Raises
    ------
    FileNotFoundError
        If the library was not built (see :func:`preload_path`).
    """
    path = _PACKAGE / C_LIBRARY_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: the C library is built when the package is installed; "
            "run `pip install -e .` (or `pip install .`) with a C compiler available"
        )
    return path


def include_dir() -> pathlib.Path:
    """Return the directory to put on the compiler's include path (``-I``).

    It holds ``instride/instride.h`` (C API) and ``instride/stream.hpp`` (C++ streams):
    inside the installed package for a regular install, the source tree's ``include/``
    for an editable one.

    Raises
    ------
    FileNotFoundError
        If neither holds ``instride/instride.h``.
    """
    for candidate in (_PACKAGE / "include", _PACKAGE.parent.parent / "include"):
        if (candidate / "instride" / "instride.h").is_file():
            return candidate
    raise FileNotFoundError(
        f"instride/instride.h is neither under {_PACKAGE / 'include'} nor in a source tree: "
        "reinstall the package"
    )


def build_flags(cflags: bool = True, libs: bool = True) -> list[str]:
    """Return the compiler and linker flags of a C or C++ program using instride.

    Parameters
    ----------
    cflags : bool
        Include ``-I<include dir>``.
    libs : bool
        Include ``-L<dir> -Wl,-rpath,<dir> -linstride`` (the rpath lets the program
        find ``libinstride.so`` at run time without ``LD_LIBRARY_PATH``).

    Returns
    -------
    list of str
        e.g. ``["-I/…/include", "-L/…/instride", "-Wl,-rpath,/…/instride", "-linstride"]``.
    """
    flags: list[str] = []
    if cflags:
        flags.append(f"-I{include_dir()}")
    if libs:
        libdir = c_library_path().parent
        flags += [f"-L{libdir}", f"-Wl,-rpath,{libdir}", "-linstride"]
    return flags
