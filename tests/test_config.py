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


@pytest.mark.parametrize(
    ("name", "value"),
    [("INSTRIDE_TIMEOUT", "x"), ("INSTRIDE_FSYNC", "maybe"), ("INSTRIDE_CACHE_BYTES", "-1"),
     ("INSTRIDE_AHEAD_BYTES", "-1"), ("INSTRIDE_AHEAD_BYTES", "4M"),
     ("INSTRIDE_ADDR", "nohost"), ("INSTRIDE_ADDR", "h:99999"), ("INSTRIDE_SPIN", "-0.1"),
     ("INSTRIDE_SPIN", "nan"), ("INSTRIDE_SPIN", "inf"), ("INSTRIDE_SPIN", "soon")],
)
def test_bad_values(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.from_env({name: value})


def test_parse_addr() -> None:
    assert parse_addr("[::1]:80") == ("::1", 80)


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
    assert Settings.from_env({}).serve_sched == "batch"
    assert Settings.from_env({"INSTRIDE_SERVE_SCHED": " Normal "}).serve_sched == "normal"
    assert Settings.from_env({"INSTRIDE_SERVE_SCHED": "inherit"}).serve_sched == "inherit"
    with pytest.raises(ConfigError, match="INSTRIDE_SERVE_SCHED"):
        Settings.from_env({"INSTRIDE_SERVE_SCHED": "fifo"})
