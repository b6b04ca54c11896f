"""Settings from INSTRIDE_* variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from instride.config import Settings, default_dir, parse_addr
from instride.errors import ConfigError


def test_defaults() -> None:
    s = Settings.from_env({})
    assert s.dir == default_dir()
    assert s.mode == "local"
    assert s.timeout is None and s.fsync is True and s.cache_bytes is None
    assert s.socket == s.dir / ".instride" / "node.sock"
    assert str(default_dir()).startswith(("/dev/shm/instride-", "/tmp/instride-"))


def test_all_variables() -> None:
    s = Settings.from_env({
        "INSTRIDE_DIR": "/x/y/../z", "INSTRIDE_REDIS_URL": "redis://h:1/0", "INSTRIDE_TOKEN": "t",
        "INSTRIDE_TIMEOUT": "2.5", "INSTRIDE_FSYNC": "0", "INSTRIDE_CACHE_BYTES": "1000",
        "INSTRIDE_NODE": "n7", "INSTRIDE_ADDR": "10.0.0.7:9000", "INSTRIDE_SOCKET": "/s.sock",
        "INSTRIDE_AHEAD_BYTES": "67108864",
    })
    assert s.ahead_bytes == 64 << 20 and Settings.from_env({}).ahead_bytes == 4 << 20
    assert s.dir == Path("/x/z") and s.mode == "cluster" and s.token == "t"
    assert (s.timeout, s.fsync, s.cache_bytes, s.node) == (2.5, False, 1000, "n7")
    assert s.addr == "10.0.0.7:9000" and s.socket == Path("/s.sock")
    assert Settings.from_env({"INSTRIDE_TIMEOUT": "0"}).timeout == 0.0  # do not wait
    assert Settings.from_env({}).spin == 0.0 and Settings.from_env({"INSTRIDE_SPIN": ""}).spin == 0.0
    assert Settings.from_env({"INSTRIDE_SPIN": "0.002"}).spin == 0.002
    assert Settings.from_env({}).record_batch == 8
    assert Settings.from_env({"INSTRIDE_RECORD_BATCH": " 1 "}).record_batch == 1
    assert Settings.from_env({"INSTRIDE_RECORD_BATCH": "64"}).record_batch == 64


@pytest.mark.parametrize(
    ("name", "value"),
    [("INSTRIDE_TIMEOUT", "x"), ("INSTRIDE_FSYNC", "maybe"), ("INSTRIDE_CACHE_BYTES", "-1"),
     ("INSTRIDE_AHEAD_BYTES", "-1"), ("INSTRIDE_AHEAD_BYTES", "4M"),
     ("INSTRIDE_ADDR", "nohost"), ("INSTRIDE_ADDR", "h:99999"), ("INSTRIDE_SPIN", "-0.1"),
     ("INSTRIDE_SPIN", "nan"), ("INSTRIDE_SPIN", "inf"), ("INSTRIDE_SPIN", "soon"),
     ("INSTRIDE_RECORD_BATCH", "0"), ("INSTRIDE_RECORD_BATCH", "65"),
     ("INSTRIDE_RECORD_BATCH", "2.5"), ("INSTRIDE_RECORD_BATCH", "1e400"),
     ("INSTRIDE_RECORD_BATCH", "eight")],
)
def test_bad_values(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: value})


def test_parse_addr() -> None:
    assert parse_addr("[::1]:80") == ("::1", 80)
    assert parse_addr("node-3:7437") == ("node-3", 7437)
    # a bare IPv6 address was misread (`::1`: host ":" port 1) and unbalanced brackets passed
    for bad in ("::1", "fe80::1", "[::1", "::1]:80", "[]:80", "[a]b]:80"):
        with pytest.raises(ConfigError, match=r"\[addr\]:port"):
            parse_addr(bad)


def test_spin_is_bounded() -> None:
    """An INSTRIDE_SPIN meant in milliseconds (`50`) made every wait on a stalled peer a
    full core's loop of that many seconds."""
    assert Settings.from_env({"INSTRIDE_SPIN": "1"}).spin == 1.0
    with pytest.raises(ConfigError, match="INSTRIDE_SPIN"):
        Settings.from_env({"INSTRIDE_SPIN": "50"})


def test_settings_repr_shows_no_secret() -> None:
    """The dataclass's repr showed the job token and the Redis password (a traceback's locals,
    a debugger, a logged object)."""
    s = Settings.from_env({"INSTRIDE_DIR": "/tmp/x", "INSTRIDE_TOKEN": "s3cret",
                           "INSTRIDE_REDIS_URL": "redis://:pw@h:1/0"})
    text = repr(s)
    assert "s3cret" not in text and ":pw@" not in text
    assert "redis://***@h:1/0" in text and "token='***'" in text and "dir=" in text


def test_timeout_meaning_zero_no_wait_inf_forever_negative_refused() -> None:
    for raw in ("inf", "", "  ", "forever"):
        assert Settings.from_env({"INSTRIDE_TIMEOUT": raw}).timeout is None
    assert Settings.from_env({"INSTRIDE_TIMEOUT": "0"}).timeout == 0.0
    for raw in ("nan", "-1", "-0.5", "-inf"):
        with pytest.raises(ConfigError, match="INSTRIDE_TIMEOUT"):
            Settings.from_env({"INSTRIDE_TIMEOUT": raw})


def test_every_variable_fills_one_field_and_is_documented_once() -> None:
    import dataclasses
    import re

    from instride.config import ENV_KEYS, VARIABLES

    assert [v.field for v in VARIABLES] == [f.name for f in dataclasses.fields(Settings)]
    assert tuple(v.name for v in VARIABLES) == ENV_KEYS and len(set(ENV_KEYS)) == len(ENV_KEYS)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = re.findall(r"^\| `(INSTRIDE_\w+)` \|", readme, re.M)
    assert set(ENV_KEYS) <= set(table), set(ENV_KEYS) - set(table)
    assert len(table) == len(set(table)), "each variable in one row"


def test_flags_and_transport_are_parsed_in_settings() -> None:
    from instride.config import read_variable

    s = Settings.from_env({"INSTRIDE_OVERWRITE": "yes", "INSTRIDE_PATCH_OPEN": "On",
                           "INSTRIDE_TRANSPORT": "ucx"})
    assert (s.overwrite, s.patch_open, s.transport) == (True, True, "ucx")
    d = Settings.from_env({})
    assert (d.overwrite, d.patch_open, d.transport) == (False, False, "tcp")
    assert read_variable("INSTRIDE_PATCH_OPEN", {"INSTRIDE_PATCH_OPEN": "1"}) is True
    assert read_variable("INSTRIDE_PATCH_OPEN", {}) is False
    with pytest.raises(ConfigError, match="INSTRIDE_OVERWRITE"):
        Settings.from_env({"INSTRIDE_OVERWRITE": "maybe"})
    with pytest.raises(ConfigError, match="INSTRIDE_TRANSPORT"):
        Settings.from_env({"INSTRIDE_TRANSPORT": "a b"})


def test_the_data_servers_scheduling_policy() -> None:
    assert Settings.from_env({}).serve_sched == "auto"
    assert Settings.from_env({"INSTRIDE_SERVE_SCHED": "batch"}).serve_sched == "batch"
    assert Settings.from_env({"INSTRIDE_SERVE_SCHED": " Normal "}).serve_sched == "normal"
    assert Settings.from_env({"INSTRIDE_SERVE_SCHED": "inherit"}).serve_sched == "inherit"
    with pytest.raises(ConfigError, match="INSTRIDE_SERVE_SCHED"):
        Settings.from_env({"INSTRIDE_SERVE_SCHED": "fifo"})


def test_connect_timeout_one_meaning() -> None:
    """A finite number of seconds above 0 (at most 2147483); unset or empty: 5; else refused."""
    assert Settings.from_env({}).connect_timeout == 5.0
    assert Settings.from_env({"INSTRIDE_CONNECT_TIMEOUT": " "}).connect_timeout == 5.0
    assert Settings.from_env({"INSTRIDE_CONNECT_TIMEOUT": "0.25"}).connect_timeout == 0.25
    for raw in ("0", "-3", "inf", "nan", "soon", "1_0", "2147484"):
        with pytest.raises(ConfigError, match="INSTRIDE_CONNECT_TIMEOUT"):
            Settings.from_env({"INSTRIDE_CONNECT_TIMEOUT": raw})


def test_numbers_are_ascii_decimal_without_separators() -> None:
    for name in ("INSTRIDE_CACHE_BYTES", "INSTRIDE_AHEAD_BYTES", "INSTRIDE_SPIN",
                 "INSTRIDE_RECORD_BATCH"):
        for raw in ("1_0", "\uff11", "\u0661", "0x10"):
            with pytest.raises(ConfigError, match=name):
                Settings.from_env({name: raw})
    with pytest.raises(ConfigError, match="INSTRIDE_ADDR"):
        Settings.from_env({"INSTRIDE_ADDR": "h:\uff17\uff10"})
    assert Settings.from_env({"INSTRIDE_CACHE_BYTES": " 12\r\n"}).cache_bytes == 12


def test_relative_cluster_state_dir_is_made_absolute(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = Settings.from_env({"INSTRIDE_CLUSTER_STATE_DIR": "states/../st"})
    assert s.cluster_state_dir == tmp_path / "st"
    assert Settings.from_env({}).cluster_state_dir == Path("/run/instride/clusters")


# ---------------------------------------------------------------------- Python and C alike
#: (variable, raw value, what it means: a Settings field value, or REFUSED)
REFUSED = object()
FOREVER = None
SAME_MEANING = [
    ("INSTRIDE_TIMEOUT", "2.5", 2.5),
    ("INSTRIDE_TIMEOUT", " 2.5\r\n", 2.5),
    ("INSTRIDE_TIMEOUT", "5\r", 5.0),
    ("INSTRIDE_TIMEOUT", "\v.5\f", 0.5),
    ("INSTRIDE_TIMEOUT", "+3e1", 30.0),
    ("INSTRIDE_TIMEOUT", "0", 0.0),
    ("INSTRIDE_TIMEOUT", " ", FOREVER),
    ("INSTRIDE_TIMEOUT", "Infinity", FOREVER),
    ("INSTRIDE_TIMEOUT", "1e10", FOREVER),
    ("INSTRIDE_TIMEOUT", "1_0", REFUSED),
    ("INSTRIDE_TIMEOUT", "\uff11", REFUSED),  # a full-width digit
    ("INSTRIDE_TIMEOUT", "\u00a05", REFUSED),  # a no-break space is not stripped
    ("INSTRIDE_TIMEOUT", "0x10", REFUSED),
    ("INSTRIDE_TIMEOUT", "nan", REFUSED),
    ("INSTRIDE_TIMEOUT", "-1", REFUSED),
    ("INSTRIDE_TIMEOUT", "2,5", REFUSED),
    ("INSTRIDE_TIMEOUT", "1e", REFUSED),
    ("INSTRIDE_OVERWRITE", " 1", True),
    ("INSTRIDE_OVERWRITE", "YES\n", True),
    ("INSTRIDE_OVERWRITE", "off\t", False),
    ("INSTRIDE_OVERWRITE", "", False),
    ("INSTRIDE_OVERWRITE", "2", REFUSED),
    ("INSTRIDE_OVERWRITE", "ja", REFUSED),
    ("INSTRIDE_FSYNC", "On", True),
    ("INSTRIDE_FSYNC", "maybe", REFUSED),
    ("INSTRIDE_DEBUG", " true ", True),
    ("INSTRIDE_DEBUG", "2", REFUSED),
    ("INSTRIDE_REDIS_URL", "  ", "local"),
    ("INSTRIDE_REDIS_URL", " redis://h:1/0 ", "cluster"),
    ("INSTRIDE_DIR", " {tmp}/d/ \t", "{tmp}/d"),
    ("INSTRIDE_SOCKET", " /s.sock\n", "/s.sock"),
]

#: a C program's settings, as the C library reads them (``s``), in the probes below
_C_SETTINGS = r"""
class S(ctypes.Structure):
    _fields_ = [("dir", ctypes.c_char_p), ("socket_path", ctypes.c_char_p),
                ("timeout", ctypes.c_double), ("fsync", ctypes.c_int),
                ("overwrite", ctypes.c_int), ("cluster", ctypes.c_int), ("debug", ctypes.c_int)]

s = S()
assert lib.instride_settings(ctypes.byref(s)) == 0
"""

_C_PROBE = r"""
import ctypes, json, os, sys
import instride
libc = ctypes.CDLL(None)
libc.setlocale.restype = ctypes.c_char_p
if os.environ.get("PROBE_LOCALE"):
    assert libc.setlocale(6, os.environ["PROBE_LOCALE"].encode()) is not None  # LC_ALL
lib = ctypes.CDLL(os.path.join(os.path.dirname(instride.__file__), "libinstride.so"))
lib.instride_last_error.restype = ctypes.c_char_p

""" + _C_SETTINGS + r"""w = ctypes.c_void_p()
key = os.path.join(os.environ["PROBE_KEYS"], "k")
err = lib.instride_create(key.encode(), 0, 0o644, ctypes.byref(w))
if err == 0:
    lib.instride_abort(w)
message = lib.instride_last_error().decode()
consumed = None
if err:  # refused: a consume fails at once, naming the setting
    consumed = lib.instride_consume(key.encode(), ctypes.create_string_buffer(4096), 4096)
print(json.dumps({"dir": s.dir.decode(), "socket": s.socket_path.decode(), "timeout": s.timeout,
                  "fsync": s.fsync, "overwrite": s.overwrite, "cluster": s.cluster,
                  "debug": s.debug, "create": err, "consume": consumed, "message": message}))
"""


def _c_reads(name: str, raw: str, tmp_path: Path, keys: Path | None = None,
             **extra: str) -> dict[str, object]:
    """What the C libraries make of ``name=raw`` (in a process of its own: read once)."""
    import json
    import os
    import subprocess
    import sys

    keys = keys or tmp_path / "managed"
    keys.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("INSTRIDE_")}
    env.update(INSTRIDE_DIR=str(keys), INSTRIDE_TIMEOUT="0", PROBE_KEYS=str(keys), **extra)
    env[name] = raw
    proc = subprocess.run([sys.executable, "-c", _C_PROBE], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize(("name", "raw", "meaning"), SAME_MEANING)
def test_python_and_c_read_every_setting_alike(name: str, raw: str, meaning: object,
                                               tmp_path: Path) -> None:
    import errno

    raw = raw.replace("{tmp}", str(tmp_path))
    if isinstance(meaning, str):
        meaning = meaning.replace("{tmp}", str(tmp_path))
    keys = Path(meaning) if name == "INSTRIDE_DIR" else None
    c = _c_reads(name, raw, tmp_path, keys)
    if meaning is REFUSED:
        with pytest.raises(ConfigError, match=name):
            Settings.from_env({name: raw})
        assert c["create"] == errno.EINVAL and c["consume"] == errno.EINVAL
        assert name in c["message"], c
        return
    s = Settings.from_env({name: raw})
    assert c["create"] == 0, c
    if name == "INSTRIDE_TIMEOUT":
        assert s.timeout == meaning and c["timeout"] == (-1.0 if meaning is FOREVER else meaning)
    elif name == "INSTRIDE_REDIS_URL":
        assert s.mode == meaning and c["cluster"] == (meaning == "cluster")
    elif name == "INSTRIDE_DIR":
        assert str(s.dir) == meaning and c["dir"] == meaning
    elif name == "INSTRIDE_SOCKET":
        assert str(s.socket) == meaning and c["socket"] == meaning
    else:
        field = {"INSTRIDE_OVERWRITE": "overwrite", "INSTRIDE_FSYNC": "fsync",
                 "INSTRIDE_DEBUG": "debug"}[name]
        assert getattr(s, field) is meaning and c[field] == int(bool(meaning))


def test_c_reads_numbers_in_any_locale(tmp_path: Path) -> None:
    """A program in a decimal-comma locale still reads INSTRIDE_TIMEOUT=2.5 (and refuses 2,5)."""
    import shutil
    import subprocess

    localedef = shutil.which("localedef")
    assert localedef is not None, "localedef (libc-bin) is needed to make a de_DE locale"
    locales = tmp_path / "locales"
    locales.mkdir()
    made = subprocess.run([localedef, "-i", "de_DE", "-f", "UTF-8", str(locales / "de_DE.UTF-8")],
                          capture_output=True, text=True, timeout=120)
    assert (locales / "de_DE.UTF-8").is_dir(), made.stderr
    german = {"LOCPATH": str(locales), "PROBE_LOCALE": "de_DE.UTF-8"}
    assert _c_reads("INSTRIDE_TIMEOUT", "2.5", tmp_path, **german)["timeout"] == 2.5
    assert _c_reads("INSTRIDE_TIMEOUT", "2,5", tmp_path, **german)["create"] != 0


@pytest.mark.parametrize(("a", "b", "same"), [
    ("127.0.0.1:7000", "127.0.0.1:7000", True),
    ("127.0.0.1:7000", "127.0.0.1:07000", True),  # (the port's spelling)
    ("localhost:7000", "127.0.0.1:7000", True),  # (a name and its address)
    ("LocalHost:7000", "localhost:7000", True),
    ("127.0.0.1:7000", "127.0.0.1:7001", False),
    ("127.0.0.1:7000", "127.0.0.2:7000", False),
    ("no-such-host.invalid:7000", "no-such-host.invalid:7000", True),
    ("no-such-host.invalid:7000", "127.0.0.1:7000", None),  # (cannot be told)
    ("not an address", "127.0.0.1:7000", False),
])
def test_same_addr_tells_spellings_of_one_address_from_other_addresses(
    a: str, b: str, same: bool | None,
) -> None:
    from instride.config import same_addr

    assert same_addr(a, b) is same and same_addr(b, a) is same


def test_a_child_whose_parent_died_before_it_asked_signals_itself() -> None:
    """The parent dying between the fork and the child's PR_SET_PDEATHSIG: no signal ever
    came, and the child (an mpiexec, a worker) ran on as an orphan."""
    import signal
    import subprocess
    import sys

    code = ("import os, signal; from instride.orphans import die_with_parent; "
            "die_with_parent(signal.SIGTERM, os.getppid() + 1_000_000); print('ran on')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGTERM and "ran on" not in res.stdout
    code = code.replace(" + 1_000_000", "")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "ran on" in res.stdout


_DEFAULT_DIR_PROBE = r"""
import ctypes, json, os
import instride
from instride.config import Settings
lib = ctypes.CDLL(os.path.join(os.path.dirname(instride.__file__), "libinstride.so"))

""" + _C_SETTINGS + r"""print(json.dumps({"python": str(Settings.from_env().dir), "c": s.dir.decode()}))
"""


@pytest.mark.parametrize("tmpdirs", [
    {"TMP": "{tmp}/tmp"},  # (TMPDIR unset: C takes /tmp; Python took $TMP)
    {"TMPDIR": "{tmp}/missing"},  # (Python skipped a TMPDIR it could not write to)
    {"TMPDIR": "{tmp}/tmp"},
])
def test_python_and_c_take_one_default_dir_where_dev_shm_is_unusable(
        tmpdirs: dict[str, str], tmp_path: Path) -> None:
    """Without INSTRIDE_DIR and with /dev/shm unusable (read-only here), Python took
    ``tempfile.gettempdir()`` — $TMPDIR, $TEMP or $TMP, the first it could write to — and the
    C libraries ``${TMPDIR:-/tmp}``, as docs/preload.md says both do: a producer and a
    consumer of one node looked in two directories, the consumer waiting for good."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    unshare = shutil.which("unshare")
    # (the suite runs as root; util-linux's unshare is on every Debian machine)
    assert unshare is not None and os.geteuid() == 0, \
        "needs root and unshare(1) (util-linux) to hide /dev/shm in a mount namespace"
    (tmp_path / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("INSTRIDE_") and k not in ("TMPDIR", "TEMP", "TMP")}
    env.update({k: v.replace("{tmp}", str(tmp_path)) for k, v in tmpdirs.items()})
    proc = subprocess.run(
        [unshare, "-m", "sh", "-c", 'mount -t tmpfs -o ro tmpfs /dev/shm && exec "$@"', "sh",
         sys.executable, "-c", _DEFAULT_DIR_PROBE], env=env, capture_output=True, text=True,
        timeout=60)
    assert proc.returncode == 0, f"unshare -m and the probe under it: {proc.stderr}"
    got = json.loads(proc.stdout.splitlines()[-1])
    base = env.get("TMPDIR") or "/tmp"
    assert got == {"python": f"{base}/instride-{os.getuid()}",
                   "c": f"{base}/instride-{os.getuid()}"}


@pytest.mark.parametrize("url, why", [
    ("redis://127.0.0.1:99999/0", "Port out of range"),
    ("http://127.0.0.1:6379/0", "expected redis://"),
    ("redis://h:6379/abc", "the database 'abc' is not a database number"),
    ("redis://:s3cret@h:6379/x1", "the database 'x1' is not a database number"),
    ("redis://:s3cr/et@h:6379/0", "it cannot be read"),
    ("redis://:p[w@h:6379/0", "it cannot be read"),
    ("redis://h/1?db=x", "the database 'x' is not a database number"),
    ("redis://h/0?db=x&db=1", "the database 'x' is not a database number"),
    ("redis://h/-1", "the database '-1' is not a database number"),
    ("redis://h:99999/0?password=s3cret", "it cannot be read"),
    ("//:s3cret@h:99999/0", "it cannot be read"),
    ("redis://:6379/0", "no host"),
    ("redis://h:0/0", "port 0"),
    ("unix://", "no socket path"),
    ("unix:///tmp/r.sock?db=one", "the database 'one' is not a database number"),
])
def test_a_redis_url_that_cannot_be_used_is_refused(url: str, why: str) -> None:
    """``INSTRIDE_REDIS_URL`` went to redis-py unchecked: a port out of range or another
    scheme was a bare ``ValueError`` at the first use, and ``redis://host/abc`` was read as
    database 0 (another job's, say) without a word. Refused now, as ``instride job`` refused
    them, the password not shown."""
    with pytest.raises(ConfigError, match="bad setting INSTRIDE_REDIS_URL") as info:
        Settings.from_env({"INSTRIDE_REDIS_URL": url})
    assert why in str(info.value)
    assert not any(secret in str(info.value) for secret in ("s3cret", "s3cr", "p[w"))


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://:pw@h/2", "redis://h",
                                 "redis://h:1?db=3", "unix:///tmp/r.sock",
                                 "unix:///tmp/r.sock?db=1", "redis://h/0/", "redis://[::1]:6379/2",
                                 "redis://u:p@h:1/3?socket_timeout=5",
                                 "redis://h/x?db=1"])
def test_a_usable_redis_url_is_taken_as_it_is(url: str) -> None:
    assert Settings.from_env({"INSTRIDE_REDIS_URL": url}).redis_url == url

