"""The ranks of the paper's workflow: producers (MD emulators) and consumers (analytics).

Run by ``mpiexec`` (see :mod:`instride.bench.workflow_run`), one process per rank::

    python -m instride.bench.workflow SPEC.json REP

With ``P`` pairs, ranks ``0 .. P-1`` are producers and ranks ``P .. 2P-1`` consumers; rank ``r``
and rank ``r + P`` form pair ``r``.

Producer (its MD emulator built before the rank's clock starts), per frame: MD sleep for one
stride (``produce.md``), serialize the frame in the paper layout (``produce.serialize``), write
it (``produce.write``), and, for the file systems, enter the pair's barrier (``produce.sync``);
with ``sync="serialized"`` (the default) it then waits in a second barrier until the consumer
has read and analysed the frame (``produce.sync_done``).

Consumer, per frame: for the file systems, enter the pair's barrier (``consume.sync``); read
the frame (``consume.read``; for instride preceded by ``consume.wait`` / ``consume.fetch`` /
``consume.store``), deserialize it, verifying its checksums (``consume.deserialize``); check
that it is the expected MD step; sleep for the analytics time, equal to the frame period
(``consume.analytics``); with ``sync="serialized"``, enter the second barrier
(``consume.sync_done``), which lets the producer start its next MD stride.

The two synchronizations of the file systems (see :data:`~instride.bench.sync.SYNC_MODES`):

- ``serialized`` — the paper's coarse-grained synchronization, which "result[s] in serialized
  execution of the producer and consumer" and does "not overlap producer and consumer
  tasks": MD and analytics alternate, so each side idles about one frame period per frame;
- ``pipelined`` — one barrier per frame (after the write, before the read): the consumer's
  analytics of frame *k* overlaps the producer's MD of frame *k + 1*, so the consumer only
  waits for about the producer's serialize + write.

Each rank writes its timing rows to ``RAW/rank<r>.csv`` and a line of facts (wall time, frames
verified) to ``RAW/rank<r>.json``; :mod:`instride.bench.results` merges them.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import IntegrityError
from ..md.emulator import MDEmulator, sleep_until
from .backends import InstrideBackend, make_backend
from .sync import PairBarrier, start_line
from .timers import FIELDS, RegionTimer

#: Seconds each rank may take to start (import, connect) at the start line, on top of the
#: wait limit (as the repetition's time budget allows, see ``RunConfig.time_budget``).
START_SECONDS_PER_RANK = 3.0


def frame_key(run_id: str, pair: int, index: int) -> str:
    """The key (path relative to the backend's directory) of frame ``index`` of ``pair``."""
    return f"{run_id}/pair{pair:04d}/frame_{index:06d}.isf"


def make_emulator(spec: dict[str, Any], pair: int) -> MDEmulator:
    """The producer's MD emulator, built (coordinates drawn, payload encoded) and touched once.

    Built before the rank's clock starts: for STMV it takes ~0.1 s, which would otherwise
    delay the first MD stride and count in the consumer's first wait.
    """
    emu = MDEmulator(
        spec["atoms"], spec["steps_per_second"], spec["stride"],
        time_scale=spec["time_scale"], layout="paper", sleep=spec["sleep"], seed=pair,
    )
    emu.frame()  # (the first serialization's one-time costs: not part of frame 0's)
    return emu


def produce(spec: dict[str, Any], pair: int, emu: MDEmulator, backend: Any, barrier: Any,
            timer: RegionTimer) -> int:
    """The producer loop; returns the bytes written.

    Parameters
    ----------
    spec
        The run's spec (``atoms``, ``steps_per_second``, ``stride``, ``frames``, ``sync``...).
    pair
        This rank's pair number.
    emu
        This pair's MD emulator (:func:`make_emulator`), built before the clock started.
    backend
        Where frames go (:func:`~instride.bench.backends.make_backend`).
    barrier
        The pair's :class:`~instride.bench.sync.PairBarrier` (file systems), else ``None``.
    timer
        This rank's region timer.

    Returns
    -------
    int
        Bytes written.
    """
    written = 0
    for i in range(spec["frames"]):
        key = frame_key(spec["run_id"], pair, i)
        with timer.region("produce.md", i):
            emu.advance()
        with timer.region("produce.serialize", i):
            header, payload = emu.frame()
        with timer.region("produce.write", i):
            backend.write(key, header, payload)
        written += len(header) + payload.nbytes
        if barrier is not None:
            with timer.region("produce.sync", i):
                barrier.wait()
            if spec["sync"] == "serialized":
                with timer.region("produce.sync_done", i):
                    barrier.wait()
    return written


def consume(spec: dict[str, Any], pair: int, backend: Any, barrier: Any, timer: RegionTimer) -> int:
    """The consumer loop; returns the number of frames verified.

    Parameters are those of :func:`produce`.

    Returns
    -------
    int
        Frames read, verified and analysed.

    Raises
    ------
    IntegrityError
        A frame with the wrong MD step or atom count (checksums: :func:`instride.read_frame`).
    """
    period = spec["stride"] / spec["steps_per_second"] * spec["time_scale"]
    verified = 0
    for i in range(spec["frames"]):
        key = frame_key(spec["run_id"], pair, i)
        if barrier is not None:
            with timer.region("consume.sync", i):
                barrier.wait()
        frame = backend.consume(key, i, timer)  # checksums verified by read_frame
        expected = (i + 1) * spec["stride"]
        if frame.step != expected or frame.natoms != spec["atoms"]:
            raise IntegrityError(
                key, f"got step {frame.step} / {frame.natoms} atoms, "
                f"expected step {expected} / {spec['atoms']} atoms",
            )
        verified += 1
        del frame
        with timer.region("consume.analytics", i):
            sleep_until(time.perf_counter() + period)
        if barrier is not None and spec["sync"] == "serialized":
            with timer.region("consume.sync_done", i):
                barrier.wait()
        if not spec["keep_frames"]:
            backend.discard(key)
    return verified


def run_rank(spec: dict[str, Any], rep: int) -> None:
    """Run this process's rank of repetition ``rep`` of the workflow described by ``spec``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    pairs = spec["pairs"]
    if comm.Get_size() != 2 * pairs:
        raise SystemExit(f"expected {2 * pairs} ranks, got {comm.Get_size()}")
    producer = rank < pairs
    pair = rank % pairs
    node = spec["placement"][rank]
    backend = make_backend(
        spec["backend"], spec.get("root"), fsync=spec["fsync"], timeout=spec["timeout"]
    )
    barrier = None
    if backend.explicit_sync:
        barrier = PairBarrier(comm, pair, 0 if producer else 1, timeout=spec["timeout"])
    if producer:
        backend.prepare(f"{spec['run_id']}/pair{pair:04d}")
    backend.warmup()
    emu = make_emulator(spec, pair) if producer else None  # (not on the clock)
    timer = RegionTimer(rank, "producer" if producer else "consumer", pair, node)
    limit = spec["timeout"]
    # Every rank waits here for the slowest to start (import, connect): the wait limit plus
    # the start-up time the repetition's budget allows each rank.
    start_line(comm, pair, None if limit is None else
               limit + START_SECONDS_PER_RANK * comm.Get_size())
    start = time.perf_counter()
    timer.origin = start
    if emu is not None:
        nbytes = produce(spec, pair, emu, backend, barrier, timer)
        verified = 0
    else:
        nbytes = 0
        verified = consume(spec, pair, backend, barrier, timer)
    wall = time.perf_counter() - start
    raw = Path(spec["raw_dir"])
    with open(raw / f"rank{rank:04d}.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(("rep", *FIELDS))
        for row in timer.rows:
            writer.writerow((rep, *row[:7], f"{row[7]:.9f}", f"{row[8]:.9f}"))
    facts = {
        "rep": rep, "rank": rank, "role": timer.role, "pair": pair, "node": node,
        "wall_s": wall, "frames_verified": verified, "bytes_written": nbytes,
        "origin_s": start,  # perf_counter (CLOCK_MONOTONIC: one clock for all ranks) at 0
        "mode": backend.client.mode if isinstance(backend, InstrideBackend) else "files",
        "pid": os.getpid(),
        "netns": os.stat("/proc/self/ns/net").st_ino,
    }
    (raw / f"rank{rank:04d}.json").write_text(json.dumps(facts))
    if barrier is not None:
        barrier.free()
    # Nobody leaves while a partner may still need the barrier. A partner may lag legitimately
    # (instride's producer never waits for its consumer; other pairs run at their own pace),
    # but not by more than this rank's whole run again: beyond that plus one wait's limit it
    # is hung, and the run fails now rather than at the end of the repetition's time budget.
    start_line(comm, pair, None if limit is None else limit + wall, "end line")


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank: ``python -m instride.bench.workflow SPEC REP``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m instride.bench.workflow SPEC.json REP", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    run_rank(spec, int(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
