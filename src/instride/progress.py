"""Progress bars that suit their output: tqdm on a terminal, plain lines in a log file.

tqdm redraws its bar with carriage returns and cursor movements; written to a redirected
stderr (a batch job's log, ``2> log``), every redraw becomes a line full of control
characters. :func:`progress` returns a tqdm bar when stderr is a terminal and otherwise a
:class:`PlainProgress`, which writes a plain line now and then (every 10 % of the total, at
most every ``min_seconds``) and one at the end. It takes the same arguments as ``tqdm``, so
``progress(total=n, desc="frames")`` is a drop-in replacement. A line that cannot be written
(stderr closed, its reader gone) ends the lines, never the work.

Examples
--------
>>> from instride.progress import progress
>>> with progress(total=100, desc="frames", unit="frame") as bar:   # doctest: +SKIP
...     for _ in range(100):
...         bar.update(1)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO, Any

__all__ = ["PlainProgress", "progress"]


class PlainProgress:
    """A tqdm stand-in that writes plain ``desc: n/total unit`` lines.

    Parameters
    ----------
    iterable
        Optional iterable to wrap (iterating the bar iterates it and counts).
    total
        Expected count (default ``len(iterable)`` when it has one).
    desc, unit
        Label and unit, as for tqdm.
    disable
        Write nothing.
    file
        Where to write (default ``sys.stderr``).
    min_seconds
        Least time between two progress lines (the final line is always written).
    **_
        Other tqdm arguments (``position``, ``leave``, ``mininterval``...) are accepted and
        ignored.
    """

    def __init__(
        self,
        iterable: Iterable[Any] | None = None,
        total: float | None = None,
        desc: str | None = None,
        unit: str = "it",
        disable: bool = False,
        file: IO[str] | None = None,
        min_seconds: float = 5.0,
        **_: Any,
    ) -> None:
        self.iterable = iterable
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)  # type: ignore[arg-type]
        self.total = total
        self.desc = desc or ""
        self.unit = unit
        self.disable = disable
        self.file = file
        self.min_seconds = min_seconds
        self.n = 0
        self._t0 = time.monotonic()
        self._last_time = self._t0
        self._last_decile = 0
        self._closed = False
        self._written_n: float | None = None
        self.postfix = ""

    def _line(self, final: bool = False) -> str:
        total = "" if self.total is None else f"/{self.total:g}"
        elapsed = time.monotonic() - self._t0
        rate = f", {self.n / elapsed:.3g} {self.unit}/s" if elapsed > 0 and self.n else ""
        head = f"{self.desc}: " if self.desc else ""
        post = f" [{self.postfix}]" if self.postfix else ""
        return (f"{head}{self.n:g}{total} {self.unit} ({elapsed:.1f} s{rate}){post}"
                f"{' done' if final else ''}")

    def _write(self, text: str) -> None:
        if self.disable:
            return
        out = self.file if self.file is not None else sys.stderr
        self._written_n = self.n
        try:
            out.write(text + "\n")  # (None: stderr closed at start-up, ``2>&-``)
            out.flush()
        except (OSError, ValueError, AttributeError):
            # (stderr gone: EPIPE once a `| tee log` ended, EIO once the terminal hung up,
            # closed: a report of progress never fails the work it reports on)
            self.disable = True

    def update(self, n: float = 1) -> None:
        """Count ``n`` more; write a line when another tenth of the total is done."""
        self.n += n
        now = time.monotonic()
        if self.total:
            decile = int(10 * self.n / self.total)
            due = decile > self._last_decile and now - self._last_time >= self.min_seconds
            if due or (decile >= 10 > self._last_decile):
                self._last_decile = decile
                self._last_time = now
                self._write(self._line())
        elif now - self._last_time >= max(self.min_seconds, 30.0):
            self._last_time = now
            self._write(self._line())

    def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
        """Show ``key=value`` pairs at the end of the next lines."""
        items = dict(ordered_dict or {}, **kwargs)
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show ``s`` at the end of the next lines."""
        self.postfix = s

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        """Change the label."""
        self.desc = desc or ""

    def refresh(self) -> None:
        """Accepted for tqdm compatibility."""

    def close(self) -> None:
        """Write the final line (once)."""
        if self._closed:
            return
        self._closed = True
        if self._written_n != self.n:  # the count since the last line, or the only line
            self._write(self._line(final=True))

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("PlainProgress was created without an iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
    """A progress bar: ``tqdm`` when stderr is a terminal, else :class:`PlainProgress`.

    Parameters
    ----------
    iterable
        Optional iterable to wrap.
    **kwargs
        tqdm's arguments (``total``, ``desc``, ``unit``, ``position``, ``leave``, ``disable``...).

    Returns
    -------
    tqdm.tqdm or PlainProgress
        Either way: ``update(n)``, ``close()``, iteration and use as a context manager.
    """
    stream = kwargs.get("file") or sys.stderr
    isatty = getattr(stream, "isatty", None)
    try:
        terminal = isatty is not None and isatty()
    except ValueError:  # (closed)
        terminal = False
    if terminal:
        from tqdm.auto import tqdm

        return tqdm(iterable, **kwargs)
    return PlainProgress(iterable, **kwargs)
