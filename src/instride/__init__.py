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
    AuthenticationError,
    ConfigError,
    ConsumeTimeout,
    EndOfStream,
    InstrideError,
    IntegrityError,
    KeyExistsError,
    KeyNotFoundError,
    KeyValidationError,
    MetadataUnavailable,
    PeerUnavailable,
    TransferError,
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

    See :meth:`instride.client.Client.open` for the full description.
    """
    return get_client().open(key_or_path, mode, timeout=timeout, overwrite=overwrite, **kwargs)


def publish(
    path: str | os.PathLike[str],
    key: str | os.PathLike[str] | None = None,
    *,
    overwrite: bool = False,
) -> str:
    """Publish a file written by other means, atomically; return its key.

    See :meth:`instride.client.Client.publish`.
    """
    return get_client().publish(path, key, overwrite=overwrite)


def consume(key: str | os.PathLike[str], timeout: float | None = None) -> Path:
    """Wait until ``key`` is published and local; return its path.

    See :meth:`instride.client.Client.consume`.
    """
    return get_client().consume(key, timeout)


def consume_bytes(key: str | os.PathLike[str], timeout: float | None = None) -> memoryview:
    """Wait until ``key`` is published; return its content with no second copy on disk.

    See :meth:`instride.client.Client.consume_bytes`.
    """
    return get_client().consume_bytes(key, timeout)


def intercept() -> Any:
    """Route ``builtins.open`` / ``io.open`` of managed paths through instride (context manager).

    See :mod:`instride.pyopen`.
    """
    from .pyopen import intercept as _intercept

    return _intercept()


__all__ = [
    "AuthenticationError",
    "Client",
    "ConfigError",
    "ConsumeTimeout",
    "EndOfStream",
    "Frame",
    "FrameHeader",
    "InstrideError",
    "IntegrityError",
    "KeyExistsError",
    "KeyNotFoundError",
    "KeyValidationError",
    "MetadataUnavailable",
    "PeerUnavailable",
    "Settings",
    "Stream",
    "TransferError",
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
