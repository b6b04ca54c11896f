"""A file published by moving it into place (``Client.publish``) is refused while another
process has it open for writing, and not published when one opens it for writing while it is
linked or copied into place (``store/lease.py``: a read lease). Every writer here is a real
process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import instride
from instride.errors import SourceBusy

from ..writers import HOLDER, lease_breaking


@pytest.fixture
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Writer processes a test starts; each is told to end, and waited for."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.communicate(b"\n", timeout=60)


def _hold(procs: list[subprocess.Popen[bytes]], path: Path, how: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    procs.append(proc)
    assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
    return proc


def _source(where: str, tmp_path: Path, shm: Path) -> Path:
    if os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.fail("/dev/shm is on tmp_path's file system here: this test needs two")
    src = (tmp_path if where == "same" else shm) / "out.dat"
    src.write_bytes(b"bytes")
    return src


@pytest.mark.parametrize("where", ["same", "cross"])
@pytest.mark.parametrize("how", ["writer", "mapping"])
def test_a_file_another_process_writes_is_not_published(
        client: instride.Client, tmp_path: Path, shm: Path, holders: list[subprocess.Popen[bytes]],
        where: str, how: str) -> None:
    """A file a simulation still writes (a descriptor, or a shared writable mapping only),
    published by moving it: on one file system the key was a link to the very file, which the
    writer kept changing under its readers; across two, a copy of whatever it held at that
    moment. Refused now (``SourceBusy``), nothing published, the file where it was; published
    once the writer closed it."""
    src = _source(where, tmp_path, shm)
    holder = _hold(holders, src, how)
    with pytest.raises(SourceBusy, match="open for writing by another process") as err:
        client.publish(src, "run/out.dat")
    assert err.value.errno == 16 and err.value.path == str(src)
    run = client.root / "run"
    assert not run.exists() or list(run.iterdir()) == []  # (no key, no temporary file)
    assert src.read_bytes() == b"bytes more"
    holder.communicate(b"\n", timeout=60)
    assert client.publish(src, "run/out.dat") == "run/out.dat"
    assert client.consume("run/out.dat").read_bytes() == b"bytes more"
    assert not src.exists()


def test_a_file_written_in_place_still_open_is_not_recorded(
        client: instride.Client, holders: list[subprocess.Popen[bytes]]) -> None:
    """A legacy tool's file written in place under the managed directory, still open for
    writing by it, published by its path: refused (``SourceBusy``); once closed, recorded."""
    path = client.root / "legacy" / "inplace.dat"
    path.parent.mkdir()
    path.write_bytes(b"bytes")
    holder = _hold(holders, path, "writer")
    with pytest.raises(SourceBusy):
        client.publish(path)
    holder.communicate(b"\n", timeout=60)
    assert client.publish(path) == "legacy/inplace.dat"
    assert client.consume("legacy/inplace.dat").read_bytes() == b"bytes more"


@pytest.mark.parametrize("where", ["same", "cross"])
def test_a_file_this_process_still_holds_open_is_published(
        client: instride.Client, tmp_path: Path, shm: Path, where: str) -> None:
    """"Write, flush, publish, then close" (``NamedTemporaryFile(delete=False)`` published
    inside its ``with``): this process's own descriptor of the file is not another writer."""
    src = _source(where, tmp_path, shm)
    with open(src, "ab") as fh:
        fh.write(b" more")
        fh.flush()
        assert client.publish(src, "run/own.dat") == "run/own.dat"
    assert client.consume("run/own.dat").read_bytes() == b"bytes more"
    assert not src.exists()


@pytest.mark.parametrize("when", ["before hiding", "in place"])
@pytest.mark.parametrize("where", ["same", "cross"])
def test_a_writer_opening_the_file_while_it_is_moved_in_is_not_published(
        client: instride.Client, tmp_path: Path, shm: Path,
        holders: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch,
        where: str, when: str) -> None:
    """A writer that opens the file while it is linked (one file system) or copied (two) into
    place: the key would be the file it then writes to, or a copy without its bytes (which
    would go to a source removed). The source's name goes first, to a hidden name; a writer
    whose open found the name before that waits for the lease, and is seen: the publication
    is refused (``SourceBusy``), nothing published, the file named again; the writer then goes
    on, into the file. So is one that reaches the lease only once the key's file is in place
    (here through another name of the file, a hard link): the key's file is taken back. (A
    real writer process, waited for until it waits for the lease.)"""
    src = _source(where, tmp_path, shm)
    ino = os.stat(src).st_ino
    other = src.with_name("other.dat")  # (the same file, another name: found after the hiding)
    os.link(src, other)
    if when == "before hiding":
        target, opened = instride.client, src
        name, real = "hide_source", instride.client.hide_source
    else:
        target, opened = instride.client.store, other
        name, real = "publish_file", instride.client.store.publish_file

    def then_a_writer(*args: object, **kw: object) -> object:
        if when == "before hiding":  # (its open finds the name, then waits for the lease)
            writer(opened)
        out = real(*args, **kw)  # type: ignore[operator]
        if when != "before hiding":
            writer(opened)
        return out

    def writer(path: Path) -> None:
        holders.append(subprocess.Popen([sys.executable, "-I", "-c", HOLDER, str(path), "writer"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        deadline = time.monotonic() + 30
        while not lease_breaking(ino) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lease_breaking(ino), "the writer never waited for the lease"

    monkeypatch.setattr(target, name, then_a_writer)
    with pytest.raises(SourceBusy, match="opened for writing while it was being moved"):
        client.publish(src, "run/moved.dat")
    monkeypatch.undo()
    assert not (client.root / "run" / "moved.dat").exists()
    holder = holders[-1]
    assert holder.stdout is not None and holder.stdout.readline() == b"open\n"  # (went on)
    holder.communicate(b"\n", timeout=60)
    assert src.read_bytes() == b"bytes more"  # (named again, the writer's bytes in it)
    assert sorted(p.name for p in src.parent.iterdir() if p.name != "managed") == \
        ["other.dat", "out.dat"]  # (nothing left under a hidden name)
    assert list((client.root / "run").iterdir()) == []  # (no temporary file left)


def test_a_publication_refused_by_its_record_names_the_source_again(
        client: instride.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The source is hidden while it is published; a record that fails (write-once: another
    node's publication; Redis out of reach) names it again, untouched."""
    src = tmp_path / "out.dat"
    src.write_bytes(b"bytes")

    def refused(*_args: object, **_kw: object) -> None:
        raise instride.KeyExistsError("run/refused.dat")

    monkeypatch.setattr(client.engine, "published", refused)
    with pytest.raises(instride.KeyExistsError):
        client.publish(src, "run/refused.dat")
    assert sorted(os.listdir(tmp_path)) == ["managed", "out.dat"]  # (named again, no hidden name)
    assert src.read_bytes() == b"bytes"


@pytest.mark.parametrize("where", ["same", "cross"])
def test_a_writer_looking_for_the_source_once_the_key_is_in_place_does_not_find_it(
        client: instride.Client, tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch,
        where: str) -> None:
    """On one file system the key's file is the source's own: a writer that opened the source
    by its name once the key's file was in place (before the record) was given the key's file,
    and a reader woken by the key could have read it before the publication was taken back.
    The source's name is gone by then (hidden first): the writer does not find it, the key is
    published as it was, and never changes."""
    src = _source(where, tmp_path, shm)
    real = instride.client.store.publish_file
    tried: list[subprocess.CompletedProcess[bytes]] = []

    def then_a_writer(*args: object, **kw: object) -> None:
        real(*args, **kw)  # type: ignore[arg-type]
        tried.append(subprocess.run([sys.executable, "-I", "-c", HOLDER, str(src), "writer"],
                                    input=b"\n", capture_output=True, timeout=60))

    monkeypatch.setattr(instride.client.store, "publish_file", then_a_writer)
    assert client.publish(src, "run/found.dat") == "run/found.dat"
    monkeypatch.undo()
    assert tried and tried[0].returncode != 0 and b"FileNotFoundError" in tried[0].stderr
    assert client.consume("run/found.dat").read_bytes() == b"bytes"
    assert not src.exists()


def test_an_interrupt_right_after_the_source_is_hidden_names_it_again(
        client: instride.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a signal handler's exception) right after the source went to its hidden name,
    before the publication knew it: the source stayed hidden, nothing published. Its hidden
    name is drawn first, and any failure names it again."""
    src = tmp_path / "out.dat"
    src.write_bytes(b"bytes")
    real = os.rename

    def rename_then_interrupt(a: object, b: object) -> None:
        real(a, b)  # type: ignore[arg-type]
        if ".instride-moving-" in str(b):
            raise KeyboardInterrupt

    monkeypatch.setattr(instride.store.lease.os, "rename", rename_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        client.publish(src, "run/interrupted.dat")
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["managed", "out.dat"]  # (named again)
    assert src.read_bytes() == b"bytes"
    assert not (client.root / "run" / "interrupted.dat").exists()


def test_a_file_with_other_names_is_published_as_a_copy(
        client: instride.Client, tmp_path: Path) -> None:
    """A file with other hard links, published on its file system, was linked to the key: its
    other names still changed the key in place. It is published as a copy (as the preload
    library's rename does)."""
    src, other = tmp_path / "out.dat", tmp_path / "other.dat"
    src.write_bytes(b"bytes")
    os.link(src, other)
    assert client.publish(src, "run/copied.dat") == "run/copied.dat"
    with open(other, "ab") as fh:
        fh.write(b" more")
    assert client.consume("run/copied.dat").read_bytes() == b"bytes"
    assert not src.exists() and other.read_bytes() == b"bytes more"
