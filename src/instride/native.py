"""The ctypes binding of ``libinstride_local.so``: node-local hot paths in C.

Each is one call (ctypes releases the GIL):

* ``isl_wait`` and ``isl_state`` (``csrc/local/wait.c``) sleep on a thread's inotify
  descriptor, read its events and check the awaited files (:mod:`instride.store.wait`);
* ``isl_paper_encode`` and ``isl_paper_decode`` (``csrc/local/paper.c``) interleave or split
  the ``paper`` layout's 28-byte records and hash them with xxh3-64 in the same pass
  (:mod:`instride.frames`);
* ``isl_spare_*`` (``csrc/local/spare.c``) make the next frame file of a stream, or the next
  fetched copy, in a native ``SCHED_IDLE`` thread, which may first prefault the producer's
  mapping of the file made before (:mod:`instride.store.spare`);
* ``isl_append`` (``csrc/local/frame.c``) encodes a frame into its mapped file, drops the
  producer's lock and publishes it by a rename (``isl_append_fd``: the same into a new file,
  not mapped, with ``write``: a stream without retention); ``isl_lease``
  (``csrc/local/take.c``) opens a key confined (``openat2``), takes the reader's shared lock
  and checks that the key still names the file, and ``isl_take`` waits for a frame, holds
  it that way and checks it in the reader's kept mapping (:mod:`instride.store.ring`): a
  frame's step on each side is one call instead of the interpreter between system calls,
  which a paced producer or reader runs cold.

The package build always makes the library; where it is missing or cannot be loaded (or is a
stale build without a function called here), :func:`library` returns ``None`` and the callers
run the same logic in Python (files are then made when they are needed).

Tried and not kept: the array layouts copied and hashed in one C call like the paper codec
(``memcpy`` + xxh3 per 256 KiB chunk: 30-90 µs slower per cold JAC frame than numpy's chunked
copy and the Python xxhash package, in alternating runs; tried again with xxh3 at the CPU's
vector width: no faster); a copying reader's whole frame in one call (lease, ``pread`` of
the payload into its arrays while hashing, release: no faster than the lease, the kept
mapping and numpy's copy, ~250 µs per paced JAC frame either way).
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

__all__ = ["library"]

#: this process's receives under way ([0], counted by the TCP and UCX engines) and the end of
#: the last ([1], CLOCK_MONOTONIC ns); a helper making a file ahead (store/spare.py) waits while
#: one is under way and for 2 ms after the last (isl_spare_yield_to)
#: (in memory that is never freed: a helper thread may still read it while the interpreter
#: exits; zeroed in a forked child, which has none of its parent's receives)
_libc = ctypes.CDLL(None)
_libc.calloc.restype, _libc.calloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]
RECEIVING = (ctypes.c_int64 * 2).from_address(_libc.calloc(2, 8))


def _forget_receives() -> None:
    RECEIVING[0] = RECEIVING[1] = 0


os.register_at_fork(after_in_child=_forget_receives)

_lib: ctypes.CDLL | None = None
_loaded = False
_loading = threading.Lock()


def library() -> ctypes.CDLL | None:
    """``libinstride_local.so``, loaded once with its prototypes, or ``None`` where missing
    (or where it is a stale build without a function this package calls: reinstall)."""
    global _lib, _loaded
    if _loaded:
        return _lib
    with _loading:  # (a thread asking meanwhile waits for the prototypes, not a half library)
        if not _loaded:
            _lib = _load()
            _loaded = True
    return _lib


def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(Path(__file__).resolve().parent / "libinstride_local.so"))
    except OSError:
        return None
    c_int, c_char_p, p_int = ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
    ptr, i64, u64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64
    try:
        lib.isl_state.argtypes = [c_char_p, c_char_p, c_int]
        lib.isl_state.restype = c_int
        lib.isl_wait.argtypes = [c_int, c_char_p, ctypes.POINTER(c_char_p), c_int, c_int,
                                 ctypes.c_longlong, p_int, p_int, c_int]
        lib.isl_wait.restype = c_int
        lib.isl_paper_encode.argtypes = [ptr, ptr, ptr, i64]
        lib.isl_paper_encode.restype = u64
        lib.isl_paper_decode.argtypes = [ptr, i64, ptr, ptr, c_int]
        lib.isl_paper_decode.restype = u64
        lib.isl_spare_start.argtypes = [c_char_p, ctypes.c_longlong]
        lib.isl_spare_start.restype = ptr
        lib.isl_spare_start_populating.argtypes = [c_char_p, ctypes.c_longlong, ptr,
                                                   ctypes.c_longlong]
        lib.isl_spare_start_populating.restype = ptr
        lib.isl_spare_settle.argtypes = [ptr]
        lib.isl_spare_settle.restype = None
        lib.isl_spare_prefault_safe.argtypes = []
        lib.isl_spare_prefault_safe.restype = c_int
        lib.isl_spare_populated.argtypes = [ptr]
        lib.isl_spare_populated.restype = c_int
        lib.isl_spare_ready.argtypes = [ptr]
        lib.isl_spare_ready.restype = c_int
        lib.isl_spare_take.argtypes = [ptr, c_char_p]
        lib.isl_spare_take.restype = c_int
        lib.isl_spare_drop.argtypes = [ptr]
        lib.isl_spare_drop.restype = None
        yield_to = getattr(lib, "isl_spare_yield_to", None)  # (optional: an older build lacks it)
        if yield_to is not None:
            yield_to.argtypes, yield_to.restype = [ptr], None
            yield_to(ctypes.addressof(RECEIVING))
        lib.isl_append.argtypes = [ptr, c_int, i64, ptr, ptr, i64, ctypes.c_double, ptr, c_int,
                                   c_char_p, c_char_p, c_int, c_int]
        lib.isl_append.restype = c_int
        lib.isl_append_fd.argtypes = [ptr, c_int, i64, ptr, ptr, i64, ctypes.c_double, ptr, c_int,
                                      c_char_p, c_char_p, c_int, c_int]
        lib.isl_append_fd.restype = c_int
        lib.isl_lease.argtypes = [c_int, c_char_p, ptr]
        lib.isl_lease.restype = c_int
        lib.isl_take.argtypes = [c_int, c_int, ctypes.POINTER(c_char_p), c_int, ctypes.c_longlong,
                                 ctypes.c_longlong, ctypes.c_longlong, ptr, c_int, c_int, ptr,
                                 ptr, i64, ptr, p_int, c_int, p_int, ptr]
        lib.isl_take.restype = c_int
    except AttributeError:  # a library built from older sources: the Python paths instead
        return None
    return lib
