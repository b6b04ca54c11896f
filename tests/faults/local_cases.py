"""Fault cases on one node (local mode): killed producers, a full disk, a thousand waiters,
a slow consumer, fuzzed frame headers, path traversal and symbolic links.

Each ``case_*`` function takes a work directory, a trial count and a seed, runs real
processes, and returns a :class:`~tests.faults.harness.CaseResult`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np

from instride.client import Client
from instride.config import Settings
from instride.errors import (
    ConsumeTimeout,
    FileTypeError,
    InstrideError,
    IntegrityError,
    KeyValidationError,
    UnsafePathError,
)
from instride.frames import HEADER_SIZE, decode_frame, encode_frame
from instride.stream import Stream

from .harness import (
    HANG_MARGIN,
    CaseResult,
    bounded,
    digest,
    leftovers,
    payload,
    timed,
    tree,
)


def local_client(root: Path, **env: str) -> Client:
    """A local-mode client on ``root``."""
    return Client(Settings.from_env({"INSTRIDE_DIR": str(root), **env}))


# ------------------------------------------------------------------ producer SIGKILLed
_PRODUCER = textwrap.dedent("""
    import random, sys, instride
    seed, prefix = int(sys.argv[1]), sys.argv[2]
    rng = random.Random(seed)
    print("ready", flush=True)
    i = 0
    while True:
        size = rng.choice([0, 1, 4096, 65536, 1 << 20, 3 << 20]) + rng.randrange(0, 4096)
        key = f"{prefix}/f{seed}_{i}_{size}.bin"
        data = random.Random(seed * 100003 + i).randbytes(size)
        with instride.open(key, "wb") as fh:
            for off in range(0, size, 65536):
                fh.write(data[off:off + 65536])
        print(key, flush=True)   # acknowledged: published
        i += 1
""")


def case_producer_sigkill(work: Path, trials: int, seed: int = 1) -> CaseResult:
    """A producer writing files of 0 B - 3 MiB in 64 KiB writes is SIGKILLed at a random moment.

    Checks: every acknowledged key is published and intact; every published key is intact
    (never a partial file); the next key times out (no hang); ``gc`` removes the dead
    producer's temporary file.
    """
    res = CaseResult("producer SIGKILLed mid-write")
    root = work / "sigkill"
    root.mkdir(parents=True, exist_ok=True)
    client = local_client(root, INSTRIDE_FSYNC="1")
    env = dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_FSYNC="1")
    env.pop("INSTRIDE_REDIS_URL", None)
    rng = random.Random(seed)
    with timed(res):
        for t in range(trials):
            res.trials += 1
            prefix = f"t{t}"
            proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, str(seed * 1000 + t), prefix],
                                    env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"ready":
                res.notes.append(f"trial {t}: producer did not start")
                continue
            time.sleep(rng.uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
            acked = [line.decode().strip() for line in proc.stdout.read().splitlines()]
            proc.wait()
            proc.stdout.close()
            published = [p for p in tree(root / prefix) if ".instride-" not in p] if (
                root / prefix).exists() else []
            for name in published:
                sd, i, size = (int(x.lstrip("f")) for x in name.removesuffix(".bin").split("_"))
                data = (root / prefix / name).read_bytes()
                if data != random.Random(sd * 100003 + i).randbytes(size):
                    res.corrupted += 1
            for key in acked:
                if not (root / key).is_file():
                    res.lost += 1
            tmp = leftovers(root)
            res.saw("killed mid-write: nothing partial published" if tmp else
                    "killed between files: nothing partial published")
            state, err = bounded(lambda p=prefix: client.consume(f"{p}/next.bin", timeout=0.05),
                                 0.05 + HANG_MARGIN)
            if state == "hang":
                res.hangs += 1
            elif not isinstance(err, ConsumeTimeout):
                res.notes.append(f"trial {t}: next key gave {err!r}")
            removed = client.gc()
            if leftovers(root):
                res.notes.append(f"trial {t}: gc left {leftovers(root)} (removed {removed})")
            if tmp:
                res.saw("gc removed the dead producer's temporary file")
    client.close()
    return res


# ------------------------------------------------------------------ ENOSPC
@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m"):  # type: ignore[no-untyped-def]
    """Mount a tmpfs of ``size`` at ``path`` (root only); unmounted on exit."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


_STREAM_FILLER = textwrap.dedent("""
    import contextlib, errno, os, sys, numpy as np, instride
    name, atoms, retain = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pos = np.random.default_rng(atoms).random((atoms, 3))
    kw = dict(retain=retain) if retain else {}

    def append(s, i):
        try:
            s.append(pos, step=i)
            return "ok"
        except OSError as exc:
            return "ENOSPC" if exc.errno == errno.ENOSPC else repr(exc)

    with instride.Stream(name, mode="w", layout="paper", **kw) as s:
        i = 0
        while i < 1000 and (said := append(s, i)) == "ok":
            i += 1
        # the disk full to its last page: a new stream (its state, its first frame) says
        # ENOSPC too
        filler = os.path.join(os.environ["INSTRIDE_DIR"], "filler.bin")
        with open(filler, "wb", buffering=0) as fh:
            with contextlib.suppress(OSError):
                while True:
                    fh.write(bytes(4096))
        try:
            with instride.Stream(name + "-new", mode="w", layout="paper") as new:
                new.append(pos, step=0)
            other = "ok"
        except OSError as exc:
            other = "ENOSPC" if exc.errno == errno.ENOSPC else repr(exc)
        os.unlink(filler)
        print(said, i, other, flush=True)
        sys.stdin.readline()  # (room made meanwhile: the same frame again)
        print(append(s, i), i, flush=True)
""")
#: bytes the ENOSPC case's stream part keeps of the 2 MiB disk until its producer finds it
#: full: room enough, once deleted, for the frame that failed (560 KB at most), the next
#: frame's file made ahead (as large) and the end marker
_BALLAST = 1_300_000


def _stream_until_full(root: Path, res: CaseResult, t: int, rng: random.Random) -> None:
    """A stream's producer (in its own process: a store into a mapping of a file the full
    disk has no page for would kill it with SIGBUS) appends frames until the disk is full,
    without retention and with it in turn: the failure must be an ``OSError(ENOSPC)``, the
    frames before intact, the one that failed not published; once room is made (a ballast
    file deleted) the same frame must go; no file of the producer's pool may be left."""
    # (16 frames of 5,000 atoms or more: over 2 MiB, so a ring that recycles fills it too)
    atoms, retain = rng.randrange(5_000, 20_000), 0 if t % 2 == 0 else 16
    name, ballast = f"s{t}", root / f"ballast{t}.bin"
    try:
        ballast.write_bytes(b"\0" * _BALLAST)
    except OSError as exc:
        st = os.statvfs(root)
        res.notes.append(f"trial {t}: no room for the ballast ({exc!r}; "
                         f"{st.f_bavail * st.f_frsize} bytes free; {tree(root)})")
        return
    proc = subprocess.Popen([sys.executable, "-c", _STREAM_FILLER, name, str(atoms), str(retain)],
                            env={**os.environ, "INSTRIDE_DIR": str(root)}, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    deadline = threading.Timer(120, proc.kill)  # (a producer that hangs: its lines end)
    deadline.start()
    first = proc.stdout.readline().split()
    ballast.unlink()
    with contextlib.suppress(BrokenPipeError):
        proc.stdin.write("go\n")
        proc.stdin.flush()
    again = proc.stdout.readline().split()
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _out, err = proc.communicate()
    deadline.cancel()
    if proc.returncode == -signal.SIGKILL:
        res.hangs += 1
    if proc.returncode != 0 or first[:1] != ["ENOSPC"] or first[2:] != ["ENOSPC"] \
            or again[:1] != ["ok"]:
        res.lost += 1
        res.notes.append(f"trial {t}: stream producer (retain={retain}) exit status "
                         f"{proc.returncode}, said {first} then {again}, {err[-300:]!r}")
        return
    failed = int(first[1])
    steps = []
    for path in sorted((root / name).glob("frame_*.isf")):
        try:
            steps.append(decode_frame(path.read_bytes(), path.name, copy=True).step)
        except IntegrityError:
            res.corrupted += 1
    # every frame before the one that failed (those a ring kept), then that one, made again
    kept = list(range(0, failed)) if not retain else list(range(max(0, failed + 1 - retain),
                                                                 failed))
    if steps != kept + [failed]:
        res.corrupted += 1
        res.notes.append(f"trial {t}: frames {steps} published, expected {kept + [failed]}")
    if any("slot-" in p for p in tree(root)):
        res.notes.append(f"trial {t}: files of the stream's pool left: {tree(root)}")
    res.saw(f"stream append (retain={retain or None}): OSError(ENOSPC), frames before intact,"
            " the frame goes once room is made")
    with contextlib.suppress(FileNotFoundError):
        for path in (root / name).iterdir():  # make room again
            path.unlink()


def case_enospc(work: Path, trials: int, seed: int = 2) -> CaseResult:
    """Fill a 2 MiB tmpfs with frames until writes fail; free space; write again; then fill
    it with a stream's frames, without retention and with it in turn.

    Checks: a failing write raises ``OSError(ENOSPC)`` and publishes nothing (no partial
    file, no temporary file left); every frame published before is intact; after deleting
    frames, writing works again. A stream's producer gets ``OSError(ENOSPC)`` too (not a
    ``SIGBUS``), publishes nothing of the frame that failed and leaves no pool file.
    """
    res = CaseResult("ENOSPC on a small tmpfs")
    rng = random.Random(seed)
    with timed(res), small_tmpfs(work / "small") as mnt:
        root = mnt / "managed"
        client = local_client(root)
        for t in range(trials):
            res.trials += 1
            done: list[tuple[str, int, int]] = []
            full = False
            for i in range(100):
                size = rng.randrange(100_000, 400_000)
                key = f"t{t}/f{i}.bin"
                try:
                    with client.open(key, "wb") as fh:
                        fh.write(payload(t * 1000 + i, size))
                    done.append((key, t * 1000 + i, size))
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        res.notes.append(f"unexpected {exc!r}")
                    res.saw(f"{type(exc).__name__}(ENOSPC): write refused, nothing published")
                    if (root / key).exists():
                        res.corrupted += 1  # a partial file under the key
                    full = True
                    break
            if not full:
                res.notes.append(f"trial {t}: the disk never filled")
            if leftovers(root):
                res.notes.append(f"trial {t}: temporary files left: {leftovers(root)}")
                res.corrupted += len(leftovers(root))
            for key, sd, size in done:
                if (root / key).read_bytes() != payload(sd, size):
                    res.corrupted += 1
            for key, _sd, _size in done:  # make room: the consumer is done with them
                client.delete(key)
            try:
                with client.open(f"t{t}/after.bin", "wb") as fh:
                    fh.write(payload(t, 100_000))
                res.saw("writes succeed again once space is freed")
                client.delete(f"t{t}/after.bin")
            except OSError as exc:
                res.lost += 1
                res.notes.append(f"trial {t}: write after freeing space failed: {exc!r}")
            _stream_until_full(root, res, t, rng)
        client.close()
    return res


# ------------------------------------------------------------------ 1,000 waiters
def case_many_waiters(work: Path, trials: int, waiters: int = 1000, seed: int = 3) -> CaseResult:
    """``waiters`` threads of one process wait for one key; it is published once.

    A thousand threads exceed the kernel's per-user inotify instance limit (128 by default),
    so most waits fall back to polling; every waiter must still get the whole file.
    """
    res = CaseResult(f"{waiters} concurrent waiters on one key")
    root = work / "waiters"
    client = local_client(root)
    with timed(res):
        for t in range(trials):
            res.trials += 1
            key = f"t{t}/hot.bin"
            data = payload(seed + t, 256 * 1024)
            want = digest(data)
            got: list[str] = []
            errors: list[BaseException] = []
            lock = threading.Lock()

            def wait(key: str = key, got: list[str] = got, errors: list[BaseException] = errors,
                     lock: threading.Lock = lock) -> None:
                try:
                    view = client.consume_bytes(key, timeout=60)
                    d = digest(view)
                    view.release()
                    with lock:
                        got.append(d)
                except BaseException as exc:  # noqa: BLE001
                    with lock:
                        errors.append(exc)

            threads = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
            for th in threads:
                th.start()
            time.sleep(0.5)
            with client.open(key, "wb") as fh:
                fh.write(data)
            deadline = time.monotonic() + 60 + HANG_MARGIN
            for th in threads:
                th.join(max(0.0, deadline - time.monotonic()))
            res.hangs += sum(th.is_alive() for th in threads)
            res.corrupted += sum(d != want for d in got)
            res.lost += len(errors)
            for failure in errors[:3]:
                res.notes.append(f"waiter failed: {failure!r}")
            res.saw("every waiter got the whole file", int(len(got) == waiters))
    client.close()
    return res


# ------------------------------------------------------------------ slow consumer
def case_slow_consumer(work: Path, trials: int, frames: int = 200, seed: int = 4) -> CaseResult:
    """A producer streams ``frames`` frames at full speed; a consumer reads one per 5 ms.

    Checks: the consumer gets every frame, in order, intact; the producer is never blocked
    by it (published frames stay until deleted).
    """
    res = CaseResult("slow consumer of a stream")
    root = work / "slow"
    env = dict(os.environ, INSTRIDE_DIR=str(root))
    env.pop("INSTRIDE_REDIS_URL", None)
    code = textwrap.dedent("""
        import sys, numpy as np, instride
        name, n, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        rng = np.random.default_rng(seed)
        with instride.Stream(name, mode="w") as s:
            for i in range(n):
                s.append(rng.random((500, 3), dtype=np.float32), step=i)
    """)
    with timed(res):
        for t in range(trials):
            res.trials += 1
            name = f"slow{t}"
            prod = subprocess.Popen([sys.executable, "-c", code, name, str(frames), str(seed + t)],
                                    env=env, stderr=subprocess.PIPE)
            rng = np.random.default_rng(seed + t)
            expected = [rng.random((500, 3), dtype=np.float32) for _ in range(frames)]
            client = local_client(root)
            seen = 0
            try:
                for i, frame in enumerate(Stream(name, timeout=60, client=client)):
                    if not np.array_equal(frame.positions, expected[i]) or frame.header.step != i:
                        res.corrupted += 1
                    seen += 1
                    time.sleep(0.005)
            except ConsumeTimeout:
                res.hangs += 1
            try:
                _, err = prod.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                prod.kill()
                prod.communicate()
                res.hangs += 1
            res.lost += frames - seen
            if prod.returncode == 0 and seen == frames:
                res.saw("every frame, in order, intact; producer never blocked")
            client.close()
    return res


# ------------------------------------------------------------------ frame headers fuzzed
def case_frame_fuzz(work: Path, trials: int, seed: int = 5) -> CaseResult:
    """Decode ``trials`` mutated frames: bit flips, truncations, random bytes, and header
    fields changed with their checksum recomputed (to reach every field check).

    Every decode must return the original frame or raise ``IntegrityError``; anything else
    (another exception, a frame with other content whose bytes were damaged) counts as
    corrupted.
    """
    res = CaseResult("frame headers fuzzed")
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    bases = []
    for layout in ("xyz32", "paper"):
        pos = nrng.random((64, 3)).astype(np.float32 if layout == "xyz32" else np.float64)
        header, pay = encode_frame(pos, layout=layout, step=7, time=0.5,
                                   box=np.eye(3) * 30.0)
        bases.append((bytes(header) + pay.tobytes(), decode_frame(bytes(header) + pay.tobytes())))
    import xxhash

    with timed(res):
        for _ in range(trials):
            res.trials += 1
            raw, ref = bases[rng.randrange(2)]
            buf = bytearray(raw)
            kind = rng.randrange(5)
            rehashed = False
            if kind == 0:  # one bit flipped anywhere
                pos = rng.randrange(len(buf))
                buf[pos] ^= 1 << rng.randrange(8)
            elif kind == 1:  # truncated
                buf = buf[: rng.randrange(len(buf))]
            elif kind == 2:  # random bytes of random length
                buf = bytearray(rng.randbytes(rng.randrange(0, 2 * HEADER_SIZE + 64)))
            elif kind == 3:  # header fields rewritten, header checksum recomputed
                off = rng.choice([0, 4, 6, 8, 16, 24, 32, 104, 112])
                width = {0: 4, 4: 2, 6: 2}.get(off, 8)
                buf[off:off + width] = rng.randbytes(width)
                buf[120:128] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(buf[:120])))
                rehashed = True
            else:  # several random bytes of the header overwritten
                for _ in range(rng.randrange(1, 8)):
                    buf[rng.randrange(HEADER_SIZE)] = rng.randrange(256)
            try:
                frame = decode_frame(bytes(buf))
            except IntegrityError:
                res.saw("IntegrityError")
                continue
            except Exception as exc:  # noqa: BLE001 - an untyped failure is a finding
                res.corrupted += 1
                res.notes.append(f"untyped {type(exc).__name__}: {exc}")
                continue
            same = (np.array_equal(frame.positions, ref.positions)
                    and frame.header.step == ref.header.step
                    and frame.header.time == ref.header.time
                    and np.array_equal(frame.header.box, ref.header.box))
            if same:
                res.saw("decoded unchanged (mutation restored the same bytes)")
            elif rehashed:
                res.saw("valid re-checksummed header: decoded as written (not damage)")
            else:
                res.corrupted += 1
    return res


# ------------------------------------------------------------------ paths, local interfaces
def case_paths_local(work: Path, trials: int = 1, seed: int = 6) -> CaseResult:
    """Traversal, absolute paths, trailing slashes, symbolic links (as a directory on the way
    and as the key), directory keys and FIFOs through every local interface: ``open`` (read,
    write), ``consume``, ``consume_bytes``, ``publish``, ``delete``, ``register``,
    ``wait_any``, ``Stream``, the patched builtin ``open`` and the ``instride`` command.

    Every attempt must raise a typed error (``KeyValidationError``, ``UnsafePathError``,
    ``FileTypeError``) or exit with status 4, and nothing outside may change.
    """
    res = CaseResult("path traversal and symlinks (local interfaces)")
    root = work / "paths" / "managed"
    outside = work / "paths" / "outside"
    root.mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "secret").write_bytes(b"secret")
    (root / "s").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (root / "s" / "link").symlink_to(outside)
    with contextlib.suppress(FileExistsError):
        (root / "lnk").symlink_to(outside / "secret")
    (root / "adir").mkdir(exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkfifo(root / "fifo")
    client = local_client(root)
    src = work / "paths" / "src.bin"
    bad_keys = ["../outside/secret", "s/../../outside/secret", str(outside / "secret"),
                "s/link/secret", "s/link/new.bin", "lnk", "adir", "adir/", "fifo", "s/link/",
                "a\x00b", ".instride/node.sock"]
    calls = {
        "open(r)": lambda k: client.open(k).read(),
        "open(wb)": lambda k: client.open(k, "wb").close(),
        "consume": lambda k: client.consume(k, timeout=0.2),
        "consume_bytes": lambda k: client.consume_bytes(k, timeout=0.2),
        "publish": lambda k: (src.write_bytes(b"x"), client.publish(src, k)),
        "delete": lambda k: client.delete(k),
        "register": lambda k: client.register(k),
        "wait_any": lambda k: client.wait_any([k], timeout=0.2),
        "Stream": lambda k: Stream(k, timeout=0.2, client=client).read(0),
    }
    typed = (KeyValidationError, UnsafePathError, FileTypeError)
    before = tree(outside)
    with timed(res):
        for _ in range(trials):
            for name, call in calls.items():
                for key in bad_keys:
                    res.trials += 1
                    state, err = bounded(lambda c=call, k=key: c(k), 0.2 + HANG_MARGIN)
                    if state == "hang":
                        res.hangs += 1
                    elif state == "error" and isinstance(err, typed):
                        res.saw(type(err).__name__)
                    elif state == "error" and isinstance(err, ConsumeTimeout) and name in (
                            "wait_any", "Stream"):
                        res.saw("ConsumeTimeout (key never published inside)")
                    elif state == "error" and isinstance(err, (InstrideError, OSError)) and (
                            name == "delete"):
                        res.saw(type(err).__name__)
                    else:
                        res.corrupted += 1  # an escape or an untyped answer
                        res.notes.append(f"{name}({key!r}) -> {state} {err!r}")
            # the patched builtin open and the command line
            env = dict(os.environ, INSTRIDE_DIR=str(root), INSTRIDE_PATCH_OPEN="1")
            env.pop("INSTRIDE_REDIS_URL", None)
            code = ("import sys\ntry:\n    open(sys.argv[1], 'wb').write(b'evil')\n"
                    "except Exception as e:\n    print(type(e).__name__)\n")
            for path in (root / "s" / "link" / "evil", root / "lnk", root / "adir"):
                res.trials += 1
                out = subprocess.run([sys.executable, "-c", code, str(path)], env=env,
                                     capture_output=True, text=True, timeout=60)
                kind = out.stdout.strip()
                if kind in ("UnsafePathError", "FileTypeError"):
                    res.saw(f"patched open: {kind}")
                else:
                    res.corrupted += 1
                    res.notes.append(f"patched open({path}) -> {out.stdout!r} {out.stderr[-300:]!r}")
            for key in ("s/link/secret", "../outside/secret", "adir", "lnk", "adir/"):
                res.trials += 1
                out = subprocess.run([sys.executable, "-m", "instride", "cat", key,
                                      "--timeout", "0"], env=env, capture_output=True,
                                     timeout=60)
                if out.returncode == 4 and b"secret" not in out.stdout:
                    res.saw("instride cat: exit 4")
                else:
                    res.corrupted += 1
                    res.notes.append(f"instride cat {key} -> {out.returncode} {out.stdout[:50]!r}")
    if tree(outside) != before or (outside / "secret").read_bytes() != b"secret":
        res.corrupted += 1
        res.notes.append(f"outside changed: {tree(outside)}")
    client.close()
    return res
