"""Locate the LD_PRELOAD library and build environments that load it.

``libinstride_preload.so`` makes unmodified programs (``cp``, ``dd``, a Fortran
MD engine, a Python script that never imports instride) take part in instride:
opening a key under the managed directory for reading waits for it, and
closing a key opened for writing publishes it. See ``docs/preload.md``.

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

__all__ = ["LIBRARY_NAME", "preload_env", "preload_path"]

LIBRARY_NAME = "libinstride_preload.so"


def preload_path() -> pathlib.Path:
    """Return the absolute path of the installed ``libinstride_preload.so``.

    Raises
    ------
    FileNotFoundError
        If the library was not built (the package was not installed with
        ``pip install``, or the C build failed).
    """
    path = pathlib.Path(__file__).resolve().parent.parent / LIBRARY_NAME
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
