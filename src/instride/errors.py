"""The typed errors of instride.

Every error derives from :class:`InstrideError` and also from the builtin exception it
refines, so callers can catch either (``except TimeoutError`` catches
:class:`ConsumeTimeout`). Errors of the libraries underneath (Redis, sockets) are
translated into these at the boundary where they occur.
"""

from __future__ import annotations

import errno as _errno
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit


class InstrideError(Exception):
    """Root of every error raised by instride.

    Errors pickle and unpickle to the same type, message and attributes (an error raised in a
    worker process or on another MPI rank reaches the caller as itself): a class whose
    ``__init__`` takes its own arguments records them in ``_init_args``, and
    :meth:`__reduce__` calls the class with them again.
    """

    #: errno a C caller (the preload shim, the Unix-socket protocol) sees for this error.
    errno: int = _errno.EIO
    #: The constructor's arguments, for :meth:`__reduce__` (``None``: those of ``Exception``).
    _init_args: tuple[Any, ...] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """Rebuild from the constructor's arguments, then restore the instance's attributes."""
        if self._init_args is None:
            return super().__reduce__()
        return type(self), self._init_args, self.__dict__


class KeyValidationError(InstrideError, ValueError):
    """A key or path is not acceptable: outside the managed directory, ``..``, NUL, too long..."""

    errno = _errno.EINVAL

    def __init__(self, key: object, reason: str) -> None:
        self._init_args = (key, reason)
        self.key = key
        self.reason = reason
        super().__init__(f"invalid key {key!r}: {reason}")


class KeyExistsError(InstrideError, FileExistsError):
    """A write-once key is already published (pass ``overwrite=True`` to replace it)."""

    errno = _errno.EEXIST

    def __init__(self, key: str) -> None:
        self._init_args = (key,)
        self.key = key
        super().__init__(_errno.EEXIST, f"key {key!r} is already published (write-once)")


class KeyNotFoundError(InstrideError, FileNotFoundError):
    """A key that was required to exist is not published."""

    errno = _errno.ENOENT

    def __init__(self, key: str) -> None:
        self._init_args = (key,)
        self.key = key
        super().__init__(_errno.ENOENT, f"key {key!r} is not published")


class KeyNotServed(KeyNotFoundError):
    """A key's file exists but is not a regular file inside the managed directory.

    Peers get it as a ``KeyNotFoundError`` reply (with the reason).
    """

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(key)
        self._init_args = (key, reason)
        self.reason = reason
        self.strerror = f"key {key!r} is not served: {reason}"


class UnsafePathError(InstrideError, PermissionError):
    """A key's path leaves the managed directory: a symbolic link on the way, or it resolves outside.

    Keys never follow symbolic links, so nothing is ever read or written outside the managed
    directory through one (see :mod:`instride.paths`).
    """

    errno = _errno.ELOOP

    def __init__(self, key: str, reason: str) -> None:
        self._init_args = (key, reason)
        self.key = key
        self.reason = reason
        super().__init__(_errno.ELOOP, f"key {key!r} refused: {reason}")


class FileTypeError(InstrideError, OSError):
    """A key names something other than a regular file (a directory, a FIFO, a device...).

    ``errno`` is ``EISDIR`` for a directory, ``ENOTDIR`` for a file where a directory is
    needed, ``EINVAL`` for a special file.
    """

    errno = _errno.EINVAL

    def __init__(self, key: str, reason: str, code: int = _errno.EINVAL) -> None:
        self._init_args = (key, reason, code)
        self.key = key
        self.reason = reason
        super().__init__(code, f"key {key!r} refused: {reason}")
        self.errno = code  # the instance's code, over the class default


class ConsumeTimeout(InstrideError, TimeoutError):
    """A consumer waited longer than its timeout for a key (or the next frame of a stream)."""

    errno = _errno.ETIMEDOUT

    def __init__(self, key: str, waited: float) -> None:
        self._init_args = (key, waited)
        self.key = key
        self.waited = waited
        super().__init__(f"timed out after {waited:.3f} s waiting for key {key!r}")


class IntegrityError(InstrideError, OSError):
    """Bytes do not match their checksum, size or format (corrupt frame, bad transfer)."""

    errno = _errno.EIO

    def __init__(self, what: str, detail: str) -> None:
        self._init_args = (what, detail)
        self.what = what
        self.detail = detail
        super().__init__(_errno.EIO, f"integrity check failed for {what}: {detail}")


class PeerUnavailable(InstrideError, ConnectionError):
    """The data server of another node cannot be reached (down, refused, timed out)."""

    errno = _errno.EHOSTUNREACH

    def __init__(self, node: str, detail: str) -> None:
        self._init_args = (node, detail)
        self.node = node
        self.detail = detail
        super().__init__(_errno.EHOSTUNREACH, f"peer {node} unavailable: {detail}")


class ServeError(InstrideError, OSError):
    """This node's data server (or ``what``: another server instride runs, the IMD server)
    could not start (its address taken, its Unix socket not made, ...)."""

    def __init__(self, detail: str, code: int = _errno.EIO, what: str = "the data server") -> None:
        self._init_args = (detail, code, what)
        self.detail = detail
        super().__init__(code, f"{what} could not start: {detail}")


class TransferError(InstrideError, OSError):
    """A transfer failed part-way (connection cut, short body, protocol violation)."""

    errno = _errno.EIO

    def __init__(self, key: str, detail: str) -> None:
        self._init_args = (key, detail)
        self.key = key
        self.detail = detail
        super().__init__(_errno.EIO, f"transfer of {key!r} failed: {detail}")


class AuthenticationError(InstrideError, PermissionError):
    """A request was refused because its HMAC did not match the job token."""

    errno = _errno.EACCES

    def __init__(self, detail: str) -> None:
        self._init_args = (detail,)
        self.detail = detail
        super().__init__(_errno.EACCES, f"authentication failed: {detail}")


def redact_url(url: str) -> str:
    """``url`` without its password (``redis://:pw@host`` -> ``redis://***@host``; a
    ``password=`` or ``username=`` of its query -> ``password=***``, as redis-py reads those
    too): what errors and logs show of a URL."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # (not a URL: a bad setting, shown as it is)
        return url
    secret = ("password", "username")
    fields = parse_qsl(parts.query, keep_blank_values=True)
    if password is None and not any(name.lower() in secret for name, _ in fields):
        return url
    if password is not None:
        parts = parts._replace(netloc=f"***@{parts.netloc.rsplit('@', 1)[1]}")
    fields = [(name, "***" if name.lower() in secret else value) for name, value in fields]
    return parts._replace(query=urlencode(fields, safe="*")).geturl()


class MetadataUnavailable(InstrideError, ConnectionError):
    """The metadata service (Redis) cannot be reached within the timeout. Its URL is shown
    without its password (:func:`redact_url`)."""

    errno = _errno.EIO

    def __init__(self, url: str, detail: str) -> None:
        url = redact_url(url)
        self._init_args = (url, detail)
        self.url = url
        self.detail = detail
        super().__init__(_errno.EIO, f"metadata service {url} unavailable: {detail}")


class PublicationUnsettled(MetadataUnavailable):
    """A publication reached Redis, which then could not be reached for its answer within the
    timeout: the key may or may not be recorded.

    The published file stays under its key (removed, a record stored after all would name a
    file that is gone, and the write-once key could never be published again). Register it
    again once Redis answers (:meth:`~instride.Client.register`, or :func:`instride.publish`
    of its path): that confirms a record of this very file (this node, the same checksum), or
    records it.
    """

    def __init__(self, url: str, key: str, detail: str) -> None:
        MetadataUnavailable.__init__(self, url, f"key {key!r} may or may not be recorded (Redis "
                                     "could not be reached for the publication's answer: "
                                     f"{detail}); its file stays under the key: register it "
                                     "again once Redis answers, which confirms or records it")
        self._init_args = (url, key, detail)
        self.key = key


class EndOfStream(InstrideError, EOFError):
    """A stream has ended (its producer closed it) and holds no frame past this point."""

    def __init__(self, stream: str, index: int) -> None:
        self._init_args = (stream, index)
        self.stream = stream
        self.index = index
        super().__init__(f"stream {stream!r} ended before frame {index}")


class FramesMissed(InstrideError, LookupError):
    """A consumer fell behind a stream that drops frames: frames it had not read are gone.

    Raised by a reader whose stream drops old frames (``on_full="drop-oldest"`` or
    ``"latest"``) when the frame it asked for was retired before it got there, unless the
    reader chose to count gaps instead (``on_gap="count"``). After the error the reader's
    cursor is at the oldest frame still retained, so iteration can go on.
    """

    def __init__(self, stream: str, index: int, missed: int, resume: int) -> None:
        self._init_args = (stream, index, missed, resume)
        self.stream = stream
        self.index = index
        self.missed = missed
        self.resume = resume
        super().__init__(
            f"stream {stream!r}: frames {index}..{resume - 1} ({missed}) were dropped before this "
            f"reader got to them; the oldest frame kept is {resume}"
        )


class StreamRerun(InstrideError, OSError):
    """The stream a plain reader was reading was started over under its name (a producer with
    ``overwrite=True``): its frames are numbered from 0 again, and the reader's next frame
    would be the new run's, with the new run's frames before it skipped. Open the stream
    again to read the new run. (A consumer group's reader raises :class:`GroupReset`.)"""

    errno = _errno.ESTALE

    def __init__(self, stream: str, index: int) -> None:
        self._init_args = (stream, index)
        self.stream = stream
        self.index = index
        super().__init__(
            _errno.ESTALE,
            f"stream {stream!r} was re-run (a producer started it over, overwrite=True) after "
            f"this reader had read frames of the earlier run: frame {index} would be the new "
            "run's; open the stream again to read the new run from its first frame")


class SourceBusy(InstrideError, BlockingIOError):
    """A file to publish is open for writing by another process, or was opened for writing
    while it was being moved into place: a key's bytes never change once published, so it
    is not published (the file is left where it was). Close it, then publish it."""

    errno = _errno.EBUSY

    def __init__(self, path: str, why: str = "it is open for writing by another process") -> None:
        self._init_args = (path, why)
        self.path = path
        super().__init__(
            _errno.EBUSY,
            f"cannot publish {path!r}: {why} (a key's bytes never change once published: "
            "close it, then publish it); nothing was published, the file is where it was")


class StreamFull(InstrideError, TimeoutError):
    """A producer waited longer than its timeout for consumer groups to take old frames."""

    errno = _errno.ETIMEDOUT

    def __init__(self, stream: str, waited: float, holders: list[str]) -> None:
        self._init_args = (stream, waited, holders)
        self.stream = stream
        self.waited = waited
        self.holders = holders
        who = ", ".join(holders) or "(none)"
        super().__init__(
            f"stream {stream!r} is full: waited {waited:.3f} s for consumer group(s) {who} to take "
            "its oldest frame (on_full='block')"
        )


class GroupBusy(InstrideError, BlockingIOError):
    """Another live process already reads a stream as this consumer group."""

    errno = _errno.EBUSY

    def __init__(self, stream: str, group: str) -> None:
        self._init_args = (stream, group)
        self.stream = stream
        self.group = group
        super().__init__(
            _errno.EBUSY,
            f"consumer group {group!r} of stream {stream!r} is held by another live process "
            "(one reader per group; the group is free again when that process exits — in "
            "cluster mode, a holder on another machine: once its lease has run out)",
        )


class GroupLeaseLost(GroupBusy):
    """A cluster reader's lease on its consumer group expired and another reader took the
    group over (this one was stopped or paused longer than the lease): it must not go on
    reading as the group, or both would take the same frames."""

    def __init__(self, stream: str, group: str, lease_s: float) -> None:
        super().__init__(stream, group)
        self._init_args = (stream, group, lease_s)
        self.lease_s = lease_s
        self.strerror = (
            f"lost the lease on consumer group {group!r} of stream {stream!r}: this reader was "
            f"not heard from for longer than the lease ({lease_s:g} s) and another reader took "
            "the group over; open the stream again to read as the group")
        self.args = (_errno.EBUSY, self.strerror)


class GroupReset(GroupLeaseLost):
    """A reader's consumer group was reset by a re-run of its stream (a producer that started
    over under the name, ``overwrite=True``): the reader's position belongs to the earlier
    run, whose frames are gone. It must not go on as the group: it would skip the new run's
    frames before its position (or wait for one that never comes)."""

    def __init__(self, stream: str, group: str) -> None:
        super().__init__(stream, group, 0.0)
        self._init_args = (stream, group)
        self.strerror = (
            f"consumer group {group!r} of stream {stream!r} was reset by a re-run of the stream "
            "(a producer started it over, overwrite=True): this reader's position is the "
            "earlier run's; open the stream again to read the new run as the group")
        self.args = (_errno.EBUSY, self.strerror)


class ArchiveError(InstrideError, OSError):
    """A stream's archiver failed: frames may be missing from its archive file. Also a file
    that cannot be used as the archive (not one, another stream's, another archiver's).

    ``stream`` is ``None`` when the stream is not known (an archive opened by its path alone).
    ``busy``: the file is held by another process for the moment (an archiver resuming it):
    worth trying again.
    """

    def __init__(self, stream: str | None, path: object, detail: str, busy: bool = False) -> None:
        self._init_args = (stream, path, detail, busy)
        self.stream = stream
        self.path = path
        self.detail = detail
        self.busy = busy
        what = f"archive {path}" if stream is None else f"archiver of stream {stream!r} ({path})"
        super().__init__(_errno.EIO, f"{what} failed: {detail}")


class UnsupportedModeError(InstrideError, ValueError):
    """A file mode instride cannot honour (append or update of an immutable published key)."""

    errno = _errno.EPERM

    def __init__(self, mode: str, reason: str) -> None:
        self._init_args = (mode, reason)
        self.mode = mode
        super().__init__(f"mode {mode!r} is not supported: {reason}")


class ConfigError(InstrideError, ValueError):
    """An ``INSTRIDE_*`` setting has a value that cannot be used."""

    errno = _errno.EINVAL

    def __init__(self, name: str, value: object, reason: str) -> None:
        self._init_args = (name, value, reason)
        self.name = name
        self.value = value
        self.reason = reason
        super().__init__(f"bad setting {name}={value!r}: {reason}")


class WireError(InstrideError, ValueError):
    """A malformed or oversized message on a transport's wire (refused, never answered with bytes)."""

    errno = _errno.EPROTO


class AgentError(InstrideError, OSError):
    """A request to the node agent (Unix socket) that cannot be served; ``code`` is its errno."""

    def __init__(self, code: int, message: str) -> None:
        self._init_args = (code, message)
        super().__init__(code, message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message


#: error class name -> class, used to rebuild errors sent over the wire.
BY_NAME: dict[str, type[InstrideError]] = {
    cls.__name__: cls
    for cls in (
        KeyValidationError,
        KeyExistsError,
        KeyNotFoundError,
        UnsafePathError,
        FileTypeError,
        ConsumeTimeout,
        IntegrityError,
        PeerUnavailable,
        TransferError,
        AuthenticationError,
        MetadataUnavailable,
        PublicationUnsettled,
        EndOfStream,
        FramesMissed,
        StreamRerun,
        StreamFull,
        GroupBusy,
        GroupLeaseLost,
        GroupReset,
        ArchiveError,
        ConfigError,
        UnsupportedModeError,
        WireError,
    )
}
