"""The tcp engine's receive loop into a file (``isc_recv_file``, ``csrc/tcp/recv.c``).

Bodies of 64 KiB and more go socket -> pipe -> file by ``splice`` and are hashed through a
mapping of the file; smaller ones, write-only descriptors, file systems that refuse a splice
and ``INSTRIDE_RECV_SPLICE=0`` go through a buffer (``recv``, hash, ``write``). Each way must
store the same bytes at the file's offset, give the same digest and the same header copy, and
report a cut or a stalled transfer the same way. The receives run in a child process with
``c/splice_shim.c`` preloaded, which counts the splices into files (so the test knows which
way was taken) and can refuse them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import build_shim

RECEIVES = textwrap.dedent(
    """
    import ctypes, errno, json, os, socket, sys, threading, time, xxhash
    from instride.transport.tcp.engine import load_library

    lib = load_library()
    spliced = ctypes.c_int.in_dll(ctypes.CDLL(os.environ["LD_PRELOAD"]), "splice_into_files")
    out = sys.argv[1]

    def receive(name, data, size, *, lead=0, cut=None, hold=0.0, stall_ms=10_000,
                flags=os.O_RDWR, piece=50_000, pause=0.001):
        a, b = socket.socketpair()
        sent = data if cut is None else data[:cut]

        def send():
            for i in range(0, len(sent), piece):  # (pieces, a short pause between them)
                b.sendall(sent[i:i + piece])
                time.sleep(pause)
            time.sleep(hold)  # (a stalled peer: the connection kept open)
            b.close()

        sender = threading.Thread(target=send)
        sender.start()
        path = f"{out}/{name}"
        fd = os.open(path, flags | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, b"x" * lead)
        before = spliced.value
        hexdigest, got, where = ctypes.create_string_buffer(17), ctypes.c_uint64(), ctypes.c_int()
        head = ctypes.create_string_buffer(128)
        try:
            rc = lib.isc_recv_file(a.fileno(), fd, size, 128, stall_ms, hexdigest,
                                   ctypes.byref(got), ctypes.byref(where), head)
            offset = os.lseek(fd, 0, os.SEEK_CUR)
        finally:
            os.close(fd)
            a.close()
            sender.join(30)
        with open(path, "rb") as fh:
            stored = fh.read()
        return {"rc": rc, "got": got.value, "offset": offset, "spliced": spliced.value - before,
                "stored": stored == b"x" * lead + sent, "head": head.raw == data[:128],
                "digest": hexdigest.value.decode() == xxhash.xxh3_64_hexdigest(data[128:size])}

    big = os.urandom(3 * 2**20 + 5)
    report = {
        "big": receive("big", big, len(big)),
        "big_at_offset": receive("off", big, len(big), lead=100),
        "small": receive("small", big[:60_000], 60_000),
        "write_only": receive("wo", big, len(big), flags=os.O_WRONLY),
        "cut": receive("cut", big, 200_000, cut=70_000),
        "after_cut": receive("again", big, len(big)),
        "stalled": receive("stall", big, 200_000, cut=100_000, hold=1.0, stall_ms=300),
        "after_stall": receive("again2", big, len(big)),
    }
    def pipes():  # (this process's pipes, stdin/stdout/stderr left out)
        fds = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
            except FileNotFoundError:  # (the listing's own descriptor)
                pass
        return {link for link in links if link.startswith("pipe:")}

    # a child forked by a thread that has its pipe receives with its own (the parent's copies
    # closed), beside the parent (both flat out: a pipe shared between them would mix bytes)
    flat_out = dict(piece=2**16, pause=0.0)
    report["parent_pipes"] = sorted(pipes())
    r_in, w_in = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r_in)
        rs = [receive(f"child{i}", big[::-1], len(big), **flat_out) for i in range(8)]
        os.write(w_in, json.dumps(sorted(pipes() - {f"pipe:[{os.fstat(w_in).st_ino}]"})).encode())
        os._exit(0 if all(r["rc"] == 0 and r["stored"] and r["digest"] for r in rs) else 1)
    os.close(w_in)
    beside = [receive(f"parent{i}", big, len(big), **flat_out) for i in range(8)]
    report["beside_child"] = min(beside, key=lambda r: (r["stored"], r["digest"], r["rc"] == 0))
    report["child_ok"] = os.waitpid(pid, 0)[1] == 0
    with os.fdopen(r_in) as fh:
        report["child_pipes"] = json.loads(fh.read())
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = Path(__file__).resolve().parent / "c" / "splice_shim.c"
    return build_shim(src, tmp_path_factory.mktemp("shim"), "-ldl")


def _receives(shim: Path, out: Path, **env: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", RECEIVES, str(out)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "LD_PRELOAD": str(shim), **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("way", ["splice", "refused", "disabled"])
def test_every_way_into_a_file_stores_the_same_bytes_digest_and_header(
        shim: Path, tmp_path: Path, way: str) -> None:
    """The same receives by splice, on a file system that refuses splice (the bytes already in
    the pipe go through the buffer, the rest by ``recv``) and with ``INSTRIDE_RECV_SPLICE=0``:
    the bytes at the file's offset (a file with 100 bytes in it already: its offset then ends
    after the body), the digest, the header; a cut transfer is ``ECONNRESET`` with what came,
    and the next receive of the same thread is whole (nothing of the cut one left in its
    pipe); a stall is ``ETIMEDOUT``, and the next is whole too; a child forked by the thread
    receives beside its parent, through a pipe of its own (not the one it inherited)."""
    env = {"refused": {"SPLICE_SHIM_REFUSE": "1"}, "disabled": {"INSTRIDE_RECV_SPLICE": "0"}}
    r = _receives(shim, tmp_path, **env.get(way, {}))
    size = 3 * 2**20 + 5
    whole = ("big", "big_at_offset", "after_cut", "after_stall", "beside_child")
    for name in whole:
        lead = 100 if name == "big_at_offset" else 0
        assert r[name] == {"rc": 0, "got": size, "offset": lead + size, "stored": True,
                           "head": True, "digest": True, "spliced": r[name]["spliced"]}, name
    assert r["small"]["rc"] == 0 and r["small"]["stored"] and r["small"]["digest"]
    assert r["write_only"]["rc"] == 0 and r["write_only"]["stored"] and r["write_only"]["digest"]
    assert (r["cut"]["rc"], r["cut"]["got"]) == (-104, 70_000) and r["cut"]["stored"]  # ECONNRESET
    assert (r["stalled"]["rc"], r["stalled"]["got"]) == (-110, 100_000)  # ETIMEDOUT
    assert r["child_ok"]
    if way == "disabled":  # (no pipe is ever made)
        assert r["parent_pipes"] == r["child_pipes"] == []
    else:  # the parent's pipe, and the child's own: not the one it inherited
        assert len(r["parent_pipes"]) == len(r["child_pipes"]) == 1
        assert r["parent_pipes"] != r["child_pipes"]
    # which way each took: large bodies into a readable file by splice (one refused splice
    # each where the file system refuses it), never a small body or a write-only descriptor
    large = [r[n]["spliced"] for n in whole]
    if way == "splice":
        assert all(n > 1 for n in large), large
    elif way == "refused":
        assert large == [1] * len(whole)
    else:
        assert large == [0] * len(whole)
    assert r["small"]["spliced"] == 0 and r["write_only"]["spliced"] == 0
