"""Progress bars: tqdm on a terminal, a few plain lines when stderr is redirected."""

from __future__ import annotations

import io
import os

from instride.progress import PlainProgress, progress


def test_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    bar = progress(total=100, desc="frames", unit="frame", file=out, position=1, leave=True,
                   mininterval=0.5, min_seconds=0.0)
    assert isinstance(bar, PlainProgress)
    with bar:
        for _ in range(100):
            bar.update(1)
    text = out.getvalue()
    lines = text.splitlines()
    assert len(lines) == 10  # one per tenth, the last at 100/100; close adds nothing new
    assert lines[0].startswith("frames: 10/100 frame (") and lines[-1].startswith("frames: 100/100 frame")
    assert "\r" not in text and "\x1b" not in text


def test_plain_iteration_postfix_and_final_line() -> None:
    out = io.StringIO()
    bar = progress(range(3), desc="study", unit="config", file=out, min_seconds=3600)
    seen = []
    for x in bar:
        bar.set_postfix_str(f"item {x}")
        seen.append(x)
    assert seen == [0, 1, 2]
    lines = out.getvalue().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("study: 3/3 config (")
    assert "[item 2]" in lines[0]
    assert progress(total=5, file=out, disable=True).disable


def test_tqdm_on_a_terminal() -> None:
    from tqdm import tqdm

    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        bar = progress(total=3, desc="x", file=tty)
        assert isinstance(bar, tqdm)
        bar.update(3)
        bar.close()
    os.close(master)


def test_a_lost_stderr_never_fails_the_work() -> None:
    """A bar's line written to a stderr that is closed (``2>&-``: ``sys.stderr`` is None) or
    whose reader went away (``2>&1 | tee log``, tee killed: EPIPE) raised out of ``update``:
    the analysis that reported its progress failed at its first line. Lines are dropped then."""
    import subprocess
    import sys

    code = ("from instride.progress import progress\n"
            "with progress(total=10, desc='frames', min_seconds=0) as bar:\n"
            "    for _ in range(10):\n"
            "        bar.update(1)\n"
            "print('finished', flush=True)\n")
    closed = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            timeout=60, preexec_fn=lambda: os.close(2))
    assert (closed.returncode, closed.stdout) == (0, "finished\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # (the reader gone: every write fails with EPIPE)
    try:
        broken = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=write_end, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert (broken.returncode, broken.stdout) == (0, "finished\n")
