"""The transport contract: both halves of a data plane.

A transport moves a published file from its owner node's data server to a consumer node. It
has two halves, both in the transport's own module (or package):

* the **client half** (:class:`Transport`), built by the cluster engine: ``fetch`` a record's
  bytes into a new file, or into memory;
* the **server half** (:class:`TransportServer`), started by ``instride serve``: serve this
  node's managed directory to peers.

Every transfer is authenticated (an HMAC of the job token, ``INSTRIDE_TOKEN``) and verified
(size and checksum of the bytes received against the record, :meth:`Record.verify
<instride.record.Record.verify>`) before the file is published locally; a failed, refused or
short transfer leaves nothing at the destination.

A client half may also offer ``fetch_when_published(owner, key, fd, wait, until, on_reply,
window=, into=, ahead=, digest_from=)`` (the TCP transport does): the owner holds the fetch
until the key is published there, so a stream's reader can ask for its next frame before it
exists (see :meth:`instride.engine.cluster.ClusterEngine.fetch_when_published`); it returns
what it received as a :class:`Received`. It is optional; the
cluster engine looks for it and waits the usual way without it. Its two halves,
``ask_when_published(owner, key, wait, until)`` (send; returns the socket the reply comes on)
and ``receive_asked(sock, owner, key, fd, wait, digest_from=0)``, let a waiter poll that socket
beside another (the cluster engine's ``wait_any`` races it against Redis announcements); closing
the socket withdraws the request. Both return a :class:`Received` whose ``head`` holds the bytes
before ``digest_from``: the cluster engine asks for a stream frame's digest from its 128-byte
header on and checks the frame's record (``"isf:"``) with that header.

A new transport is one module (or package) with both classes, one line in
:data:`instride.transport.REGISTRY`, and a subclass of the contract test suite
(``tests/transport/contract.py``). The client class names its server class with
:meth:`Transport.server_class`, so the server half is found by the same registry name.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import time
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

from ..errors import ConfigError, KeyExistsError
from ..keys import tmp_path
from ..record import Record
from ..store.publish import mark_writing, publish_file


class Received(NamedTuple):
    """What a transport's ``fetch_when_published`` received (not verified: the caller checks)."""

    #: Bytes received.
    size: int
    #: xxh3-64 hex digest of the bytes from ``digest_from`` on (all of them by default).
    digest: str
    #: When the key was published (seconds since the epoch, the owner's clock: the file's
    #: modification time, which a stream's producer stamps as it publishes a frame), where the
    #: owner said; a stream's reader learns its producer's cadence from it.
    published: float | None = None
    #: The bytes before ``digest_from`` (a frame's header, which the check of a frame's
    #: record needs: :meth:`Record.verify <instride.record.Record.verify>`); ``None`` when
    #: the digest covers all of them.
    head: bytes | None = None


@runtime_checkable
class Transport(Protocol):
    """Client half of a data plane. Every fetch is authenticated and verified.

    Built as ``cls(settings)``. Implementations raise
    :class:`~instride.errors.PeerUnavailable` when the owner cannot be reached (down, refused,
    no reply within ``INSTRIDE_CONNECT_TIMEOUT``), :class:`~instride.errors.TransferError`
    when a transfer breaks off or stalls, :class:`~instride.errors.AuthenticationError` when
    the owner refuses the token, :class:`~instride.errors.KeyNotFoundError` when the owner
    does not have the key, and :class:`~instride.errors.IntegrityError` when the bytes do not
    match ``record``; in every failure nothing is left at ``dest``.
    """

    #: The registry name.
    name: str

    def fetch(self, record: Record, dest: Path) -> None:
        """Write the content of ``record.key`` to the new file ``dest`` and verify it; nothing
        is at ``dest`` before the whole verified body is (:func:`fetch_to_new_file`)."""

    def fetch_into(self, record: Record, fd: int) -> None:
        """Write the verified content of ``record.key`` into the open file ``fd``.

        From the descriptor's current offset (the caller gives a file of ``record.size``
        bytes, positioned at 0: a recycled one, see :mod:`instride.store.recvpool`). On a
        failure the file's content is undefined and the caller discards it.
        """

    def fetch_bytes(self, record: Record) -> bytearray:
        """Return the verified content of ``record.key`` in memory."""

    def close(self) -> None:
        """Release resources (the transport stays usable)."""

    @classmethod
    def server_class(cls) -> type[TransportServer]:
        """The server half of this transport."""


@runtime_checkable
class TransportServer(Protocol):
    """Server half of a data plane: serves one node's managed directory to peers.

    Built as ``cls(settings, *, max_peers, request_timeout, send_timeout)`` (see
    :func:`instride.transport.get_server`) and driven by the node server's asyncio loop.
    Only regular files inside the managed directory are served
    (:func:`instride.store.served.open_served`); requests are authenticated with the job token.
    """

    #: Counters: ``fetches``, ``bytes_sent``, ``refused``, ``errors``, ``busy``, ``stalled``.
    stats: dict[str, int]

    async def start(self) -> None:
        """Start listening on ``settings.addr``."""

    async def stop(self, grace: float) -> None:
        """Stop accepting; let in-flight transfers finish for ``grace`` seconds; close."""

    def snapshot(self) -> dict[str, Any]:
        """The counters plus current gauges (``peers``: connections being served)."""

def fetch_to_new_file(transport: Transport, record: Record, dest: Path) -> None:
    """``transport.fetch`` in terms of ``transport.fetch_into``: receive into a hidden
    temporary file beside ``dest``, then give it the name ``dest`` in one step once the whole
    body is there and verified. Nothing is ever visible at ``dest`` before that, and the
    temporary file is removed on any failure.

    Raises
    ------
    FileExistsError
        ``dest`` exists (before the transfer, or made by another process during it: it is
        never replaced).
    """
    if os.path.lexists(dest):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest))
    tmp = tmp_path(dest)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    mark_writing(fd)  # (instride gc leaves it while it is received)
    try:
        transport.fetch_into(record, fd)
        os.close(fd)
        fd = -1
        publish_file(tmp, dest, record.key, overwrite=False)
    except KeyExistsError:
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dest)) from None
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def open_engine(path: Path, transport: str, missing: str, hint: str) -> ctypes.CDLL:
    """Load a transport's C engine (a shared library next to the package's modules).

    Parameters
    ----------
    path
        The library.
    transport
        The transport's registry name (``INSTRIDE_TRANSPORT``), named in the error.
    missing
        What is missing when the file is not there (it was not built).
    hint
        How to get it built (the Debian packages to install).

    Raises
    ------
    ConfigError
        The library was not built or cannot be loaded.
    """
    if not path.exists():
        raise ConfigError("INSTRIDE_TRANSPORT", transport, f"{missing} ({path.name} is missing); {hint}")
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise ConfigError("INSTRIDE_TRANSPORT", transport,
                          f"cannot load {path.name} ({exc}); {hint}") from None


__all__ = ["Transport", "TransportServer", "fetch_to_new_file", "open_engine"]


class Backoff:
    """Tries again after an owner said it was busy: 10 ms, doubling to 0.2 s, within ``limit`` s."""

    def __init__(self, limit: float | None) -> None:
        self.deadline = None if limit is None else time.monotonic() + limit
        self.pause = 0.01

    def again(self) -> bool:
        """Sleep before the next try; whether there is time for one."""
        if self.deadline is not None and time.monotonic() + self.pause > self.deadline:
            return False
        time.sleep(self.pause)
        self.pause = min(0.2, 2 * self.pause)
        return True
