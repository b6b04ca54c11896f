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
from ..config import read_variable
from ..errors import ConfigError, KeyValidationError, UnsafePathError, UnsupportedModeError
from ..keys import INTERNAL_DIRNAME, TMP_PATTERN

_original_open = builtins.open
_lock = threading.Lock()
_depth = 0


#: (INSTRIDE_DIR as given, the managed directory, its physical path) of the last lookup
_roots: tuple[str | None, str, str] | None = None


def _managed_roots() -> tuple[str, str]:
    """The managed directory and its physical path (links above it resolved), from
    ``INSTRIDE_DIR`` alone: no client is made for a path that is not managed, so that bad
    settings fail the managed opens only, never every other one."""
    global _roots
    raw = os.environ.get("INSTRIDE_DIR")
    cached = _roots
    if cached is None or cached[0] != raw:
        root = str(read_variable("INSTRIDE_DIR"))
        cached = _roots = (raw, root, os.path.realpath(root))
    return cached[1], cached[2]


def _under(full: str, root: str) -> bool:
    return full != root and full.startswith(root + os.sep)


def _managed_key(file: Any) -> str | None:
    """The path (under the managed directory as configured) of ``file`` when it is under the
    managed directory, else ``None``. A path through the directory's physical location (a
    relative path, after a ``chdir`` into it through a link above it) counts as well."""
    if isinstance(file, int) or not isinstance(file, (str, bytes, os.PathLike)):
        return None
    try:
        raw = os.fsdecode(os.fspath(file))
    except (TypeError, ValueError):
        return None
    root, real = _managed_roots()
    joined = raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw)
    full = os.path.normpath(joined)
    if full.startswith("//"):  # (normpath keeps exactly two; Linux reads them as one, as the
        full = "/" + full.lstrip("/")  # preload library does: "/" + path names the key)
    if not _under(full, root):
        if real == root or not _under(full, real):
            return None
        full = root + full[len(real):]  # (the same file, named under the configured root)
    if raw.endswith(("/", "/.", "/..")) or raw in (".", ".."):
        return None  # (a directory's name: the builtin open says what it says of one; the
        # text of "x/missing/.." normalizes to "x", a name the kernel never reaches)
    if "/../" in joined + "/":
        _refuse_links_before_dotdot(joined, full)
    try:
        get_client().key(full)
    except KeyValidationError:
        if _reserved(full[len(root) + 1:]):
            return None  # instride's own files (.instride/, temporary names) are not keys
        # (a name under the managed directory that is no key: opened in place, its file
        # would be seen half-written; refused, as the preload library refuses it)
        raise
    return full


def _reserved(rel: str) -> bool:
    """Whether ``rel`` (a path under the managed directory) names one of instride's own
    files: a component starting with ``.instride``, or a temporary name (as the preload
    library's ``ins_reserved``)."""
    parts = rel.split("/")
    return any(p.startswith(INTERNAL_DIRNAME) for p in parts) or bool(TMP_PATTERN.match(parts[-1]))


def _refuse_links_before_dotdot(joined: str, full: str) -> None:
    """Raise :class:`UnsafePathError` where a ``..`` of ``joined`` follows a symbolic link:
    the kernel goes up from the link's target, not from where the text says (the key would
    name another file than the path)."""
    parts, walked = joined.split("/"), ""
    for i, part in enumerate(parts):
        if part == ".." and walked and os.path.islink(walked):
            raise UnsafePathError(full, f"{walked!r} is a symbolic link before '..'; keys never "
                                  "follow links")
        walked = os.path.normpath(os.path.join(walked, part)) if i else part or "/"


def instride_open(file: Any, mode: str = "r", buffering: int = -1, encoding: str | None = None,
                  errors: str | None = None, newline: str | None = None, closefd: bool = True,
                  opener: Any = None) -> Any:
    """Drop-in replacement of :func:`open` that couples managed paths through instride.

    Raises
    ------
    UnsupportedModeError
        A managed path opened with ``opener=``: the opener would make the file itself, out
        of instride's publication (a writer's file visible before its close).
    """
    key = _managed_key(file)
    if key is None or not closefd:
        return _original_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
    if _setting_error is not None:
        raise _setting_error
    if opener is not None:
        raise UnsupportedModeError(
            mode, f"open({key!r}, opener=...): a managed path is opened by instride (it "
            "publishes a written file on close); call open() without an opener")
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
    """Install the patch when ``INSTRIDE_PATCH_OPEN=1``; return whether it did.

    A value that is not a flag (``INSTRIDE_PATCH_OPEN=ture``) installs a patch whose opens of
    managed paths raise that :class:`~instride.errors.ConfigError`: the program was meant to
    be patched, and unpatched its writes would land in place, seen half-written by readers
    (the error would otherwise be one traceback at start-up, then ignored)."""
    global _setting_error
    try:
        wanted = read_variable("INSTRIDE_PATCH_OPEN")
    except ConfigError as exc:
        _setting_error = exc
        install()
        return True
    if wanted:
        install()
        return True
    return False


#: the error of a bad ``INSTRIDE_PATCH_OPEN``, raised by every open of a managed path
_setting_error: ConfigError | None = None
