"""instride: open a file, get it the moment its producer closes it.

Producer/consumer data movement for in situ molecular-dynamics workflows. A producer writes a
file under the managed directory; a consumer that opens it, before or after, gets the complete
file as soon as the producer closes it, read in place on the same node or pulled straight from
the producer's node in cluster mode.

Examples
--------
>>> import instride                                        # doctest: +SKIP
>>> with instride.open("run1/frame_0.dat", "wb") as f:     # producer
...     f.write(payload)
>>> with instride.open("run1/frame_0.dat") as f:           # consumer, any process
...     data = f.read()
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any

from .client import Client, get_client
from .config import Settings
from .errors import (
    ArchiveError,
    AuthenticationError,
    ConfigError,
    ConsumeTimeout,
    EndOfStream,
    FileTypeError,
    FramesMissed,
    GroupBusy,
    GroupLeaseLost,
    GroupReset,
    InstrideError,
    IntegrityError,
    KeyExistsError,
    KeyNotFoundError,
    KeyValidationError,
    MetadataUnavailable,
    PeerUnavailable,
    PublicationUnsettled,
    SourceBusy,
    StreamFull,
    StreamRerun,
    TransferError,
    UnsafePathError,
    UnsupportedModeError,
)
from .frames import Frame, FrameHeader, read_frame, read_header, write_frame
from .stream import Stream

try:
    __version__ = version("instride")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"


def open(  # noqa: A001 - deliberately shadows the builtin, like io.open
    key_or_path: str | os.PathLike[str],
    mode: str = "rb",
    *,
    timeout: float | None = None,
    overwrite: bool = False,
    **kwargs: Any,
) -> IO[Any]:
    """Open a key for reading (waits until published) or writing (publishes on close).

    Parameters
    ----------
    key_or_path
        A key relative to the managed directory (``INSTRIDE_DIR``) or a path under it.
    mode
        ``"r"``/``"rb"`` wait for the key and open it; ``"w"``/``"wb"`` (and ``"x"``, ``"w+"``)
        write a hidden temporary file that is published atomically when closed.
    timeout
        Seconds a read waits (default ``INSTRIDE_TIMEOUT``, else forever).
    overwrite
        Let a write replace an already published key (default: write-once).
    **kwargs
        ``buffering``, ``encoding``, ``errors``, ``newline`` as for the builtin :func:`open`.

    Returns
    -------
    file object
        A regular :mod:`io` file object.

    Raises
    ------
    KeyValidationError
        A bad key (outside the managed directory, ``..``, NUL, empty, too long).
    KeyExistsError
        Writing a published key without ``overwrite``.
    ConsumeTimeout
        A read waited longer than ``timeout``.
    UnsupportedModeError
        Append or update modes: published keys are immutable.

    See Also
    --------
    instride.client.Client.open

    Examples
    --------
    >>> with instride.open("run1/frame_0.dat", "wb") as f:   # doctest: +SKIP
    ...     f.write(data)
    """
    return get_client().open(key_or_path, mode, timeout=timeout, overwrite=overwrite, **kwargs)


def publish(
    path: str | os.PathLike[str],
    key: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
) -> str:
    """Publish a file written by other means, atomically; return its key.

    Parameters
    ----------
    path
        A regular file; with ``key``, it is moved under the key (the source name goes away);
        without, it must already be at its final path under the managed directory.
    key
        The key to publish under.
    overwrite
        Replace an already published key.

    Returns
    -------
    str
        The key.

    Raises
    ------
    FileNotFoundError, KeyExistsError, KeyValidationError, UnsupportedModeError
        See :meth:`instride.client.Client.publish`.
    """
    return get_client().publish(path, key, overwrite=overwrite)


def consume(key: str | os.PathLike[str], timeout: float | None = None) -> Path:
    """Wait until ``key`` is published and on this node; return its local path.

    Parameters
    ----------
    key
        The key (or a path under the managed directory).
    timeout
        Seconds to wait (default ``INSTRIDE_TIMEOUT``, else forever).

    Returns
    -------
    pathlib.Path
        The local file; in cluster mode fetched from its owner node and verified first.

    Raises
    ------
    ConsumeTimeout
        Not published within ``timeout``.
    PeerUnavailable, TransferError, IntegrityError
        Cluster mode: the owner cannot be reached, the transfer broke off, the bytes do not
        match their checksum. Nothing is left under the key.
    """
    return get_client().consume(key, timeout)


def consume_bytes(key: str | os.PathLike[str], timeout: float | None = None) -> memoryview:
    """Wait until ``key`` is published; return its content with no second copy on disk.

    Parameters
    ----------
    key
        The key.
    timeout
        Seconds to wait (default ``INSTRIDE_TIMEOUT``, else forever).

    Returns
    -------
    memoryview
        Read-only: a memory map of the local file (zero copy), or, in cluster mode for a key
        owned by another node, the received and verified bytes (not stored).

    Raises
    ------
    ConsumeTimeout, PeerUnavailable, TransferError, IntegrityError
        As for :func:`consume`.
    """
    return get_client().consume_bytes(key, timeout)


def intercept() -> Any:
    """Route ``builtins.open`` / ``io.open`` of managed paths through instride.

    Returns
    -------
    contextlib.AbstractContextManager
        Inside it, ``open()`` of a path under the managed directory waits for publication
        (reads) or publishes on close (writes); other paths and file descriptors are untouched.
        ``INSTRIDE_PATCH_OPEN=1`` does the same for a whole process, at start-up.

    See Also
    --------
    instride.interception.pyopen
    """
    from .interception.pyopen import intercept as _intercept

    return _intercept()


__all__ = [
    "ArchiveError",
    "AuthenticationError",
    "Client",
    "ConfigError",
    "ConsumeTimeout",
    "EndOfStream",
    "FileTypeError",
    "Frame",
    "FrameHeader",
    "FramesMissed",
    "GroupBusy",
    "GroupLeaseLost",
    "GroupReset",
    "InstrideError",
    "IntegrityError",
    "KeyExistsError",
    "KeyNotFoundError",
    "KeyValidationError",
    "MetadataUnavailable",
    "PublicationUnsettled",
    "PeerUnavailable",
    "Settings",
    "Stream",
    "StreamFull",
    "SourceBusy",
    "StreamRerun",
    "TransferError",
    "UnsafePathError",
    "UnsupportedModeError",
    "__version__",
    "consume",
    "consume_bytes",
    "get_client",
    "intercept",
    "open",
    "publish",
    "read_frame",
    "read_header",
    "write_frame",
]
