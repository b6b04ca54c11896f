"""Starting the archiver of a stream as a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..client import Client


class ArchiverProcess(subprocess.Popen):  # type: ignore[type-arg]
    """An archiver's process, and the write end of its lifeline: a pipe whose read end the
    archiver watches (``instride archive --lifeline FD``). Once no process holds the write end
    — the producer that started it died, however — the archiver takes the frames published
    by then and stops (exit status 0): it would otherwise wait for ever for frames and an end
    that never come."""

    lifeline: int | None = None

    def let_go(self) -> None:
        """Close this process's end of the lifeline (once the archiver has exited)."""
        fd, self.lifeline = self.lifeline, None
        if fd is not None:
            os.close(fd)


def start_archiver(stream: str, path: str | os.PathLike[str], client: Client, *,
                   lock: list[int | None] | None = None) -> ArchiverProcess:
    """Start ``instride archive STREAM --to PATH`` as a process with the client's settings,
    tied to this process by a lifeline (see :class:`ArchiverProcess`). ``lock``: ``[fd]``, the
    file's writer lock (:func:`~instride.archive.base.lock_writer`), taken by the caller and
    handed to the archiver (``--lock-fd``), which holds it from then on; the caller's
    descriptor of it is closed here once the archiver has it, and ``lock[0]`` set to ``None``
    (until then, also when the start fails, it is the caller's to let go of)."""
    fd = None if lock is None else lock[0]
    s = client.settings
    env = dict(os.environ, INSTRIDE_DIR=str(s.dir), INSTRIDE_NODE=s.node, INSTRIDE_ADDR=s.addr)
    for name, value in (("INSTRIDE_REDIS_URL", s.redis_url), ("INSTRIDE_TOKEN", s.token)):
        if value:
            env[name] = value
        else:  # (a local-mode client in an environment that names a Redis: local mode too)
            env.pop(name, None)
    # (both ends close on exec: the programs this process starts later do not hold it; a
    # child it forks without exec does, and the archiver then stops once that one is gone too)
    read_end, write_end = os.pipe()
    try:
        proc = ArchiverProcess(  # (SIGTERM stops it, even before its handler is in: not ignored
            # (no timeout of its own: INSTRIDE_TIMEOUT, inherited, ended it where frames came
            # slower than that; the lifeline tells it that its producer is gone)
            [sys.executable, "-m", "instride", "archive", stream, "--to", os.fspath(path),
             "--lifeline", str(read_end), "--timeout", "inf",
             *(["--lock-fd", str(fd)] if fd is not None else [])],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=_sigterm_default,  # as it may be where the producer was started)
            pass_fds=(read_end,) if fd is None else (read_end, fd),
            # (a session of its own: a terminal's Ctrl-C, sent to the producer's process group,
            # killed it too — a producer that catches it and ends its run cleanly then had an
            # archive short of the end)
            start_new_session=True,
        )
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    if lock is not None and fd is not None:
        lock[0] = None  # (the archiver's now: its copy holds the lock, one open description)
        os.close(fd)
    proc.lifeline = write_end
    return proc


def let_go(proc: Any) -> None:
    """:meth:`ArchiverProcess.let_go` of ``proc`` (nothing for another process)."""
    release = getattr(proc, "let_go", None)
    if release is not None:
        release()


def _sigterm_default() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
