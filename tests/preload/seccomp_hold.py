"""Fault injection for the C tests' programs: system calls of the calling thread failed with a
chosen errno, or held in the kernel (a seccomp filter's user notification) until a supervisor
thread lets each go on -- a file system without ``RENAME_NOREPLACE``, a copy that takes
minutes, another process acting between two steps of the library, all without timing.

Imported by the scripts the tests run (its directory on ``sys.path``; also those of
``tests/test_paths.py`` and ``tests/store/test_ring.py``), not by pytest. Where
seccomp filters cannot be set the process exits 77 (the tests fail then, saying so). Linux
5.6+ (user notifications with ``SECCOMP_USER_NOTIF_FLAG_CONTINUE``), x86_64 or aarch64.
"""

from __future__ import annotations

import ctypes
import platform
import queue
import sys
import threading
from collections.abc import Callable

#: system call numbers: seccomp(2) itself, and those the tests fail or hold
NUMBERS = {
    "x86_64": {"seccomp": 317, "renameat2": 316, "linkat": 265, "flock": 73,
               "copy_file_range": 326, "openat2": 437},
    "aarch64": {"seccomp": 277, "renameat2": 276, "linkat": 37, "flock": 32,
                "copy_file_range": 285, "openat2": 437},
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


class _Notif(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("pid", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("nr", ctypes.c_int32), ("arch", ctypes.c_uint32), ("ip", ctypes.c_uint64),
                ("args", ctypes.c_uint64 * 6)]


class _Resp(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("val", ctypes.c_int64), ("error", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


def hold_calls(rules: dict[str, int | None], on_call: Callable[[str, int], object]) -> None:
    """From now on, in the calling thread (and the threads it starts later): each system call
    named in ``rules`` fails with the errno given there, or (None) waits until the supervisor
    thread has run ``on_call(name, n)`` (``n``: that name's count so far) -- then it goes on,
    unless ``on_call`` returned False (it never does: only a signal ends it). The supervisor is
    started first, so that what ``on_call`` does is not held."""
    numbers = NUMBERS.get(platform.machine())
    if numbers is None or _libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        sys.exit(77)
    names = {numbers[name]: name for name in rules}
    code = [_Filter(0x20, 0, 0, 0)]  # (load the call's number)
    for name, err in rules.items():  # (if equal: the next, a return; else past it)
        action = 0x7FC00000 if err is None else 0x00050000 | err  # USER_NOTIF; ERRNO
        code += [_Filter(0x15, 0, 1, numbers[name]), _Filter(0x06, 0, 0, action)]
    code.append(_Filter(0x06, 0, 0, 0x7FFF0000))  # ALLOW
    listeners: queue.Queue[int] = queue.Queue()

    def supervise() -> None:
        listener = listeners.get()
        counts: dict[str, int] = {}
        while True:
            notif = _Notif()
            if _libc.ioctl(listener, 0xC0502100, ctypes.byref(notif)) != 0:  # NOTIF_RECV
                continue
            name = names.get(notif.nr, "?")
            counts[name] = counts.get(name, 0) + 1
            if on_call(name, counts[name]) is not False:  # NOTIF_SEND, FLAG_CONTINUE
                _libc.ioctl(listener, 0xC0182101, ctypes.byref(_Resp(notif.id, 0, 0, 1)))

    threading.Thread(target=supervise, daemon=True).start()
    prog = _Prog(len(code), (_Filter * len(code))(*code))
    listener = _libc.syscall(numbers["seccomp"], 1, 8, ctypes.byref(prog))  # NEW_LISTENER
    if listener < 0:
        sys.exit(77)
    listeners.put(listener)
