"""Backends plug in by name; unknown names and taken names are clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from instride import metadata, transport
from instride.config import Settings
from instride.errors import ConfigError
from instride.metadata.files import FileMetadata


def test_lookup_by_name(tmp_path: Path) -> None:
    assert isinstance(metadata.get_backend("files", Settings(dir=tmp_path)), FileMetadata)
    assert type(transport.get_transport("tcp", Settings(dir=tmp_path))).__name__ == "TcpTransport"


def test_unknown_and_duplicate_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="unknown; known"):
        metadata.get_backend("etcd", Settings(dir=tmp_path))
    with pytest.raises(ValueError, match="already registered"):
        transport.register("tcp", "x:Y")
    monkeypatch.setitem(transport.REGISTRY, "ucx", ("instride_ucx_missing:Ucx", "pip install ucxx"))
    with pytest.raises(ConfigError, match="pip install ucxx"):
        transport.get_transport("ucx", Settings(dir=tmp_path))


def test_a_target_naming_no_class_is_a_config_error(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend registered as ``module:Class`` whose module imports but has no such class
    (a typo, a plugin renamed it; or no ``:Class`` at all) raised an untyped AttributeError
    at first use, naming neither the backend nor its install hint."""
    monkeypatch.setitem(transport.REGISTRY, "ucx", ("instride.frames:NoSuchTransport",
                                                    "pip install ucxx"))
    with pytest.raises(ConfigError, match="NoSuchTransport.*pip install ucxx"):
        transport.get_transport("ucx", Settings(dir=tmp_path))
    monkeypatch.setitem(transport.REGISTRY, "ucx", ("instride.frames", "pip install ucxx"))
    with pytest.raises(ConfigError, match="ucx"):
        transport.get_transport("ucx", Settings(dir=tmp_path))
