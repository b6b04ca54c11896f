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


#: Names at the edge of instride's own (``INTERNAL_DIRNAME`` components, ``TMP_PATTERN``
#: temporary files), each with whether Python takes it for a key.
_EDGE_NAMES = {
    "run/.frame.instride-12-abcdef.tmp": False,  # a temporary file's name
    "run/.a.b.instride-3-0f.tmp": False,
    "run/.a.instride-1-2.instride-3-f.tmp": False,  # (".instride-" in the name itself)
    ".instride/node.sock": False,
    "a/.instride-1-a.tmp": False,  # (a component starting ".instride")
    "a/.instridex/k": False,
    "run/.notes.instride-draft.tmp": True,  # looks like one, but no <pid>-<hex>
    "run/.a.instride-x-1.tmp": True,  # the pid not digits
    "run/.a.instride-1-ABC.tmp": True,  # the hex not lowercase
    "run/.a.instride-1-az.tmp": True,  # not hex
    "run/.a.instride-1-a-b.tmp": True,
    "run/.a.instride-1-.tmp": True,  # no hex
    "run/.a.instride--a.tmp": True,  # no pid
    "run/.a.instride-1234.tmp": True,
    "run/.a.instride-\u0663-a.tmp": True,  # (a non-ASCII digit: Python's \d took it)
    "run/..instride-1-a.tmp": True,  # no name before ".instride-"
    "run/.x.instride-.tmp": True,
    "run/a.instride-1-a.tmp": True,  # not hidden
    "run/.a.instride-1-a.tmpx": True,
    "run/.a.instride-1-a.tmp/k": True,  # (only the last component can be a temp)
    "run/x.instride": True,
    "instride/k": True,
}

_C_IS_KEY = r"""
import ctypes, json, os, sys
import instride
lib = ctypes.CDLL(os.path.join(os.path.dirname(instride.__file__), "libinstride.so"))
root = os.environ["INSTRIDE_DIR"]
names = json.loads(sys.argv[1])
print(json.dumps([bool(lib.instride_is_key(os.path.join(root, n).encode())) for n in names]))
"""


def test_the_c_library_reserves_exactly_the_names_python_does(tmp_path: Path) -> None:
    """The C side (``instride_is_key``; the preload library classifies paths the same way)
    reserved every hidden name with ``.instride-`` in it that ends in ``.tmp``: a key such as
    ``run/.notes.instride-draft.tmp``, which Python publishes, was no key for a C program --
    written in place as a plain file under the preload library (not write-once, never waited
    for), refused by the C API."""
    import json
    import subprocess
    import sys

    root = tmp_path / "managed"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INSTRIDE_")}
    env["INSTRIDE_DIR"] = str(root)
    names = list(_EDGE_NAMES)
    proc = subprocess.run([sys.executable, "-c", _C_IS_KEY, json.dumps(names)], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    c_says = dict(zip(names, json.loads(proc.stdout), strict=True))

    def python_says(name: str) -> bool:
        try:
            normalize_key(name, root)
        except KeyValidationError:
            return False
        return True

    assert {n: python_says(n) for n in names} == _EDGE_NAMES  # (the table is right)
    assert c_says == _EDGE_NAMES


#: Names (bytes, relative to the managed directory) at the edge of Python's rules other than
#: the reserved ones: control characters, names of whitespace only (``str.isspace``: also
#: U+0085, U+3000), component and key lengths in UTF-8 bytes, and UTF-8 that Python's strict
#: decoder refuses (overlong forms, surrogates, above U+10FFFF, cut short, Latin-1).
_CONTENT_NAMES = [
    b"a\nb", b"a\x7fb", b"a\x01", b"\t", b"d/a\x1fb", b"a\rb",
    b" ", b"./ ", "\u3000".encode(), "\x85".encode(), " \u2003 ".encode(),
    b"a/ ", b" a ", b" / ", "a\x85b".encode(), "a\u2028b".encode(), "\u00e9".encode(),
    "\U0001f600".encode(), "\U0010ffff".encode(), "\ufffe".encode(), b"a~-b",
    b"x" * 200, b"x" * 201, "\u00e9".encode() * 100, "\u00e9".encode() * 101,
    b"d/" + b"x" * 201, b"/".join([b"d" * 100] * 10) + b"/" + b"x" * 14,
    b"/".join([b"d" * 100] * 10) + b"/" + b"x" * 15, b"/".join([b"d" * 100] * 11),
    b"\xff", b"a\xe9b", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf",
    b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xe2\x82", b"a\xe2\x82/b", b"\x80", b"\xc2",
    # two faults: a control character or bad UTF-8 is said (EINVAL) before a length met first;
    # a long name of whitespace only is too long (as Python says of such a path)
    b"x" * 201 + b"/a\nb", b"x" * 201 + b"\xff", b"d/" + b"x" * 201 + b"\x01", b" " * 201,
    "\u3000".encode() * 70, b"/".join([b"d" * 100] * 11) + b"/a\x7f",
]

_C_TAKES = r"""
import ctypes, json, os, sys
import instride
lib = ctypes.CDLL(os.path.join(os.path.dirname(instride.__file__), "libinstride.so"))
lib.instride_strerror.restype = ctypes.c_char_p
lib.instride_last_error.restype = ctypes.c_char_p
root = os.fsencode(os.environ["INSTRIDE_DIR"])
out = []
for name in json.loads(sys.argv[1]):
    path = root + b"/" + bytes.fromhex(name)
    w = ctypes.c_void_p()
    created = lib.instride_create(path, 0, 0o644, ctypes.byref(w))
    if created == 0:
        lib.instride_abort(w)
    buf = ctypes.create_string_buffer(4096)
    consumed = lib.instride_consume(path, buf, 4096)
    out.append([lib.instride_is_key(path), created, consumed])
print(json.dumps(out))
"""


def test_the_c_library_takes_exactly_the_keys_python_takes(tmp_path: Path) -> None:
    """The C side (libinstride.so; the preload library classifies paths the same way) took
    names that ``normalize_key`` refuses -- control characters, a name of whitespace only,
    components over ``MAX_COMPONENT_BYTES``, keys over ``MAX_KEY_BYTES``, bytes that are no
    UTF-8 -- and published them: files under the managed directory that no Python consumer
    can name (KeyValidationError). C refuses exactly those now: ``instride_create`` and
    ``instride_consume`` fail with EINVAL (ENAMETOOLONG for the lengths) at once, nothing is
    written. ``instride_is_key`` still says 1 for them, as for a path too long to handle: a
    path under the managed directory is never written as a plain file (stream.hpp)."""
    import errno
    import json
    import subprocess
    import sys

    root = tmp_path / "managed"
    root.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("INSTRIDE_")}
    env.update(INSTRIDE_DIR=str(root), INSTRIDE_TIMEOUT="0")
    proc = subprocess.run(
        [sys.executable, "-c", _C_TAKES, json.dumps([n.hex() for n in _CONTENT_NAMES])],
        env=env, capture_output=True, text=True, timeout=60, check=True)
    c_says = dict(zip(_CONTENT_NAMES, json.loads(proc.stdout), strict=True))

    def python_says(name: bytes) -> int:
        try:
            normalize_key(os.fsencode(root) + b"/" + name, root)
        except KeyValidationError as exc:
            return errno.ENAMETOOLONG if "longer than" in str(exc) else errno.EINVAL
        return 0

    python = {n: python_says(n) for n in _CONTENT_NAMES}
    assert sum(1 for v in python.values() if v == 0) == 13  # (the list has both kinds)
    # created: 0 (a key) or the errno Python's refusal maps to; consumed: ETIMEDOUT for a key
    # (INSTRIDE_TIMEOUT=0, never published), else the same refusal
    assert {n: (is_key, created, consumed) for n, (is_key, created, consumed) in c_says.items()} \
        == {n: (1, v, v or errno.ETIMEDOUT) for n, v in python.items()}
    # nothing written; no directory made for a refused key (those of keys: "a/ ", " / ", ...)
    assert all(p.is_dir() for p in root.rglob("*"))
    assert set(os.listdir(root)) <= {"a", " ", "d" * 100}
