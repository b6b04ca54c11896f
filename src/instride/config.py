"""One settings object, read from ``INSTRIDE_*`` environment variables.

Every ``INSTRIDE_*`` variable the Python side reads is declared once, in :data:`VARIABLES`
(name, parser, default, meaning), and parsed only here: :meth:`Settings.from_env` reads them
all, :func:`read_variable` reads one (for start-up hooks that must not fail on unrelated
variables), and :data:`ENV_KEYS` lists them (the process-wide client is rebuilt when one of
them changes). The table of variables for users is the README's "Configuration" section; the
C library reads the same names with the same meanings.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

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


#: INSTRIDE_AHEAD_BYTES's default: the largest fetch whose next file is made ahead (see
#: instride.store.recvpool)
AHEAD_BYTES = 4 << 20


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


def _ahead_bytes(name: str, raw: str | None) -> int:
    value = _int_or_none(name, raw)
    return AHEAD_BYTES if value is None else value


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


def _dir(name: str, raw: str | None) -> Path:
    raw = (raw or "").strip()
    directory = Path(raw) if raw else default_dir()
    if not directory.is_absolute():
        directory = Path.cwd() / directory
    return Path(os.path.normpath(directory))


def _str_or_none(name: str, raw: str | None) -> str | None:
    return (raw or "").strip() or None


def _token(name: str, raw: str | None) -> str | None:
    return raw or None  # taken as is: a token may hold any character


def _node(name: str, raw: str | None) -> str:
    return (raw or "").strip() or socket.gethostname()


def _addr(name: str, raw: str | None) -> str:
    addr = (raw or "").strip() or f"127.0.0.1:{DEFAULT_PORT}"
    parse_addr(addr, name)
    return addr


def _path_or_none(name: str, raw: str | None) -> Path | None:
    raw = (raw or "").strip()
    return Path(raw) if raw else None


def _timeout(name: str, raw: str | None) -> float | None:
    return parse_timeout(raw, name)


def _connect_timeout(name: str, raw: str | None) -> float:
    value = _float_or_none(name, raw)
    return 5.0 if value is None else value


def _spin(name: str, raw: str | None) -> float:
    if raw is None or raw.strip() == "":
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(name, raw, "not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(name, raw, "must be a finite number of seconds >= 0")
    return value


#: Scheduling policies of the data server's threads (``instride serve --sched``).
SERVE_POLICIES = ("batch", "normal", "inherit")


def _serve_sched(name: str, raw: str | None) -> str:
    value = (raw or "").strip().lower() or "batch"
    if value not in SERVE_POLICIES:
        raise ConfigError(name, raw, f"expected one of {', '.join(SERVE_POLICIES)}")
    return value


def _state_dir(name: str, raw: str | None) -> Path:
    raw = (raw or "").strip()
    return Path(raw) if raw else Path("/run/instride/clusters")


def _flag(name: str, raw: str | None) -> bool:
    return _bool(name, raw, False)


def _fsync(name: str, raw: str | None) -> bool:
    return _bool(name, raw, True)


def _name(name: str, raw: str | None) -> str:
    value = (raw or "").strip().lower() or "tcp"
    if not value.replace("_", "").replace("-", "").isalnum():
        raise ConfigError(name, raw, "expected a registered name such as 'tcp'")
    return value


@dataclass(frozen=True)
class Variable:
    """One ``INSTRIDE_*`` environment variable: the :class:`Settings` field it fills."""

    name: str
    field: str
    parse: Callable[[str, str | None], Any]
    default: str
    meaning: str


#: Every ``INSTRIDE_*`` variable read by the Python side, in the README table's order.
VARIABLES: tuple[Variable, ...] = (
    Variable("INSTRIDE_DIR", "dir", _dir, "/dev/shm/instride-<uid> (temp dir if /dev/shm is unusable)",
             "the managed directory of this node"),
    Variable("INSTRIDE_REDIS_URL", "redis_url", _str_or_none, "unset",
             "set: cluster mode (metadata in Redis); unset: local mode"),
    Variable("INSTRIDE_TOKEN", "token", _token, "unset",
             "job token; every cluster request carries an HMAC of it"),
    Variable("INSTRIDE_TIMEOUT", "timeout", _timeout, "forever",
             "default consume timeout, seconds (0: do not wait, fail at once unless published; "
             "empty or inf: forever; negative: refused)"),
    Variable("INSTRIDE_FSYNC", "fsync", _fsync, "1",
             "fsync a produced file (and its directory) when publishing it; skipped on tmpfs"),
    Variable("INSTRIDE_CACHE_BYTES", "cache_bytes", _int_or_none, "unbounded",
             "bound on fetched (not owned) copies kept on a node, LRU"),
    Variable("INSTRIDE_AHEAD_BYTES", "ahead_bytes", _ahead_bytes, "4194304",
             "largest fetch whose next file a node that keeps every copy makes ahead, in the "
             "pauses between transfers (0: none)"),
    Variable("INSTRIDE_NODE", "node", _node, "host name", "name of this node in records and errors"),
    Variable("INSTRIDE_ADDR", "addr", _addr, f"127.0.0.1:{DEFAULT_PORT}",
             "host:port of this node's data server, as peers reach it"),
    Variable("INSTRIDE_SOCKET", "socket_path", _path_or_none, "$INSTRIDE_DIR/.instride/node.sock",
             "Unix socket of this node's data server"),
    Variable("INSTRIDE_CONNECT_TIMEOUT", "connect_timeout", _connect_timeout, "5",
             "seconds to reach a peer or Redis"),
    Variable("INSTRIDE_TRANSPORT", "transport", _name, "tcp",
             "transport the cluster engine fetches with and the data server serves: tcp or ucx"),
    Variable("INSTRIDE_SPIN", "spin", _spin, "0",
             "seconds a waiting consumer busy-polls before it sleeps (trades a core for "
             "wake-up latency; 0: sleep at once)"),
    Variable("INSTRIDE_SERVE_SCHED", "serve_sched", _serve_sched, "batch",
             "(instride serve) scheduling policy of the data server's threads: batch (never "
             "preempt a busy core's thread), normal (may preempt, to serve at once) or inherit"),
    Variable("INSTRIDE_OVERWRITE", "overwrite", _flag, "0",
             "(preload library) let writes replace published keys"),
    Variable("INSTRIDE_PATCH_OPEN", "patch_open", _flag, "0",
             "1: route Python's open for managed paths through instride at start-up"),
    Variable("INSTRIDE_MPIEXEC", "mpiexec", _str_or_none, "the venv's, else PATH's",
             "(instride analyze) the mpiexec that launches MPI ranks"),
    Variable("INSTRIDE_CLUSTER_STATE_DIR", "cluster_state_dir", _state_dir, "/run/instride/clusters",
             "(instride cluster) directory of the emulated clusters' state files"),
    Variable("INSTRIDE_DEBUG", "debug", _flag, "0",
             "(C libraries) 1: one line on stderr per failure, naming the key and the cause"),
)

#: The names of all ``INSTRIDE_*`` variables, derived from :data:`VARIABLES`.
ENV_KEYS: tuple[str, ...] = tuple(v.name for v in VARIABLES)
_ENV_KEYS_B = tuple(os.fsencode(k) for k in ENV_KEYS)
_BY_NAME = {v.name: v for v in VARIABLES}


def read_variable(name: str, env: Mapping[str, str] | None = None) -> Any:
    """Parse one ``INSTRIDE_*`` variable as :meth:`Settings.from_env` would.

    Raises
    ------
    ConfigError
        The value cannot be used.
    KeyError
        ``name`` is not an instride variable.
    """
    env = os.environ if env is None else env
    var = _BY_NAME[name]
    return var.parse(var.name, env.get(var.name))


def env_snapshot() -> tuple[object, ...]:
    """The raw values of every ``INSTRIDE_*`` variable now (cheap: called on every open)."""
    data = getattr(os.environ, "_data", None)  # CPython: the bytes-keyed dict behind environ
    if isinstance(data, dict):
        return tuple(data.get(k) for k in _ENV_KEYS_B)
    return tuple(os.environ.get(k) for k in ENV_KEYS)


@dataclass(frozen=True)
class Settings:
    """Everything instride needs to know about this process's node and job.

    Build one with :meth:`from_env`; change a field with :meth:`with_`. Each field is filled
    by one variable of :data:`VARIABLES`.
    """

    dir: Path
    redis_url: str | None = None
    token: str | None = None
    timeout: float | None = None
    fsync: bool = True
    cache_bytes: int | None = None
    ahead_bytes: int = AHEAD_BYTES
    node: str = "localhost"
    addr: str = f"127.0.0.1:{DEFAULT_PORT}"
    socket_path: Path | None = None
    connect_timeout: float = 5.0
    transport: str = "tcp"
    spin: float = 0.0
    serve_sched: str = "batch"
    overwrite: bool = False
    patch_open: bool = False
    mpiexec: str | None = None
    cluster_state_dir: Path = Path("/run/instride/clusters")
    debug: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read the settings from ``env`` (default: ``os.environ``).

        Raises
        ------
        ConfigError
            A variable has a value that cannot be used (the error names it).
        """
        env = os.environ if env is None else env
        return cls(**{v.field: v.parse(v.name, env.get(v.name)) for v in VARIABLES})

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
