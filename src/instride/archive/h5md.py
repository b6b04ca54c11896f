"""H5MD archive of a stream: appended frame by frame, crash-safe, readable while written.

Layout (H5MD 1.1, as MDAnalysis's H5MD reader expects it)::

    /h5md                              version [1, 1], author, creator
    /particles/trajectory/position     value (T, N, 3), step (T,), time (T,)
    /particles/trajectory/box          dimension 3, boundary; edges/{value, step, time}
                                       (only for frames with a box)
    /instride/index                    (T,) int64: the stream index of each row

Crash safety: the file is written in HDF5's single-writer/multiple-reader (SWMR) mode and
flushed after each frame the archiver acknowledges, so a reader sees every flushed frame and
a writer killed at any point leaves a readable file. HDF5 marks a file whose writer died as
"still open"; reopening it to resume copies its content into a fresh file (renamed into
place) first, since the library offers no call to clear that mark.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..frames import Frame, FrameHeader

_LIBVER = "latest"


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        hint = "the H5MD archive needs h5py: pip install 'instride[md]'"
        raise ConfigError("archive", "h5md", hint) from None
    return h5py


def _resumable(path: Path) -> None:
    """Make a file left open by a dead writer writable again (copy it into a fresh file)."""
    h5py = _h5py()
    try:
        with h5py.File(path, "a", libver=_LIBVER):
            return
    except OSError as exc:
        if "already open for write" not in str(exc):
            raise
    tmp = path.with_name(f".{path.name}.{os.getpid()}.recover")
    with h5py.File(path, "r", libver=_LIBVER, swmr=True) as src, h5py.File(tmp, "w", libver=_LIBVER) as dst:
        for name in src:
            src.copy(src[name], dst, name=name)
        for key, value in src.attrs.items():
            dst.attrs[key] = value
    os.rename(tmp, path)


class H5mdWriter:
    """Append frames to an H5MD file; reopening an existing file resumes after its last frame.

    Parameters
    ----------
    path
        The ``.h5`` / ``.h5md`` file.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f: Any = None
        if self.path.exists():
            _resumable(self.path)
            self._f = _h5py().File(self.path, "a", libver=_LIBVER)
            self._f.swmr_mode = True

    def _create(self, frame: Frame) -> None:
        h5py = _h5py()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = h5py.File(self.path, "w", libver=_LIBVER)
        h5 = f.create_group("h5md")
        h5.attrs["version"] = np.array([1, 1], dtype=np.int32)
        h5.create_group("author").attrs["name"] = "instride"
        h5.create_group("creator").attrs["name"] = "instride archive"
        traj = f.create_group("particles/trajectory")
        natoms, dtype = frame.natoms, frame.positions.dtype
        pos = traj.create_group("position")
        value = pos.create_dataset("value", shape=(0, natoms, 3), maxshape=(None, natoms, 3), dtype=dtype,
                                   chunks=(1, natoms, 3))
        value.attrs["unit"] = "Angstrom"
        pos.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,))
        t = pos.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64, chunks=(4096,))
        t.attrs["unit"] = "ps"
        box = traj.create_group("box")
        box.attrs["dimension"] = np.int32(3)
        periodic = frame.header.has_box
        box.attrs["boundary"] = np.array(["periodic" if periodic else "none"] * 3, dtype=h5py.string_dtype())
        if periodic:
            edges = box.create_group("edges")
            edges.create_dataset("value", shape=(0, 3, 3), maxshape=(None, 3, 3), dtype=np.float64,
                                 chunks=(4096, 3, 3)).attrs["unit"] = "Angstrom"
            edges.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,))
            edges.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64, chunks=(4096,))
        f.create_group("instride").create_dataset("index", shape=(0,), maxshape=(None,), dtype=np.int64,
                                                  chunks=(4096,))
        f.swmr_mode = True
        self._f = f

    def append(self, index: int, frame: Frame) -> None:
        """Append stream frame ``index``."""
        if self._f is None:
            self._create(frame)
        f = self._f
        pos = f["particles/trajectory/position"]
        n = pos["value"].shape[0]
        rows: list[tuple[Any, Any]] = [
            (pos["value"], frame.positions), (pos["step"], frame.step), (pos["time"], frame.time),
            (f["instride/index"], index),
        ]
        if "edges" in f["particles/trajectory/box"]:
            edges = f["particles/trajectory/box/edges"]
            rows += [(edges["value"], frame.box), (edges["step"], frame.step), (edges["time"], frame.time)]
        for ds, value in rows:
            ds.resize(n + 1, axis=0)
            ds[n] = value

    def flush(self) -> None:
        """Flush every appended frame to the file (readers and a restarted writer see them)."""
        if self._f is not None:
            self._f.flush()

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file."""
        if self._f is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._f["instride/index"][:])

    def close(self) -> None:
        """Flush and close."""
        if self._f is not None:
            with contextlib.suppress(Exception):
                self._f.flush()
            self._f.close()
            self._f = None


class H5mdReader:
    """Random access to an H5MD archive, also while its writer appends (SWMR)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = _h5py().File(self.path, "r", libver=_LIBVER, swmr=True)

    def _refresh(self) -> None:
        for name in ("instride/index", "particles/trajectory/position/value",
                     "particles/trajectory/position/step", "particles/trajectory/position/time"):
            self._f[name].refresh()
        if "edges" in self._f["particles/trajectory/box"]:
            self._f["particles/trajectory/box/edges/value"].refresh()

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file (refreshed)."""
        self._refresh()
        return np.asarray(self._f["instride/index"][:])

    def read(self, index: int) -> Frame | None:
        """Stream frame ``index`` (its arrays are owned copies); ``None`` if not archived."""
        idx = self.indices()
        row = int(np.searchsorted(idx, index))
        if row >= len(idx) or idx[row] != index:
            return None
        pos = self._f["particles/trajectory/position"]
        positions = np.asarray(pos["value"][row])
        box = np.zeros((3, 3))
        if "edges" in self._f["particles/trajectory/box"]:
            box = np.asarray(self._f["particles/trajectory/box/edges/value"][row])
        layout = "xyz32" if positions.dtype == np.float32 else "paper-soa"
        header = FrameHeader(
            natoms=positions.shape[0], step=int(pos["step"][row]), time=float(pos["time"][row]), box=box,
            layout=layout, payload_nbytes=positions.nbytes, payload_checksum=0,
        )
        return Frame(header, positions)

    def close(self) -> None:
        """Close the file."""
        self._f.close()
