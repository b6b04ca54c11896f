"""Route Python's ``open`` through instride for paths under the managed directory.

Unmodified Python analysis scripts open files with the builtin :func:`open`. Inside
:func:`intercept` (or in every process when ``INSTRIDE_PATCH_OPEN=1`` is set at start-up),
``builtins.open`` and ``io.open`` become a wrapper that sends paths under the managed
directory to :func:`instride.open` — reads wait until the file is published, writes publish on
close — and passes every other path, file descriptor and mode straight to the original.

Examples
--------
>>> import instride                                           # doctest: +SKIP
>>> with instride.intercept():
...     with open("/dev/shm/instride-0/run1/frame.dat", "rb") as f:   # waits if not published
...         data = f.read()
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import threading
from collections.abc import Iterator
from typing import Any

from ..client import get_client
from ..errors import KeyValidationError

_original_open = builtins.open
_lock = threading.Lock()
_depth = 0


def _managed_key(file: Any) -> str | None:
    """The key of ``file`` when it is a path under the managed directory, else ``None``."""
    if isinstance(file, int) or not isinstance(file, (str, bytes, os.PathLike)):
        return None
    try:
        raw = os.fsdecode(os.fspath(file))
    except (TypeError, ValueError):
        return None
    client = get_client()
    root = str(client.root)
    full = os.path.normpath(raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw))
    if full == root or not full.startswith(root + os.sep):
        return None
    try:
        client.key(full)
    except KeyValidationError:
        return None  # instride's own files (.instride/, temporary names) are not keys
    return full


def instride_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None, closefd: bool = True,
                  opener: Any = None) -> Any:
    """Drop-in replacement of :func:`open` that couples managed paths through instride."""
    key = _managed_key(file)
    if key is None or opener is not None or not closefd:
        return _original_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    return get_client().open(key, mode, buffering=buffering, encoding=encoding, errors=errors,
                             newline=newline)


def install() -> None:
    """Patch ``builtins.open`` and ``io.open`` (idempotent; counted)."""
    global _depth
    with _lock:
        _depth += 1
        builtins.open = instride_open
        io.open = instride_open  # type: ignore[assignment]


def uninstall() -> None:
    """Undo one :func:`install`; the originals return when the count reaches zero."""
    global _depth
    with _lock:
        _depth = max(0, _depth - 1)
        if _depth == 0:
            builtins.open = _original_open
            io.open = _original_open  # type: ignore[assignment]


@contextlib.contextmanager
def intercept() -> Iterator[None]:
    """Context manager: inside it, ``open`` of managed paths goes through instride."""
    install()
    try:
        yield
    finally:
        uninstall()


def install_from_env() -> bool:
    """Install the patch when ``INSTRIDE_PATCH_OPEN=1``; return whether it did."""
    if __import__("instride.config", fromlist=["read_variable"]).read_variable("INSTRIDE_PATCH_OPEN"):
        install()
        return True
    return False
