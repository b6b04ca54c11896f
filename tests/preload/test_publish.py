"""Publication by the C core (``csrc/core/publish.c``), as the preload library and the C API
(libinstride.so) do it: the writer's temporary file and its lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .conftest import Shim

#: A writer (the C API, instride_create) whose lock of its new temporary file meets a probe
#: of ``instride gc`` holding that file exclusively for a moment (the probe takes it when the
#: writer's flock is about to run: a seccomp user notification holds the call until then).
#: Prints whether the file is seen as being written, then what a gc (min_age 0.5) removes.
_LOCK_MEETS_A_PROBE = r'''
import ctypes, fcntl, glob, os, threading, time
from pathlib import Path
from seccomp_hold import hold_calls
import instride
from instride.store.gc import being_written, collect_garbage

lib = ctypes.CDLL(os.path.join(os.path.dirname(instride.__file__), "libinstride.so"))
root = os.environ["INSTRIDE_DIR"]
probed = []


def probe(name, n):
    temps = glob.glob(f"{root}/.k.instride-*.tmp")
    if temps and not probed:  # (gc's lock_held: open, LOCK_EX | LOCK_NB, close)
        fd = os.open(temps[0], os.O_RDONLY | os.O_NONBLOCK)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        probed.append(fd)
        threading.Timer(0.05, os.close, [fd]).start()


hold_calls({"flock": None}, probe)
w = ctypes.c_void_p()
assert lib.instride_create(f"{root}/k".encode(), 0, 0o644, ctypes.byref(w)) == 0
assert probed, "the probe never ran"
time.sleep(0.3)  # (the probe long gone)
tmp = Path(glob.glob(f"{root}/.k.instride-*.tmp")[0])
print(being_written(tmp))
time.sleep(0.7)  # (the writer pauses: older than min_age)
print(len(collect_garbage(Path(root), min_age=0.5)))
lib.instride_abort(w)
'''


def test_a_writers_lock_is_taken_even_when_a_gc_probe_holds_its_file(shim: Shim) -> None:
    """A writer locks its new temporary file (shared) so that ``instride gc`` -- in another
    PID namespace, or with ``--min-age`` -- leaves it alone for as long as it writes. gc tells
    a held file by taking an exclusive lock on it for a moment; a writer whose lock came in
    that moment got EWOULDBLOCK, ignored it, and wrote on unlocked: once it paused longer
    than the grace (an MD trajectory written over hours), a gc removed its file and its close
    failed, the data lost. The lock is tried again now while a probe holds it."""
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _LOCK_MEETS_A_PROBE], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 77, "seccomp user notifications are not available here"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["True", "0"], proc.stderr
