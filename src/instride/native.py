"""The ctypes binding of ``libinstride_local.so``: the sleeping part of local-mode waits, in C.

``isl_wait`` and ``isl_state`` (``csrc/local/wait.c``) sleep on a thread's inotify descriptor,
read its events and check the awaited files in one call (ctypes releases the GIL); see
:mod:`instride.store.wait`. The package build always makes the library; where it is missing or
cannot be loaded, :func:`library` returns ``None`` and the waits run the same loop in Python.
(A confined ``openat2`` + ``fstat`` in C was tried too and saved 0.6 µs of 9 per open over
ctypes' ``syscall``: not kept.)
"""

from __future__ import annotations

import ctypes
from pathlib import Path

__all__ = ["library"]

_lib: ctypes.CDLL | None = None
_loaded = False


def library() -> ctypes.CDLL | None:
    """``libinstride_local.so``, loaded once with its prototypes, or ``None`` where missing."""
    global _lib, _loaded
    if not _loaded:
        _loaded = True
        try:
            lib = ctypes.CDLL(str(Path(__file__).resolve().parent / "libinstride_local.so"))
        except OSError:
            return None
        c_int, c_char_p, p_int = ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
        lib.isl_state.argtypes = [c_char_p, c_char_p, c_int]
        lib.isl_state.restype = c_int
        lib.isl_wait.argtypes = [c_int, c_char_p, ctypes.POINTER(c_char_p), c_int, c_int, c_int,
                                 p_int, p_int, c_int]
        lib.isl_wait.restype = c_int
        _lib = lib
    return _lib
