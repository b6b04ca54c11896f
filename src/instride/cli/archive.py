"""``instride archive STREAM --to FILE``: the durable tier of a stream."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from . import timeout_arg


def _stop(signum: int, frame: object) -> None:
    raise _Stopped


class _Stopped(KeyboardInterrupt):
    """SIGTERM: stop as Ctrl-C does (the archive file closed on the way out). Not an
    ``Exception``: a wait that retries on errors must not take it for one."""


def cmd_archive(args: argparse.Namespace) -> int:
    from ..archiver import archive_stream

    # SIGTERM (a producer that abandoned its stream, a batch system) stops it cleanly: the
    # frames flushed stay, a restart resumes after them
    signal.signal(signal.SIGTERM, _stop)
    try:
        report = archive_stream(args.stream, args.to, group=args.group, timeout=args.timeout,
                                progress=not args.quiet, lifeline=args.lifeline,
                                lock=args.lock_fd)
    except _Stopped:
        _say(f"archive of {args.stream}: stopped (SIGTERM); a restart resumes it")
        return 0
    _say(f"{report.frames} frames appended to {report.path} ({report.total} in the file, "
         f"{report.missed} dropped before archiving) in {report.seconds:.1f} s")
    if not report.ended:
        _say(f"archive of {args.stream}: stopped before the stream's end, its lifeline closed "
             "(the producer that started this archiver is gone); a restart resumes it")
    return 0


def _say(text: str) -> None:
    """A line on stderr, unless nobody reads it any more (a producer that started this
    archiver and died held the pipe: the archive is closed already, the status stays 0)."""
    with contextlib.suppress(BrokenPipeError):
        print(text, file=sys.stderr, flush=True)


def _lifeline(text: str) -> int:
    """``--lifeline``, ``--lock-fd``: an open file descriptor."""
    try:
        fd = int(text)
        os.fstat(fd)
    except (ValueError, OSError) as exc:
        raise argparse.ArgumentTypeError(f"not an open file descriptor: {text!r} ({exc})") from None
    return fd


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add ``archive`` to the ``instride`` parser."""
    p = sub.add_parser(
        "archive", help="write every frame of a stream to an H5MD file while the run goes on",
        description="Read STREAM as consumer group 'archive' and append each frame to FILE (H5MD), "
        "acknowledging a frame only once it is flushed; ends with the stream. Restarted after a "
        "crash, it resumes after the last frame in the file. Readers of the stream get frames "
        "retired from memory from this file. SIGTERM stops it cleanly (exit status 0).",
    )
    p.add_argument("stream", help="stream name, e.g. run7")
    p.add_argument("--to", required=True, metavar="FILE", help="archive file (.h5 or .h5md: H5MD)")
    p.add_argument("--group", default="archive", help="consumer group name (default: archive)")
    p.add_argument("--timeout", type=timeout_arg, default=None,
                   help="seconds to wait for each frame; 0: do not wait; inf: forever "
                   "(default: INSTRIDE_TIMEOUT, else forever)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--lock-fd", type=_lifeline, default=None, metavar="FD",
                   help="the archive file's writer lock, held already (an inherited "
                   "descriptor of its .FILE.lock, flock'ed: a producer's archive= passes it, "
                   "so that no other archiver takes the file before this one started)")
    p.add_argument("--lifeline", type=_lifeline, default=None, metavar="FD",
                   help="the read end of a pipe (an inherited descriptor): once no process "
                   "holds its write end, take the frames published by then and stop, exit "
                   "status 0 (a producer's archive= passes it: the archiver stops when the "
                   "producer dies, however)")
    p.set_defaults(func=cmd_archive)
