"""C waits (csrc/core/wait.c) when the per-user inotify limits are reached.

Each thread that waits for a key under the preload library keeps one inotify instance, and the
C API makes one per wait; ``fs.inotify.max_user_instances`` (often 128, shared by all of the
user's processes on the node) and ``max_user_watches`` bound them. Once they were reached a
wait failed at once (``open`` of a key not yet published: ``EMFILE``, or ``ENOSPC`` for the
watch); it now polls the key, as the Python package's waits do, and ends as it would have.

The limits are lowered only for the program under test: it runs in a user namespace of its own
(``unshare --user --map-root-user``), whose ``/proc/sys/user/max_inotify_instances`` and
``max_inotify_watches`` bound its processes and nobody else's (the kernel counts a namespace's
instances against its own limit and its parents'), so nothing needs restoring afterwards.
See tests/preload/c/inotify_limit.c for the cases.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Builder, Shim

#: a shell that lowers the namespace's limits ($1 instances, $2 watches), then runs the rest
LOWER = ('echo "$1" > /proc/sys/user/max_inotify_instances && '
         'echo "$2" > /proc/sys/user/max_inotify_watches && shift 2 && exec "$@"')
UNLIMITED = "1000000"


def user_namespace() -> list[str]:
    """The command prefix that runs a program in a user namespace of its own (a loud failure
    where there is none: the suite's machine has them, and a skip would hide the feature)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.fail("unshare (util-linux) is needed to lower inotify limits for one program")
    argv = [unshare, "--user", "--map-root-user", "sh", "-c", LOWER, "sh"]
    probe = subprocess.run([*argv, "0", "0", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.fail(f"no user namespace with its own inotify limits here: {probe.stderr!r}")
    return argv


#: (case, instances, watches) -- see inotify_limit.c
CASES = [
    ("one", "0", UNLIMITED),  # no inotify instance at all: EMFILE
    ("one", UNLIMITED, "0"),  # an instance, but no watch: ENOSPC
    ("threads", "1", UNLIMITED),  # one thread of six gets the only instance
    ("timeout", "0", UNLIMITED),  # a polled wait still times out, and cleans up
    ("retry", "1", UNLIMITED),  # the instance, freed, is used by the thread's next wait
]


def run_case(shim: Shim, exe: Path, case: str, instances: str, watches: str, api: bool) -> None:
    src = shim.outside / "src.bin"
    src.write_bytes(b"data")
    env = dict(shim.env, INSTRIDE_TIMEOUT="1" if case == "timeout" else "20")
    if api:  # the C API works on its own: no preload library
        env.pop("LD_PRELOAD")
    argv = [*user_namespace(), instances, watches, str(exe), str(shim.dir), str(src), case]
    proc = subprocess.run(argv, env=env, capture_output=True, timeout=120)
    out = proc.stdout.decode()
    assert proc.returncode == 0 and out.strip() == "ok", (
        f"exit {proc.returncode}\nstdout: {out}\nstderr: {proc.stderr.decode()[-2000:]}")
    assert shim.temps() == []


@pytest.mark.parametrize(("case", "instances", "watches"), CASES)
def test_preload_wait_polls_without_inotify(shim: Shim, build: Builder, case: str,
                                            instances: str, watches: str) -> None:
    """Preloaded ``open`` of a key published 300 ms later, with the inotify limits reached:
    it failed with EMFILE (ENOSPC without a watch); it now waits and reads the file."""
    run_case(shim, build("inotify_limit.c"), case, instances, watches, api=False)


@pytest.mark.parametrize(("case", "instances", "watches"), CASES)
def test_api_wait_polls_without_inotify(shim: Shim, build: Builder, case: str,
                                        instances: str, watches: str) -> None:
    """The same with the C API's ``instride_open_read`` (its own inotify fd for each wait)."""
    exe = build("inotify_limit.c", "-DUSE_API", name="inotify_limit_api", api=True)
    run_case(shim, exe, case, instances, watches, api=True)
