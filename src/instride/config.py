"""One settings object, read from ``INSTRIDE_*`` environment variables.

Every ``INSTRIDE_*`` variable the Python side reads is declared once, in :data:`VARIABLES`
(name, parser, default, meaning), and parsed only here: :meth:`Settings.from_env` reads them
all, :func:`read_variable` reads one (for start-up hooks that must not fail on unrelated
variables), and :data:`ENV_KEYS` lists them (the process-wide client is rebuilt when one of
them changes). The table of variables for users is the README's "Configuration" section; the
C library reads the same names with the same meanings.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from .errors import ConfigError, redact_url

DEFAULT_PORT = 7437
INTERNAL_DIRNAME = ".instride"

#: The whitespace stripped from both ends of every setting, by Python and by the C libraries
#: alike (csrc/core/config.c): ASCII space, tab, newline, carriage return, vertical tab and
#: form feed, never other (Unicode) spaces.
WHITESPACE = " \t\n\r\v\f"
#: The one grammar of a number in a setting, the C libraries' too: ASCII digits, an optional
#: sign, fraction and exponent; no ``_`` separators, no other digits, no hexadecimal.
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"[+-]?[0-9]+")
#: Longest duration (seconds) a server or transport option takes: its milliseconds must fit
#: the C engines' ``int``.
MAX_SECONDS = 2147483
#: INSTRIDE_CONNECT_TIMEOUT when unset or empty.
CONNECT_TIMEOUT = 5.0
#: Most seconds INSTRIDE_SPIN takes (each wait busy-polls that long before it sleeps).
MAX_SPIN = 1.0
#: Consume timeouts of at least this many seconds (~31 years) mean "forever", as in C.
FOREVER_SECONDS = 1e9


def strip(raw: str) -> str:
    """``raw`` without the :data:`WHITESPACE` at either end (what every setting is read as)."""
    return raw.strip(WHITESPACE)


def parse_number(raw: str, name: str, what: str = "not a number") -> float:
    """Parse a decimal number written as :data:`_NUMBER` allows (ASCII only, no ``_``).

    Raises
    ------
    ConfigError
        Anything else, ``what`` being the reason given.
    """
    text = strip(raw)
    if not _NUMBER.fullmatch(text):
        raise ConfigError(name, raw, what)
    return float(text)


def default_dir() -> Path:
    """Return the default managed directory: ``/dev/shm/instride-<uid>`` where ``/dev/shm`` is
    a writable directory, else ``${TMPDIR:-/tmp}/instride-<uid>`` — the C libraries' rule
    (csrc/core/config.c), so that a C program and a Python one look in one directory
    (:func:`tempfile.gettempdir` also reads ``TEMP`` and ``TMP`` and skips a directory it
    cannot write to: it took another one)."""
    uid = os.getuid()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return shm / f"instride-{uid}"
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"instride-{uid}"


def parse_seconds(raw: str | float, name: str, *, zero: bool = False,
                  limit: float = MAX_SECONDS) -> float:
    """Parse a finite duration in seconds, above 0 (or at least 0 with ``zero``), at most
    ``limit``.

    Parameters
    ----------
    raw
        Seconds as text (the grammar of every number in a setting) or a number.
    name
        The setting or option named in the error.
    zero
        Whether ``0`` is accepted.
    limit
        The largest value accepted (default :data:`MAX_SECONDS`, whose milliseconds fit a
        C ``int``).

    Returns
    -------
    float
        The seconds.

    Raises
    ------
    ConfigError
        Not a number, NaN, infinite, out of range.
    """
    value = parse_number(raw, name, "not a number of seconds") if isinstance(raw, str) else float(raw)
    low = ">= 0" if zero else "> 0"
    if math.isnan(value) or not (value >= 0 if zero else value > 0) or value > limit:
        raise ConfigError(name, raw, f"must be a number of seconds {low} and at most {limit}")
    return value


def parse_timeout(raw: str | float | None, name: str = "INSTRIDE_TIMEOUT") -> float | None:
    """Parse a consume timeout, the one meaning shared by ``INSTRIDE_TIMEOUT`` and ``--timeout``.

    Parameters
    ----------
    raw
        Seconds as text or a number. ``None``, empty, ``inf``, ``forever`` or ``none``: wait
        forever (returns ``None``), as does :data:`FOREVER_SECONDS` (~31 years) or more.
        ``0``: do not wait, fail at once unless published. Text is a number of the grammar
        every setting shares with the C libraries (ASCII digits, no ``_``), surrounded by
        :data:`WHITESPACE` at most.
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
        text = strip(raw)
        if text.isascii() and text.lower() in ("", "inf", "infinity", "forever", "none"):
            return None
        value = parse_number(raw, name, "not a number of seconds")
    else:
        value = float(raw)
    if math.isnan(value):
        raise ConfigError(name, raw, "not a number of seconds")
    if value < 0:
        raise ConfigError(name, raw, "must be >= 0 (0: do not wait; unset or inf: forever)")
    return None if value >= FOREVER_SECONDS else value


def _bool(name: str, raw: str | None, default: bool) -> bool:
    text = strip(raw or "")
    if text == "":
        return default
    low = text.lower() if text.isascii() else text
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ConfigError(name, raw, "expected 0/1/true/false (or yes/no, on/off)")


#: INSTRIDE_AHEAD_BYTES's default: the largest fetch whose next file is made ahead (see
#: instride.store.recvpool)
AHEAD_BYTES = 4 << 20


def _int_or_none(name: str, raw: str | None) -> int | None:
    text = strip(raw or "")
    if text == "":
        return None
    if not _INTEGER.fullmatch(text):
        raise ConfigError(name, raw, "not an integer")
    value = int(text)
    if value < 0:
        raise ConfigError(name, raw, "must be >= 0")
    return value


def _ahead_bytes(name: str, raw: str | None) -> int:
    value = _int_or_none(name, raw)
    return AHEAD_BYTES if value is None else value


def parse_addr(addr: str, name: str = "INSTRIDE_ADDR") -> tuple[str, int]:
    """Split ``host:port`` (an IPv6 address as ``[addr]:port``) into ``(host, port)``,
    raising :class:`ConfigError` when malformed."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host:
        raise ConfigError(name, addr, "expected host:port")
    bracketed = host.startswith("[") and host.endswith("]")
    inner = host[1:-1] if bracketed else host
    if "[" in inner or "]" in inner or not inner or (":" in inner and not bracketed):
        # (a bare IPv6 address: `::1` was host ":" port 1, silently)
        raise ConfigError(name, addr, "expected host:port (an IPv6 address as [addr]:port)")
    if not port.isascii() or not port.isdigit():
        raise ConfigError(name, addr, "port is not an integer")
    number = int(port)
    if not 0 < number < 65536:
        raise ConfigError(name, addr, "port out of range")
    return inner, number


def same_addr(a: str, b: str) -> bool | None:
    """Whether two ``host:port`` spellings name the same address: the same port, and hosts
    spelled alike (case aside) or resolving to a common IP address (``localhost`` and
    ``127.0.0.1``, a node's name and its address). ``None`` when that cannot be told: a host
    name that does not resolve (now; a failed lookup is tried again next time). A malformed
    one is another address.

    For decisions that must not take this node for another one because two of its processes
    spell ``INSTRIDE_ADDR`` differently (see ``ClusterEngine.forget_other_runs``). Two IP
    addresses are compared without a lookup; a host name is looked up once per process.
    """
    if a == b:
        return True
    try:
        (ha, pa), (hb, pb) = parse_addr(a), parse_addr(b)
    except ConfigError:
        return False
    if pa != pb:
        return False
    if ha.lower() == hb.lower():
        return True
    ips_a, ips_b = _resolved(ha), _resolved(hb)
    if not ips_a or not ips_b:
        return None
    return bool(ips_a & ips_b)


#: host names looked up (the IP addresses each resolves to; failures are not kept)
_RESOLVED: dict[str, frozenset[str]] = {}


def _resolved(host: str) -> frozenset[str]:
    """The IP addresses ``host`` names (none when it does not resolve)."""
    with contextlib.suppress(ValueError):
        return frozenset((str(ipaddress.ip_address(host)),))
    found = _RESOLVED.get(host)
    if found is None:
        try:
            found = frozenset(str(info[4][0]) for info in socket.getaddrinfo(
                host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError):
            return frozenset()
        if len(_RESOLVED) < 256:
            _RESOLVED[host] = found
    return found


def _dir(name: str, raw: str | None) -> Path:
    raw = strip(raw or "")
    directory = Path(raw) if raw else default_dir()
    if not directory.is_absolute():
        directory = Path.cwd() / directory
    text = os.path.normpath(directory)
    if text.startswith("//"):  # (normpath keeps exactly two; Linux reads them as one, and a
        text = "/" + text.lstrip("/")  # key's path is compared with this one as "/...")
    return Path(text)


def _str_or_none(name: str, raw: str | None) -> str | None:
    return strip(raw or "") or None


def parse_redis_url(url: str, name: str = "INSTRIDE_REDIS_URL", *, tcp: bool = False) -> str:
    """Return ``url`` if it names a Redis server, else raise (redis-py raised a bare
    ``ValueError`` at the first use of some, and read ``redis://host/abc`` as database 0).

    Parameters
    ----------
    url
        ``redis://[[user]:password@]host[:port][/db]`` (``rediss://``: TLS), or
        ``unix:///path/to/socket[?db=N]``.
    name
        The setting named in the error.
    tcp
        Refuse ``unix://`` (a Redis every node reaches over TCP).

    Returns
    -------
    str
        ``url``, unchanged.

    Raises
    ------
    ConfigError
        Another scheme, no host (no socket path), a port that is not a number from 1 to
        65535, or a database that is not a number. The password is not shown.
    """
    expected = ("expected redis://[:password@]host[:port][/db]" if tcp else
                "expected redis://[:password@]host[:port][/db] or unix:///socket[?db=N]")
    try:
        parts = urlsplit(url)
        port = parts.port
        query = dict(reversed(parse_qsl(parts.query)))  # (a name's first value, as redis-py)
    except ValueError as exc:
        # (not even split: what precedes the host and the query hidden -- a password may be
        # in either -- and the parser's words only where none can be in them: they quote the
        # part they could not read)
        scheme, sep, rest = url.partition("://")
        if not sep:
            scheme, rest = "", url
        host = rest.rpartition("@")[2].partition("?")[0]
        shown = (f"{scheme}{sep}" + ("***@" if "@" in rest else "") + host
                 + ("?***" if "?" in rest else ""))
        if "@" not in rest and "?" not in rest:
            raise ConfigError(name, shown, f"{exc}; {expected}") from None
        raise ConfigError(name, shown, "it cannot be read (a port that is not a number from "
                          "1 to 65535, or a password with '/', '?', '#', '[' or '@' not "
                          f"percent-encoded); {expected}") from None
    shown = redact_url(url)
    if parts.scheme == "unix" and not tcp:
        if not parts.path:
            raise ConfigError(name, shown, f"no socket path; {expected}")
        dbs = [query["db"]] if "db" in query else []
    elif parts.scheme in ("redis", "rediss"):
        if not parts.hostname:
            raise ConfigError(name, shown, f"no host; {expected}")
        if port == 0:
            raise ConfigError(name, shown, "port 0; expected a TCP port (1-65535)")
        # (as redis-py reads them: a db= of the query, its first, over the path's number
        # with its slashes dropped)
        path_db = unquote(parts.path).replace("/", "")
        dbs = [query["db"]] if "db" in query else [path_db] if path_db else []
    else:
        raise ConfigError(name, shown, expected + (" (every node connects to it over TCP)"
                                                   if tcp else ""))
    for db in dbs:
        try:
            ok = 0 <= int(db) <= 2**31 - 1
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(name, shown, f"the database {db!r} is not a database number "
                              f"(0 to 2147483647); {expected}")
    return url


def _redis_url(name: str, raw: str | None) -> str | None:
    url = strip(raw or "")
    return parse_redis_url(url, name) if url else None


def _token(name: str, raw: str | None) -> str | None:
    return raw or None  # taken as is: a token may hold any character


def _node(name: str, raw: str | None) -> str:
    return strip(raw or "") or socket.gethostname()


def _addr(name: str, raw: str | None) -> str:
    addr = strip(raw or "") or f"127.0.0.1:{DEFAULT_PORT}"
    parse_addr(addr, name)
    return addr


def _path_or_none(name: str, raw: str | None) -> Path | None:
    raw = strip(raw or "")
    return Path(raw) if raw else None


def _timeout(name: str, raw: str | None) -> float | None:
    return parse_timeout(raw, name)


def _connect_timeout(name: str, raw: str | None) -> float:
    # One meaning: a finite number of seconds above 0 (no "no limit": an unreachable peer or
    # Redis must fail, never hang); unset or empty: CONNECT_TIMEOUT.
    if strip(raw or "") == "":
        return CONNECT_TIMEOUT
    return parse_seconds(raw or "", name)


def _spin(name: str, raw: str | None) -> float:
    if strip(raw or "") == "":
        return 0.0
    value = parse_number(raw or "", name, "not a number of seconds")
    if not math.isfinite(value) or value < 0 or value > MAX_SPIN:
        # (every wait busy-polls this long first, whatever its own deadline: a value meant
        # in milliseconds made each wait on a stalled peer a full core's loop)
        raise ConfigError(name, raw, f"must be a number of seconds from 0 to {MAX_SPIN:g}")
    return value


def _record_batch(name: str, raw: str | None) -> int:
    if strip(raw or "") == "":
        return RECORD_BATCH
    value = parse_number(raw or "", name, "not a number of records")
    if not value.is_integer() or not 1 <= value <= 64:
        raise ConfigError(name, raw, "must be a whole number of records from 1 to 64")
    return int(value)


#: Records a stream's producer appending small frames flat out sends to Redis in one write, at
#: most (``INSTRIDE_RECORD_BATCH``; 1: each at once).
RECORD_BATCH = 8

#: Scheduling policies of the data server's threads (``instride serve --sched``).
SERVE_POLICIES = ("auto", "batch", "normal", "inherit")
#: Under the ``"auto"`` policy: milliseconds a fetch waits for its key before its thread waits
#: on under ``SCHED_OTHER`` (see :func:`instride.server.set_policy`).
SERVE_AUTO_PREEMPT_MS = 50


def _serve_sched(name: str, raw: str | None) -> str:
    value = strip(raw or "").lower() or "auto"
    if value not in SERVE_POLICIES:
        raise ConfigError(name, raw, f"expected one of {', '.join(SERVE_POLICIES)}")
    return value


def _state_dir(name: str, raw: str | None) -> Path:
    text = strip(raw or "")
    directory = Path(text) if text else Path("/run/instride/clusters")
    # absolute from the start: `cluster down` run from another directory finds the same files
    return Path(os.path.normpath(Path.cwd() / directory))


def _flag(name: str, raw: str | None) -> bool:
    return _bool(name, raw, False)


def _fsync(name: str, raw: str | None) -> bool:
    return _bool(name, raw, True)


def _name(name: str, raw: str | None) -> str:
    value = strip(raw or "").lower() or "tcp"
    if not value.isascii() or not value.replace("_", "").replace("-", "").isalnum():
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
    Variable("INSTRIDE_DIR", "dir", _dir,
             "/dev/shm/instride-<uid> (${TMPDIR:-/tmp}/instride-<uid> if /dev/shm is unusable)",
             "the managed directory of this node"),
    Variable("INSTRIDE_REDIS_URL", "redis_url", _redis_url, "unset",
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
             "seconds to reach a peer or Redis: a number above 0 and at most 2147483 (0, "
             "negative, inf: refused)"),
    Variable("INSTRIDE_TRANSPORT", "transport", _name, "tcp",
             "transport the cluster engine fetches with and the data server serves: tcp or ucx"),
    Variable("INSTRIDE_SPIN", "spin", _spin, "0",
             "seconds a waiting consumer busy-polls before it sleeps (trades a core for "
             "wake-up latency; 0: sleep at once)"),
    Variable("INSTRIDE_RECORD_BATCH", "record_batch", _record_batch, str(RECORD_BATCH),
             "records of frames a stream's producer appending small frames flat out sends to "
             "Redis in one write, at most (1: each at once; at most 64)"),
    Variable("INSTRIDE_SERVE_SCHED", "serve_sched", _serve_sched, "auto",
             "(instride serve) scheduling policy of the data server's threads: auto (batch, "
             "but a fetch that waited over 50 ms for its frame may preempt), batch (never "
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
    # (neither shown by repr: a traceback's locals, a debugger, a logged object)
    redis_url: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
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
    record_batch: int = RECORD_BATCH
    serve_sched: str = "auto"
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

    def __repr__(self) -> str:
        shown = ", ".join(f"{f}={getattr(self, f)!r}" for f in self.__dataclass_fields__
                          if self.__dataclass_fields__[f].repr)
        redis = "None" if self.redis_url is None else repr(redact_url(self.redis_url))
        token = "None" if self.token is None else "'***'"
        return f"Settings({shown}, redis_url={redis}, token={token})"

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
