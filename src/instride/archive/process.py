"""Starting the archiver of a stream as a process of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..client import Client


def start_archiver(stream: str, path: str | os.PathLike[str], client: Client) -> subprocess.Popen:
    """Start ``instride archive STREAM --to PATH`` as a process with the client's settings."""
    s = client.settings
    env = dict(os.environ, INSTRIDE_DIR=str(s.dir), INSTRIDE_NODE=s.node, INSTRIDE_ADDR=s.addr)
    for name, value in (("INSTRIDE_REDIS_URL", s.redis_url), ("INSTRIDE_TOKEN", s.token)):
        if value:
            env[name] = value
    return subprocess.Popen(  # (SIGTERM stops it, even before its handler is in: not ignored
        [sys.executable, "-m", "instride", "archive", stream, "--to", os.fspath(path)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        preexec_fn=_sigterm_default,  # as it may be where the producer was started)
    )


def _sigterm_default() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
