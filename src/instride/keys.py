"""Keys: validation, normalization, and the mapping between keys and paths.

A key is a path relative to the managed directory, such as ``run7/frame_000042.isf``.
Validation is lexical and happens before anything touches the file system, so a bad key
never causes a write anywhere.

>>> from pathlib import Path
>>> normalize_key("run7//./frame_1.isf", Path("/dev/shm/x"))
'run7/frame_1.isf'
>>> normalize_key("/dev/shm/x/run7/frame_1.isf", Path("/dev/shm/x"))
'run7/frame_1.isf'
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
from pathlib import Path

from .config import INTERNAL_DIRNAME
from .errors import KeyValidationError
from .perthread import pid

#: Longest accepted key, in bytes of its UTF-8 encoding.
MAX_KEY_BYTES = 1024
#: Longest accepted path component: NAME_MAX (255) less room for the hidden temporary name.
MAX_COMPONENT_BYTES = 200

#: Hidden temporary files: ``.<name>.instride-<pid>-<hex>.tmp`` next to their key.
TMP_PATTERN = re.compile(r"^\.(?P<name>.+)\.instride-(?P<pid>[0-9]+)-(?P<rand>[0-9a-f]+)\.tmp$")

#: A stream's frame file name (``stream.FRAME_FORMAT``): the one kind of published file whose
#: storage is rewritten in place (a bounded stream reuses a retired frame's file).
_FRAME_NAME = re.compile(r"frame_\d{9}\.isf")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Fast path: short ASCII keys whose components do not start with a dot (so no ".", "..",
# reserved or temporary names) and contain no control characters or empty components.
_SIMPLE = re.compile(r"[^./\x00-\x1f\x7f][^/\x00-\x1f\x7f]*(?:/[^./\x00-\x1f\x7f][^/\x00-\x1f\x7f]*)*")
_COUNTER = itertools.count()
_SALT = secrets.token_hex(3)  # distinguishes PID reuse across boots / namespaces


def recyclable(key: str) -> bool:
    """Whether ``key`` names a stream's frame: a file a bounded stream may rewrite for a later
    frame once it is retired, so a reader holds it while open (see
    :meth:`~instride.paths.ConfinedOpener.open`).

    >>> recyclable("run7/frame_000000042.isf"), recyclable("run7/frame_42.isf")
    (True, False)
    """
    return key.endswith(".isf") and _FRAME_NAME.fullmatch(key, key.rfind("/") + 1) is not None


def normalize_key(key_or_path: str | os.PathLike[str] | bytes, root: Path) -> str:
    """Validate ``key_or_path`` and return its normalized key.

    Parameters
    ----------
    key_or_path
        A key relative to the managed directory, or an absolute path under it.
    root
        The managed directory (absolute, normalized).

    Returns
    -------
    str
        The key: components joined by ``/``, with no ``.`` or empty components.

    Raises
    ------
    KeyValidationError
        For a non-string, empty key, NUL or control character, ``..`` component, a path
        outside ``root``, a trailing ``/`` (a directory), a reserved name, or an over-long key
        or component.
    """
    if (
        type(key_or_path) is str
        and len(key_or_path) <= MAX_COMPONENT_BYTES
        and key_or_path.isascii()
        and _SIMPLE.fullmatch(key_or_path)
        and not key_or_path.isspace()
    ):
        return key_or_path
    if isinstance(key_or_path, bytes):
        try:
            raw = key_or_path.decode("utf-8")
        except UnicodeDecodeError:
            raise KeyValidationError(key_or_path, "not valid UTF-8") from None
    elif isinstance(key_or_path, (str, os.PathLike)):
        raw = os.fspath(key_or_path)
        if not isinstance(raw, str):
            raw = os.fsdecode(raw)
    else:
        raise KeyValidationError(key_or_path, f"expected str or path, got {type(key_or_path).__name__}")
    if "\x00" in raw:
        raise KeyValidationError(key_or_path, "contains a NUL byte")
    try:
        raw.encode("utf-8")
    except UnicodeEncodeError:  # (a name of bytes that are no UTF-8, as os.fsdecode gives them)
        raise KeyValidationError(key_or_path, "not valid UTF-8") from None
    if _CONTROL.search(raw):
        raise KeyValidationError(key_or_path, "contains a control character")
    if raw.strip() == "":
        raise KeyValidationError(key_or_path, "empty name")
    parts = raw.split("/")
    if ".." in parts:
        raise KeyValidationError(key_or_path, "'..' is not allowed")
    if raw.startswith("/"):
        rootstr = str(root).rstrip("/")
        norm = os.path.normpath(raw)
        if norm.startswith("//"):  # (normpath keeps exactly two leading slashes: Linux reads
            norm = "/" + norm.lstrip("/")  # them as one, as the kernel and the C library do)
        if norm != rootstr and not norm.startswith(rootstr + "/"):
            raise KeyValidationError(key_or_path, f"path is outside the managed directory {rootstr}")
        parts = norm[len(rootstr) :].split("/")
    if raw.rsplit("/", 1)[-1] in ("", "."):  # "dir/", "dir/.": a directory, never a file key
        raise KeyValidationError(key_or_path, "ends with '/': a key names a file, not a directory")
    comps = [p for p in parts if p not in ("", ".")]
    if not comps:
        raise KeyValidationError(key_or_path, "empty name")
    for comp in comps:
        if comp.startswith(INTERNAL_DIRNAME):
            raise KeyValidationError(key_or_path, f"names starting with {INTERNAL_DIRNAME!r} are reserved")
        if len(comp.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise KeyValidationError(
                key_or_path, f"component longer than {MAX_COMPONENT_BYTES} bytes"
            )
    if TMP_PATTERN.match(comps[-1]):
        raise KeyValidationError(key_or_path, "names of instride's temporary files are reserved")
    key = "/".join(comps)
    if key.strip() == "":
        raise KeyValidationError(key_or_path, "empty name")
    if len(key.encode("utf-8")) > MAX_KEY_BYTES:
        raise KeyValidationError(key_or_path, f"longer than {MAX_KEY_BYTES} bytes")
    return key


def key_path(key: str, root: Path) -> Path:
    """Return the path of an already-normalized ``key`` under ``root``."""
    return root / key


def tmp_path(path: Path) -> Path:
    """Return a fresh hidden temporary name next to ``path`` (same directory, same file system)."""
    return Path(tmp_name(str(path)))


def tmp_name(path: str) -> str:
    """:func:`tmp_path` on strings (the hot path of every publication avoids pathlib)."""
    head, _, name = path.rpartition("/")
    # (the kept id: os.getpid is a system call each time, two per fetched copy on a woken
    # consumer's path)
    return f"{head}/.{name}.instride-{pid()}-{_SALT}{next(_COUNTER):x}.tmp"
