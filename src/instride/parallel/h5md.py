"""Export trajectories to H5MD (HDF5) files that MDAnalysis reads; locate their positions.

The file follows H5MD 1.1 (https://www.nongnu.org/h5md/h5md.html) as MDAnalysis's
:class:`~MDAnalysis.coordinates.H5MD.H5MDReader` expects it::

    /h5md                      version = [1, 1]; author/name; creator/name, version
    /particles/trajectory/box  dimension = 3, boundary = periodic | none
        edges/{value (T,3,3), step, time}        only when the frames carry a box
    /particles/trajectory/position
        value (T, N, 3) float32, unit "Angstrom", chunked one frame per chunk
        step  (T,) int64
        time  (T,) float64, unit "ps"

One frame per chunk lets every rank of a parallel analysis read its own slice independently
(``h5py.File(path, "r")`` on each rank); parallel HDF5 with the ``mpio`` driver is not needed
for that (see :mod:`instride.parallel.inputs`). The file is written under a temporary name and
renamed into place, so a reader never sees a partial file.

Examples
--------
Shell::

    instride export --h5md run7 run7.h5
    python -c "import MDAnalysis as mda; print(mda.Universe('top.psf', 'run7.h5'))"

Python::

    export_h5md("instride://run7", "run7.h5")
    export_h5md("adk.dcd", "adk.h5", topology="adk.psf")
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..analytics.reader import SCHEME, stream_name
from .analysis_errors import TrajectoryNotFoundError, UnsupportedInputError

FrameTuple = tuple[int, float, np.ndarray, "np.ndarray | None"]


_H5_REGISTERED = False


def register_h5_extension() -> None:
    """Let MDAnalysis open H5MD files named ``*.h5`` (it knows only ``*.h5md`` by extension).

    Registers an ``H5`` reader format that is MDAnalysis's own
    :class:`~MDAnalysis.coordinates.H5MD.H5MDReader`, the documented way a reader registers
    itself (a class attribute ``format``). Does nothing if ``H5`` is already registered.
    Without it, open ``.h5`` files with ``mda.Universe(top, "out.h5", format="H5MD")``.
    """
    global _H5_REGISTERED
    if _H5_REGISTERED:
        return
    import MDAnalysis
    from MDAnalysis.coordinates.H5MD import H5MDReader

    if "H5" not in MDAnalysis._READERS:

        class H5Reader(H5MDReader):
            """H5MD files with the ``.h5`` extension (registered by instride)."""

            format = "H5"

    _H5_REGISTERED = True


def position_group(f: Any) -> Any:
    """The ``position`` group of the first particle group of an open H5MD file.

    Raises
    ------
    KeyError
        No ``particles/<group>/position/value`` dataset.
    """
    if "particles" not in f:
        raise KeyError("no 'particles' group: not an H5MD trajectory")
    for name in f["particles"]:
        g = f["particles"][name]
        if "position" in g and "value" in g["position"]:
            return g["position"]
    raise KeyError("no particles/<group>/position/value dataset")


def _stream_frames(name: str, timeout: float | None) -> tuple[int | None, Iterator[FrameTuple]]:
    from .. import Stream

    stream = Stream(name, mode="r", timeout=timeout)

    def gen() -> Iterator[FrameTuple]:
        try:
            for fr in stream:
                box = np.array(fr.header.box) if fr.header.has_box else None
                yield fr.header.step, fr.header.time, fr.positions, box
        finally:
            stream.close()

    try:
        total = len(stream) if stream.ended else None
    except BaseException:
        stream.close()
        raise
    return total, _Closing(gen(), stream)


class _Closing:
    """A generator of frames that also closes its stream when closed before it started (a
    generator's ``finally`` runs only once it has started)."""

    def __init__(self, frames: Iterator[FrameTuple], stream: Any) -> None:
        self._frames, self._stream = frames, stream

    def __iter__(self) -> Iterator[FrameTuple]:
        return self

    def __next__(self) -> FrameTuple:
        return next(self._frames)

    def close(self) -> None:
        """Close the generator and the stream (once is enough; twice does nothing)."""
        self._frames.close()  # type: ignore[attr-defined]
        self._stream.close()


def _mda_frames(trajectory: str, topology: str) -> tuple[int, Iterator[FrameTuple]]:
    import warnings

    import MDAnalysis as mda

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            u = mda.Universe(topology, trajectory)
    except (ValueError, OSError, TypeError) as exc:  # (MDAnalysis: no reader -> TypeError)
        raise UnsupportedInputError(
            trajectory, f"MDAnalysis cannot read it: {str(exc).splitlines()[0]}") from None

    def gen() -> Iterator[FrameTuple]:
        for ts in u.trajectory:
            box = None if ts.dimensions is None else ts.triclinic_dimensions.astype(np.float64)
            yield int(ts.data.get("step", ts.frame)), float(ts.time), ts.positions, box
        u.trajectory.close()

    return u.trajectory.n_frames, gen()


def export_h5md(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    topology: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
    overwrite: bool = False,
    progress: bool = False,
    batch: int = 256,
) -> Path:
    """Write a stream (or any MDAnalysis-readable trajectory) as an H5MD file.

    Parameters
    ----------
    source
        ``instride://NAME`` or a stream name; with ``topology``, a trajectory file.
        A stream still being produced is followed until its producer closes it.
    out
        The ``.h5`` file to write.
    topology
        Topology of a trajectory-file source (not needed for a stream).
    timeout
        Seconds to wait for each next frame of a stream.
    overwrite
        Replace an existing ``out``.
    progress
        Show a tqdm progress bar.
    batch
        Frames written per HDF5 write call.

    Returns
    -------
    Path
        ``out``.

    Raises
    ------
    TrajectoryNotFoundError
        A trajectory or topology file does not exist.
    UnsupportedInputError
        ``out`` exists and ``overwrite`` is false, its directory does not exist, the source
        cannot be read or has no frames, or frames differ in atom count or in having a box
        (H5MD stores box edges for every frame or for none).
    """
    import h5py

    from .. import __version__
    from ..progress import progress as tqdm

    register_h5_extension()
    src = os.fspath(source)
    out = Path(out)
    key = _managed_key(out)  # [confine] inside the managed directory: published, not written there
    if out.exists() and not overwrite:
        raise UnsupportedInputError(str(out), "output exists (pass overwrite=True / --force)")
    if key is None and not out.parent.is_dir():
        raise UnsupportedInputError(str(out), f"the output directory {str(out.parent)!r} "
                                    "does not exist")
    if topology is not None:
        if not Path(topology).exists():
            raise TrajectoryNotFoundError(os.fspath(topology), "topology")
        if not Path(src).exists():
            raise TrajectoryNotFoundError(src)
        total, frames = _mda_frames(src, os.fspath(topology))
    else:
        name = stream_name(src) if src.startswith(SCHEME) else src
        total, frames = _stream_frames(name, timeout)

    # (a name nobody can guess, made exclusively — "x", O_EXCL: never through a link planted
    # there in a shared directory, never another thread's)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp") if key is None \
        else key[1]
    try:
        with h5py.File(tmp, "x" if key is None else "w") as f, \
                tqdm(total=total, unit="frame", desc=f"export {out.name}",
                     disable=not progress) as bar:
            n = _write(f, frames, total, batch, __version__, bar)
        if n == 0:
            raise UnsupportedInputError(src, "no frames to export")
        if key is None:
            os.replace(tmp, out)
        else:
            key[0].publish(tmp, key[2], overwrite=overwrite)  # atomic, recorded, confined
    finally:
        # (the source let go of now, also where writing never began or broke off: a frames
        # generator never started would not close the stream it holds)
        close = getattr(frames, "close", None)
        if close is not None:
            close()
        if tmp.exists():
            tmp.unlink()
    return out


def _managed_key(out: Path) -> tuple[Any, Path, str] | None:
    """``(client, temporary file, key)`` when ``out`` lies in the managed directory, else ``None``.

    An export into the managed directory is written to a temporary file in instride's own
    directory and published under its key (atomic, checked for links, recorded in cluster
    mode), so consumers wait for it like for any other key.
    """
    from ..client import get_client
    from ..config import Settings
    from ..paths import managed_key_of

    key = managed_key_of(Settings.from_env().dir, out)
    if key is None:
        return None
    client = get_client()
    client.settings.internal_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return client, client.settings.internal_dir / f"export-{os.getpid()}-{out.name}.tmp", key


def _write(f: Any, frames: Iterator[FrameTuple], total: int | None, batch: int,
           version: str, bar: Any) -> int:
    import h5py

    h5 = f.create_group("h5md")
    h5.attrs["version"] = np.array([1, 1], dtype=np.int32)
    h5.create_group("author").attrs["name"] = "instride"
    creator = h5.create_group("creator")
    creator.attrs["name"] = "instride"
    creator.attrs["version"] = version
    traj = f.create_group("particles/trajectory")
    box_g = traj.create_group("box")
    box_g.attrs["dimension"] = np.int32(3)

    pos = step = time_ = edges = None
    buf_pos: list[np.ndarray] = []
    buf_step: list[int] = []
    buf_time: list[float] = []
    buf_box: list[np.ndarray] = []
    written = 0

    def flush() -> None:
        nonlocal written
        if not buf_pos:
            return
        k = len(buf_pos)
        for ds in (pos, step, time_):
            ds.resize(written + k, axis=0)
        pos[written:written + k] = np.stack(buf_pos)
        step[written:written + k] = buf_step
        time_[written:written + k] = buf_time
        if edges is not None:
            for ds in (edges["value"], edges["step"], edges["time"]):
                ds.resize(written + k, axis=0)
            edges["value"][written:written + k] = np.stack(buf_box)
            edges["step"][written:written + k] = buf_step
            edges["time"][written:written + k] = buf_time
        written += k
        bar.update(k)
        buf_pos.clear()
        buf_step.clear()
        buf_time.clear()
        buf_box.clear()

    for s, t, xyz, box in frames:
        if pos is None:
            natoms = xyz.shape[0]
            g = traj.create_group("position")
            pos = g.create_dataset("value", shape=(0, natoms, 3), maxshape=(None, natoms, 3),
                                   dtype=np.float32, chunks=(1, natoms, 3))
            pos.attrs["unit"] = "Angstrom"
            step = g.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64,
                                    chunks=(4096,))
            time_ = g.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64,
                                     chunks=(4096,))
            time_.attrs["unit"] = "ps"
            boundary = "periodic" if box is not None else "none"
            box_g.attrs["boundary"] = np.array([boundary] * 3, dtype=h5py.string_dtype())
            if box is not None:
                edges = box_g.create_group("edges")
                v = edges.create_dataset("value", shape=(0, 3, 3), maxshape=(None, 3, 3),
                                         dtype=np.float64, chunks=(1024, 3, 3))
                v.attrs["unit"] = "Angstrom"
                edges.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64,
                                     chunks=(4096,))
                edges.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64,
                                     chunks=(4096,)).attrs["unit"] = "ps"
        if xyz.shape[0] != pos.shape[1]:
            raise UnsupportedInputError("frame", f"atom count changed from {pos.shape[1]} to "
                                        f"{xyz.shape[0]} (H5MD needs a fixed count)")
        if (box is None) != (edges is None):  # (no silent zeros, no silently dropped boxes)
            index = written + len(buf_pos)
            raise UnsupportedInputError(
                f"frame {index}", f"{'has no box' if box is None else 'has a box'} but frame 0 "
                f"{'has one' if box is None else 'has none'} (H5MD box edges are stored for "
                "every frame or for none)")
        buf_pos.append(np.asarray(xyz, dtype=np.float32).copy())
        buf_step.append(int(s))
        buf_time.append(float(t))
        if edges is not None:
            buf_box.append(np.asarray(box, np.float64))
        if len(buf_pos) >= batch:
            flush()
    flush()
    return written
