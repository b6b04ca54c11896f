"""The ctypes binding of ``libinstride_tcp.so``, the C engine of the ``tcp`` transport.

Server half (``csrc/tcp/serve.c``): ``iss_start`` / ``iss_stop`` / ``iss_stats_get`` /
``iss_port`` / ``iss_replay_check``, with two callbacks into Python (:data:`DECIDE`,
:data:`LOG`). Client half (``csrc/tcp/recv.c``): ``isc_recv_file``, the receive loop of a fetch
(recv, xxh3, write), ``isc_recv_mem``, the same into memory, and ``isc_recv_reply``, a held
fetch's whole reply (header, then the body into memory). Calls through :mod:`ctypes` release the GIL.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

from ...errors import ConfigError
from ...native import RECEIVING
from ..base import open_engine

#: The calling convention of the library's exported functions this binding speaks (its
#: ``isc_abi()``, ``ISC_ABI`` in ``csrc/tcp/tcp.h``: bumped with any exported signature change).
ABI = 9
INSTALL_HINT = ("install OpenSSL's and xxhash's headers (Debian: apt-get install libssl-dev "
                "libxxhash-dev) and reinstall "
                "instride (pip install -e .) so that libinstride_tcp.so is built")

DECIDE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_char_p, ctypes.c_int,
    ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_int),
    ctypes.POINTER(ctypes.c_int64),
)
LOG = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)


class EngineStats(ctypes.Structure):
    """The server's counters (``iss_stats``)."""

    _fields_ = [(name, ctypes.c_uint64) for name in
                ("fetches", "bytes_sent", "errors", "busy", "stalled", "refused", "peers")]


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def library_path() -> Path:
    """Where ``libinstride_tcp.so`` is installed (next to the package's modules)."""
    return Path(__file__).resolve().parents[2] / "libinstride_tcp.so"


def load_library() -> ctypes.CDLL:
    """Load ``libinstride_tcp.so`` once.

    Raises
    ------
    ConfigError
        When it was not built (OpenSSL headers missing at install time) or cannot be loaded.
    """
    global _lib
    if _lib is not None:  # (loaded: no lock; every native receive asks for it)
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        lib = open_engine(library_path(), "tcp", "the tcp transport's C engine was not built",
                          INSTALL_HINT)
        abi = getattr(lib, "isc_abi", None)
        if abi is None or abi() != ABI:  # (a library left from an older build)
            raise ConfigError("INSTRIDE_TRANSPORT", "tcp",
                              f"{library_path()} is from another version of instride (calling "
                              f"convention {abi() if abi else 1}, not {ABI}): reinstall "
                              "instride (pip install -e .) so that it is built again")
        vp, cp, sz, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int
        lib.isc_min_rate.restype, lib.isc_min_rate.argtypes = i, []
        lib.iss_start.restype = i
        lib.iss_start.argtypes = [cp, i, cp, cp, sz, i, i, i, i, ctypes.c_double, DECIDE, LOG, vp,
                                  ctypes.POINTER(vp), cp, sz]
        lib.iss_port.restype = i
        lib.iss_port.argtypes = [vp]
        lib.iss_preempt_after.restype = None
        lib.iss_preempt_after.argtypes = [vp, i]
        lib.iss_stats_get.restype = None
        lib.iss_stats_get.argtypes = [vp, ctypes.POINTER(EngineStats)]
        lib.iss_replay_check.restype = i
        lib.iss_replay_check.argtypes = [vp, cp, sz, ctypes.c_double, ctypes.c_double]
        lib.iss_replay_held.restype = sz
        lib.iss_replay_held.argtypes = [vp]
        lib.iss_stop.restype = i
        lib.iss_stop.argtypes = [vp, i, ctypes.POINTER(EngineStats)]
        lib.isc_recv_file.restype = i
        u64 = ctypes.c_uint64
        lib.isc_recv_file.argtypes = [i, i, u64, u64, i, cp, ctypes.POINTER(u64), ctypes.POINTER(i),
                                      vp]
        lib.isc_recv_mem.restype = i
        lib.isc_recv_mem.argtypes = [i, vp, u64, u64, i, cp, ctypes.POINTER(u64)]
        lib.isc_recv_reply.restype = i
        lib.isc_recv_reply.argtypes = [i, i, i, cp, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32),
                                       vp, u64, u64, cp, ctypes.POINTER(u64), ctypes.POINTER(u64)]
        lib.isc_recv_frame.restype = i
        lib.isc_recv_frame.argtypes = [i, i, i, cp, cp, ctypes.c_uint32, ctypes.POINTER(ctypes.c_int32),
                                       vp, u64, cp, ctypes.POINTER(u64), ctypes.POINTER(u64),
                                       ctypes.POINTER(ctypes.c_double)]
        # receives counted where a helper making a file ahead can see them (it waits for them)
        count = getattr(lib, "isc_count_receives", None)  # (optional: an older build lacks it)
        if count is not None:
            count.restype, count.argtypes = None, [vp]
            count(ctypes.addressof(RECEIVING))
        _lib = lib
        return lib


__all__ = ["DECIDE", "LOG", "EngineStats", "library_path", "load_library"]
