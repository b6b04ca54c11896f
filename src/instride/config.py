"""One settings object, read from ``INSTRIDE_*`` environment variables.

``INSTRIDE_DIR``
    The managed directory of this node (default ``/dev/shm/instride-<uid>``, or the temp
    dir when /dev/shm is unusable).
``INSTRIDE_REDIS_URL``
    Redis URL; set means cluster mode, unset means local mode.
``INSTRIDE_TOKEN``
    The job token every cluster request is HMAC-signed with (required in cluster mode).
``INSTRIDE_TIMEOUT``
    Default consume timeout in seconds, with the meaning of ``--timeout`` (see
    :func:`parse_timeout`): unset, empty or ``inf`` waits forever; ``0`` does not wait (a key
    not yet published fails at once); negative values are refused.
``INSTRIDE_FSYNC``
    fsync a produced file and its directory when publishing it (``0``/``1``, default ``1``);
    skipped when the managed directory is on tmpfs, where it cannot make anything durable.
``INSTRIDE_CACHE_BYTES``
    Bound on fetched (not owned) copies kept on this node (default unbounded).
``INSTRIDE_NODE``
    Name of this node in records and errors (default: the host name).
``INSTRIDE_ADDR``
    ``host:port`` of this node's data server, as peers reach it (default ``127.0.0.1:7437``).
``INSTRIDE_SOCKET``
    Unix socket of this node's data server (default ``$INSTRIDE_DIR/.instride/node.sock``).
``INSTRIDE_CONNECT_TIMEOUT``
    Seconds to reach a peer or Redis before giving up (default 5).
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from .errors import ConfigError

DEFAULT_PORT = 7437
INTERNAL_DIRNAME = ".instride"


def default_dir() -> Path:
    """Return the default managed directory: a per-user directory on tmpfs when possible."""
    uid = os.getuid()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm / f"instride-{uid}"
    return Path(tempfile.gettempdir()) / f"instride-{uid}"


def _float_or_none(name: str, raw: str | None) -> float | None:
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "not a number") from None
    if math.isnan(value):
        raise ConfigError(name, raw, "not a number")
    return value if 0 < value < math.inf else None  # 0, negative or inf: no limit


def parse_timeout(raw: str | float | None, name: str = "INSTRIDE_TIMEOUT") -> float | None:
    """Parse a consume timeout, the one meaning shared by ``INSTRIDE_TIMEOUT`` and ``--timeout``.

    Parameters
    ----------
    raw
        Seconds as text or a number. ``None``, empty, ``inf``, ``forever`` or ``none``: wait
        forever (returns ``None``). ``0``: do not wait, fail at once unless published.
    name
        The setting or option named in the error.

    Returns
    -------
    float or None
        Seconds, or ``None`` for no limit.

    Raises
    ------
    ConfigError
        Not a number, NaN, or negative.
    """
    if raw is None:
        return None
    if isinstance(raw, str):
        text = raw.strip().lower()
        if text in ("", "inf", "infinity", "forever", "none"):
            return None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(name, raw, "not a number of seconds") from None
    else:
        value = float(raw)
    if math.isnan(value):
        raise ConfigError(name, raw, "not a number of seconds")
    if value < 0:
        raise ConfigError(name, raw, "must be >= 0 (0: do not wait; unset or inf: forever)")
    return None if value == math.inf else value


def _bool(name: str, raw: str | None, default: bool) -> bool:
    if raw is None or raw.strip() == "":
        return default
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(name, raw, "expected 0/1/true/false")


def _int_or_none(name: str, raw: str | None) -> int | None:
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, raw, "not an integer") from None
    if value < 0:
        raise ConfigError(name, raw, "must be >= 0")
    return value


def parse_addr(addr: str, name: str = "INSTRIDE_ADDR") -> tuple[str, int]:
    """Split ``host:port`` into ``(host, port)``, raising :class:`ConfigError` when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ConfigError(name, addr, "expected host:port")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(name, addr, "port is not an integer") from None
    if not 0 < number < 65536:
        raise ConfigError(name, addr, "port out of range")
    return host.strip("[]"), number


@dataclass(frozen=True)
class Settings:
    """Everything instride needs to know about this process's node and job.

    Build one with :meth:`from_env`; change a field with :meth:`with_`.
    """

    dir: Path
    redis_url: str | None = None
    token: str | None = None
    timeout: float | None = None
    fsync: bool = True
    cache_bytes: int | None = None
    node: str = "localhost"
    addr: str = f"127.0.0.1:{DEFAULT_PORT}"
    socket_path: Path | None = None
    connect_timeout: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        raw_dir = env.get("INSTRIDE_DIR", "").strip()
        directory = Path(raw_dir) if raw_dir else default_dir()
        if not directory.is_absolute():
            directory = Path.cwd() / directory
        directory = Path(os.path.normpath(directory))
        addr = env.get("INSTRIDE_ADDR", "").strip() or f"127.0.0.1:{DEFAULT_PORT}"
        parse_addr(addr)
        raw_sock = env.get("INSTRIDE_SOCKET", "").strip()
        connect = _float_or_none("INSTRIDE_CONNECT_TIMEOUT", env.get("INSTRIDE_CONNECT_TIMEOUT"))
        return cls(
            dir=directory,
            redis_url=env.get("INSTRIDE_REDIS_URL", "").strip() or None,
            token=env.get("INSTRIDE_TOKEN") or None,
            timeout=parse_timeout(env.get("INSTRIDE_TIMEOUT")),
            fsync=_bool("INSTRIDE_FSYNC", env.get("INSTRIDE_FSYNC"), True),
            cache_bytes=_int_or_none("INSTRIDE_CACHE_BYTES", env.get("INSTRIDE_CACHE_BYTES")),
            node=env.get("INSTRIDE_NODE", "").strip() or socket.gethostname(),
            addr=addr,
            socket_path=Path(raw_sock) if raw_sock else None,
            connect_timeout=connect if connect is not None else 5.0,
        )

    def with_(self, **changes: object) -> Settings:
        """Return a copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def mode(self) -> str:
        """``"cluster"`` when a Redis URL is set, else ``"local"``."""
        return "cluster" if self.redis_url else "local"

    @property
    def internal_dir(self) -> Path:
        """The directory for instride's own files (socket, cache index) inside the managed dir."""
        return self.dir / INTERNAL_DIRNAME

    @property
    def socket(self) -> Path:
        """The Unix socket of this node's data server."""
        return self.socket_path or self.internal_dir / "node.sock"
