"""Key validation: every bad key raises KeyValidationError and nothing is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import instride
from instride.errors import KeyValidationError
from instride.keys import MAX_COMPONENT_BYTES, MAX_KEY_BYTES, TMP_PATTERN, normalize_key, tmp_name, tmp_path

ROOT = Path("/managed/root")


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize(
    ("key", "reason"),
    [
        ("../escape", "'..'"),
        ("a/../../escape", "'..'"),
        ("/etc/passwd", "outside the managed directory"),
        ("", "empty"),
        ("   ", "empty"),
        ("/", "outside"),
        ("a\x00b", "NUL"),
        ("line\nbreak", "control character"),
        ("x" * (MAX_COMPONENT_BYTES + 1), "component longer"),
        ("/".join(["d" * 100] * 11), "longer than"),
        (".instride/node.sock", "reserved"),
        ("run/.frame.instride-12-abcdef.tmp", "temporary"),
        (42, "expected str"),
    ],
)
def test_bad_keys_raise_and_write_nothing(managed_dir: Path, key: object, reason: str) -> None:
    before = _tree(managed_dir)
    with pytest.raises(KeyValidationError, match=reason) as info:
        with instride.open(key, "wb") as fh:  # type: ignore[arg-type]
            fh.write(b"must not land anywhere")
    assert isinstance(info.value, ValueError)
    assert _tree(managed_dir) == before
    with pytest.raises(KeyValidationError):
        instride.consume(key, timeout=0.01)  # type: ignore[arg-type]
    with pytest.raises(KeyValidationError):
        instride.consume_bytes(key, timeout=0.01)  # type: ignore[arg-type]
    assert _tree(managed_dir) == before


def test_absolute_path_under_root_is_its_key(managed_dir: Path) -> None:
    assert normalize_key(str(managed_dir / "a" / "b.dat"), managed_dir) == "a/b.dat"
    with pytest.raises(KeyValidationError):
        normalize_key(str(managed_dir) + "-sibling/x", managed_dir)
    with pytest.raises(KeyValidationError):
        normalize_key(str(managed_dir), managed_dir)


def test_normalization() -> None:
    assert normalize_key("a//b/./c", ROOT) == "a/b/c"
    assert normalize_key(b"a/b", ROOT) == "a/b"
    assert normalize_key(Path("a/b"), ROOT) == "a/b"


def test_tmp_path_is_hidden_same_dir_and_reserved() -> None:
    final = ROOT / "x" / ("n" * MAX_COMPONENT_BYTES)
    tmp = tmp_path(final)
    assert tmp.parent == final.parent
    assert tmp.name.startswith(".")
    assert TMP_PATTERN.match(tmp.name)
    assert len(tmp.name.encode()) <= 255  # fits NAME_MAX even for the longest component


_component = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
    min_size=1, max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_component, st.just(".."), st.just("."), st.just("")), max_size=6))
def test_property_valid_keys_stay_inside(parts: list[str]) -> None:
    raw = "/".join(parts)
    try:
        key = normalize_key(raw, ROOT)
    except KeyValidationError:
        return
    # Anything accepted maps strictly inside the root, with no traversal left.
    full = os.path.normpath(ROOT / key)
    assert full.startswith(str(ROOT) + "/")
    assert ".." not in key.split("/")
    assert "\x00" not in key
    assert len(key.encode()) <= MAX_KEY_BYTES
    assert normalize_key(key, ROOT) == key  # idempotent


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=60))
def test_property_never_escapes(raw: str) -> None:
    try:
        key = normalize_key(raw, ROOT)
    except KeyValidationError:
        return
    assert os.path.normpath(ROOT / key).startswith(str(ROOT) + "/")


def test_a_temporary_name_carries_the_process_id_also_in_a_forked_child() -> None:
    """Temporary names carry the id of the process that writes them (``instride gc`` leaves
    those of live writers): the id is kept, not asked for each time, and a child made by
    ``fork`` gets its own."""
    assert f".instride-{os.getpid()}-" in tmp_name("/a/b")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: its name and its id, to the parent)
        os.close(r)
        os.write(w, f"{tmp_name('/a/b')} {os.getpid()}".encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        name, child = fh.read().split()
    assert os.waitpid(pid, 0)[1] == 0
    assert f".instride-{child}-" in name and child != str(os.getpid())
    assert TMP_PATTERN.match(os.path.basename(name))


def test_an_absolute_path_with_a_leading_double_slash_is_its_key(managed_dir: Path) -> None:
    """``//dir/k`` names ``/dir/k`` on Linux (code such as ``"/" + path`` makes it):
    ``os.path.normpath`` keeps the two slashes, and the key was refused as "outside the
    managed directory" (the preload library takes it for the key)."""
    assert normalize_key("/" + str(managed_dir / "a" / "b.dat"), managed_dir) == "a/b.dat"
    assert normalize_key("//" + str(managed_dir / "a"), managed_dir) == "a"  # (three: too)
    with pytest.raises(KeyValidationError, match="outside"):
        normalize_key("/" + str(managed_dir) + "-sibling/x", managed_dir)


def test_a_managed_directory_named_with_two_leading_slashes_takes_its_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``INSTRIDE_DIR=//tmp/.../m`` (two slashes: Linux reads one): the managed directory kept
    them (``normpath`` does), and once paths were folded to one slash every key's path was
    refused as "outside the managed directory"."""
    from instride.client import Client
    from instride.config import Settings

    monkeypatch.setenv("INSTRIDE_DIR", "/" + str(tmp_path / "m"))
    client = Client(Settings.from_env())
    try:
        assert str(client.root) == str(tmp_path / "m")
        with client.open("/" + str(tmp_path / "m" / "a.txt"), "wb") as fh:
            fh.write(b"x")
        assert client.key(str(tmp_path / "m" / "a.txt")) == "a.txt"
    finally:
        client.close()
