"""H5MD archive of a stream: appended frame by frame, crash-safe, readable while written.

Layout (H5MD 1.1, as MDAnalysis's H5MD reader expects it)::

    /h5md                              version [1, 1], author, creator
    /particles/trajectory/position     value (T, N, 3), step (T,), time (T,)
    /particles/trajectory/box          dimension 3, boundary; edges/{value, step, time}
                                       (only for frames with a box)
    /instride                          stream: the name of the stream archived
    /instride/index                    (T,) int64: the stream index of each row

Crash safety: the file is written in HDF5's single-writer/multiple-reader (SWMR) mode and
flushed after each frame the archiver acknowledges, so a reader sees every flushed frame and
a writer killed at any point leaves a readable file. A frame is in the file once its row of
``/instride/index`` is: that row is written last, a failed append takes the frame's other
rows back, and a writer resuming a file cuts every dataset to the length of the index (the
rows of a frame its writer was killed in the middle of); readers read only the rows the index
covers. A row a resize reserved but the writer never wrote (killed between the two) reads
as the dataset's fill value: -1 for the index and steps, NaN for times and coordinates
(files of an older instride fill with 0: there such an index row does not ascend), and so is
no frame. HDF5 marks a file whose writer died as "still open"; reopening it to resume copies
its content into a fresh file (renamed into place) first, since the library offers no call
to clear that mark. One writer at a time (:func:`~instride.archive.base.lock_writer`), so
that copy never replaces the file of a live writer.

A new file is laid out under a hidden name beside it (``.NAME.create``) and given its name
only when complete, so a writer killed meanwhile leaves no file a later one would refuse.

Readers: HDF5's file lock (on unless ``HDF5_USE_FILE_LOCKING=FALSE``) keeps a writer from
opening a file a reader holds open, so an archive is resumed only once its readers have
closed it (:class:`~instride.errors.ArchiveError` until then); a reader of a file replaced
by that copy opens the new file at its next call.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArchiveError, ConfigError
from ..frames import Frame, FrameHeader
from .base import check_run, lock_writer, unlock_writer

_LIBVER = "latest"
_INDEX = "instride/index"
_POSITION = "particles/trajectory/position"
_EDGES = "particles/trajectory/box/edges"
_UNWRITTEN = -1  # the fill value of the index and steps: what a row never written reads as
_HELD = ("holds it open (a reader: a stream that read archived frames, MDAnalysis, h5py...), and "
         "HDF5 lets no writer open a file a reader holds (its file lock; in one process, its own "
         "check): close it to resume the archive")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        hint = "the H5MD archive needs h5py: pip install 'instride[md]'"
        raise ConfigError("archive", "h5md", hint) from None
    return h5py


def _rows(f: Any) -> list[Any]:
    """The datasets with a row per frame, ``/instride/index`` last."""
    names = [f"{_POSITION}/value", f"{_POSITION}/step", f"{_POSITION}/time"]
    if _EDGES in f:
        names += [f"{_EDGES}/value", f"{_EDGES}/step", f"{_EDGES}/time"]
    return [f[name] for name in [*names, _INDEX]]


def _written(index: np.ndarray) -> int:
    """How many rows of ``index`` (a file's ``/instride/index``) hold frames: its rows but the
    last ones a resize reserved and the writer never wrote (killed between the two), which read
    as the fill value -1 (0 in a file of an older instride: a row that does not ascend)."""
    n = len(index)
    while n and (index[n - 1] < 0 or (n > 1 and index[n - 1] <= index[n - 2])):
        n -= 1
    return n


def _text(value: Any) -> Any:
    """An HDF5 string attribute's value as ``str`` (h5py gives ``bytes`` for some)."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _locked_out(exc: OSError) -> bool:
    """Whether HDF5 refused to open a file because another process holds its file lock."""
    return "unable to lock file" in str(exc) or exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK)


def _open_here(path: Path) -> bool:
    """Whether this process holds ``path`` open through HDF5 (a reader not closed)."""
    h5py = _h5py()
    try:
        st = path.stat()
    except OSError:
        return False
    for fid in h5py.h5f.get_obj_ids(types=h5py.h5f.OBJ_FILE):
        try:
            held = os.fstat(fid.get_vfd_handle())  # (the file itself, whatever name it has now)
        except Exception:  # (not a file of the default driver: no descriptor)
            continue
        if (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino):
            return True
    return False


def _file_id(f: Any) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the open file ``f`` (``None``: not known)."""
    try:
        st = os.fstat(f.id.get_vfd_handle())
    except Exception:  # (not a file of the default driver: no descriptor)
        return None
    return st.st_dev, st.st_ino


def _creating(path: Path) -> Path:
    """The name a new archive ``path`` is laid out under, beside it."""
    return path.with_name(f".{path.name}.create")


def _not_archive(f: Any, stream: str | None, *, unnamed_ok: bool) -> str | None:
    """Why the open file ``f`` is not an archive of ``stream`` (any stream: ``None``);
    ``None`` if it is. ``unnamed_ok``: accept an archive that names no stream."""
    h5py = _h5py()
    try:
        rows = _rows(f)
    except (KeyError, TypeError, ValueError):
        rows = []
    if not rows or not all(isinstance(ds, h5py.Dataset) for ds in rows):
        return f"no {_INDEX} and {_POSITION} datasets: not an instride archive"
    if rows[0].ndim != 3 or rows[0].shape[2] != 3 or any(ds.ndim < 1 for ds in rows):
        return f"{_POSITION}/value is not (frames, atoms, 3): not an instride archive"
    name = f["instride"].attrs.get("stream")
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    if name is None:
        if unnamed_ok:
            return None
        return ("it names no stream (an archive of an instride older than the stream check), so "
                "it may be another stream's: archive to another file, or record the stream in it "
                "(docs/streams.md)")
    if stream is not None and name != stream:
        return f"it is the archive of stream {name!r}"
    return None


def _open_checked(path: Path, stream: str | None, *, unnamed_ok: bool) -> Any:
    """``path`` open for reading (SWMR), checked to be an archive of ``stream``."""
    h5py = _h5py()
    if not path.is_file():
        raise ArchiveError(stream, path, "not a regular file" if path.exists() else "no such file")
    if not h5py.is_hdf5(path):
        raise ArchiveError(stream, path, "not an HDF5 file, so not an instride archive")
    try:
        f = h5py.File(path, "r", libver=_LIBVER, swmr=True)
    except OSError as exc:
        if _locked_out(exc):  # (an archiver resuming it holds it so until it is in SWMR mode)
            raise ArchiveError(stream, path, "another process holds it open for writing (an archiver "
                                             f"resuming it, for a moment; or h5py): {exc}",
                               busy=True) from exc
        raise ArchiveError(stream, path, f"cannot be opened: {exc}") from exc
    try:
        why = _not_archive(f, stream, unnamed_ok=unnamed_ok)
    except BaseException:
        f.close()
        raise
    if why is not None:
        f.close()
        raise ArchiveError(stream, path, why)
    return f


def _resumable(path: Path) -> None:
    """Make a file left open by a dead writer writable again (copy it into a fresh file).

    Only with the file's writer lock held: the writer that left it open is then dead.
    """
    h5py = _h5py()
    try:
        with h5py.File(path, "a", libver=_LIBVER):
            return
    except OSError as exc:
        if "already open for write" not in str(exc):
            raise
    tmp = path.with_name(f".{path.name}.{os.getpid()}.recover")
    try:
        with h5py.File(path, "r", libver=_LIBVER, swmr=True) as src, \
                h5py.File(tmp, "w", libver=_LIBVER) as dst:
            for name in src:
                src.copy(src[name], dst, name=name)
            for key, value in src.attrs.items():
                dst.attrs[key] = value
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class H5mdWriter:
    """Append frames of a stream to an H5MD file; reopening an existing file resumes after
    its last frame.

    Parameters
    ----------
    path
        The ``.h5`` / ``.h5md`` file.
    stream
        The stream's name, recorded in the file; an existing file must be this stream's
        archive.
    lock
        The file's writer lock, taken already (:func:`~instride.archive.base.lock_writer`'s
        descriptor): the writer holds it from then on, and lets go of it when it closes or
        fails to open. ``None``: the writer takes it.
    run
        The id of the stream's run whose frames are appended (:meth:`instride.Stream.run_id`),
        recorded in a new file (attribute ``run`` of ``/instride``; set :attr:`run` before the
        first append where it is not known yet). An existing file that holds frames of another
        run is refused, and so is one that holds frames of a recorded run while the stream
        has none (``None``: no producer started: the file's run is an earlier one). ``""``
        (a producer that records no run): no check.

    Raises
    ------
    ArchiveError
        Another writer holds the file; the file is not an archive of ``stream`` (not HDF5, not
        an instride archive, another stream's, or one that names no stream), or holds frames
        of another run of it (see ``run``); a reader (of
        another process, or of this one) holds the file open, which HDF5's file lock keeps a
        writer out of: its readers must close it before it is resumed.
    """

    @staticmethod
    def check_own(path: Path, stream: str) -> None:
        """Raise :class:`~instride.errors.ArchiveError` unless ``path`` is an H5MD archive
        that names ``stream`` (one of an older instride, which names none, may be another
        stream's)."""
        _open_checked(Path(path), stream, unnamed_ok=False).close()

    def __init__(self, path: Path, stream: str, *, lock: int | None = None,
                 run: str | None = None) -> None:
        self.path = Path(path)
        self.stream = stream
        #: the stream's run whose frames this writer appends (recorded in a new file)
        self.run = run
        self._f: Any = None
        self._rows: list[Any] = []  # the datasets with a row per frame, the index last
        self._last = -1  # the stream index of the file's last frame
        self._lock: int | None = lock_writer(self.path, stream) if lock is None else lock
        try:
            # a file a writer was killed laying out (or giving its name: then a second name of
            # the archive, which this takes away without touching the file)
            _creating(self.path).unlink(missing_ok=True)
            # copies of a file left open that their writers were killed making (this one
            # holds the file's writer lock: theirs are dead)
            for leftover in self.path.parent.glob(f".{glob.escape(self.path.name)}.*.recover"):
                leftover.unlink(missing_ok=True)
            if self.path.exists():
                self._resume()
        except BaseException:
            self._unlock()
            raise

    def _error(self, detail: str) -> ArchiveError:
        return ArchiveError(self.stream, self.path, detail)

    def _unlock(self) -> None:
        if self._lock is not None:
            unlock_writer(self.path, self._lock)
            self._lock = None

    def _resume(self) -> None:
        f = _open_checked(self.path, self.stream, unnamed_ok=False)
        try:
            held = f["instride"].attrs.get("run")
            frames = _written(_rows(f)[-1][:])
        finally:
            f.close()
        check_run(self.stream, self.path, _text(held), frames, self.run)
        if _open_here(self.path):  # (HDF5 would refuse it, or share the reader's view of it)
            raise self._error(f"this process {_HELD}")
        try:
            _resumable(self.path)
            f = _h5py().File(self.path, "a", libver=_LIBVER)
        except OSError as exc:
            if _locked_out(exc):  # (no other archiver: it holds the writer's lock)
                raise self._error(f"another process {_HELD} ({exc})") from exc
            raise self._error(f"cannot be opened to resume it: {exc}") from exc
        try:
            rows = _rows(f)
            n = min(ds.shape[0] for ds in rows)
            n = _written(rows[-1][:n])
            own = f["instride"].attrs
            if not n and own.get("run") != self.run:  # (no frame yet: of this run, from now;
                if self.run:  # not known yet: of none, since SWMR mode adds no attribute)
                    own["run"] = self.run
                elif "run" in own:
                    del own["run"]
            # SWMR mode at once, the cuts after it (shrinking works in SWMR mode): a writer
            # killed while the file is open for writing without it leaves a file that no
            # reader and no later writer can open (HDF5's "open for write" flag, which only
            # h5clear clears) -- so that window is kept to the open itself
            f.swmr_mode = True
            cut = [ds for ds in rows if ds.shape[0] > n]
            for ds in cut:  # the rows of a frame whose index row was not written
                ds.resize(n, axis=0)
            if cut:
                f.flush()
            self._last = int(rows[-1][n - 1]) if n else -1
        except (OSError, RuntimeError) as exc:
            f.close()
            raise self._error(f"cannot be resumed: {exc}") from exc
        except BaseException:
            f.close()
            raise
        self._f, self._rows = f, rows

    def _create(self, frame: Frame) -> None:
        """Lay the file out for ``frame``'s kind under a hidden name, then give it its own."""
        h5py = _h5py()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _creating(self.path)
        try:
            tmp.unlink(missing_ok=True)  # (never truncated: it may be a name of an archive)
            f = h5py.File(tmp, "x", libver=_LIBVER)
        except OSError as exc:
            raise self._error(f"cannot be created: {exc}") from exc
        try:
            h5 = f.create_group("h5md")
            h5.attrs["version"] = np.array([1, 1], dtype=np.int32)
            h5.create_group("author").attrs["name"] = "instride"
            h5.create_group("creator").attrs["name"] = "instride archive"
            traj = f.create_group("particles/trajectory")
            natoms, dtype = frame.positions.shape[0], frame.positions.dtype
            pos = traj.create_group("position")
            # (fill values: what a row reserved by a resize and never written reads as)
            value = pos.create_dataset("value", shape=(0, natoms, 3), maxshape=(None, natoms, 3), dtype=dtype,
                                       chunks=(1, natoms, 3), fillvalue=np.nan)
            value.attrs["unit"] = "Angstrom"
            pos.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,),
                               fillvalue=_UNWRITTEN)
            t = pos.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64, chunks=(4096,),
                                   fillvalue=np.nan)
            t.attrs["unit"] = "ps"
            box = traj.create_group("box")
            box.attrs["dimension"] = np.int32(3)
            periodic = frame.header.has_box
            boundary = ["periodic" if periodic else "none"] * 3
            box.attrs["boundary"] = np.array(boundary, dtype=h5py.string_dtype())
            if periodic:
                edges = box.create_group("edges")
                edges.create_dataset("value", shape=(0, 3, 3), maxshape=(None, 3, 3), dtype=np.float64,
                                     chunks=(4096, 3, 3), fillvalue=np.nan).attrs["unit"] = "Angstrom"
                edges.create_dataset("step", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,),
                                     fillvalue=_UNWRITTEN)
                edges.create_dataset("time", shape=(0,), maxshape=(None,), dtype=np.float64, chunks=(4096,),
                                     fillvalue=np.nan)
            own = f.create_group("instride")
            own.attrs["stream"] = self.stream
            if self.run:
                own.attrs["run"] = self.run
            own.create_dataset("index", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(4096,),
                               fillvalue=_UNWRITTEN)
            f.swmr_mode = True  # (which writes the whole layout out)
            f.flush()
            self._place(tmp)
        except BaseException:
            f.close()
            tmp.unlink(missing_ok=True)  # (no file of no frame left behind)
            raise
        self._f, self._rows = f, _rows(f)

    def _place(self, tmp: Path) -> None:
        """Give the complete new file ``tmp`` its name (never over a file that appeared there)."""
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            raise self._error("cannot be created: a file appeared there meanwhile") from None
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK, errno.ENOSYS):
                raise self._error(f"cannot be created: {exc}") from exc
            if self.path.exists():  # (no hard links here: a rename, checked first)
                raise self._error("cannot be created: a file appeared there meanwhile") from None
            os.rename(tmp, self.path)
            return
        tmp.unlink()

    def _check(self, index: int, frame: Frame) -> None:
        """Raise :class:`ArchiveError` if frame ``index`` cannot be appended as it is."""
        if index <= self._last:
            raise self._error(f"frame {index} is not after the archive's last frame ({self._last})")
        if self._f is None:
            return
        value, positions = self._rows[0], frame.positions
        if positions.shape != value.shape[1:]:
            raise self._error(f"frame {index} has {positions.shape[0]} atoms (shape {positions.shape}); "
                              f"the archive's frames have {value.shape[1]}")
        if positions.dtype != value.dtype:
            raise self._error(f"frame {index} has {positions.dtype} coordinates; "
                              f"the archive's are {value.dtype}")
        if frame.header.has_box and len(self._rows) == 4:
            raise self._error(f"frame {index} has a box; the archive's first frame had none, so it "
                              "keeps no box")

    def append(self, index: int, frame: Frame) -> None:
        """Append stream frame ``index``: every row of it, or (raising) none.

        Raises
        ------
        ArchiveError
            The frame does not fit the archive: another atom count or coordinate type, a box
            in an archive whose first frame had none, an index not after the last frame's.
            Raised before the file is touched.
        """
        self._check(index, frame)
        if self._f is None:
            self._create(frame)
        rows = self._rows
        values: list[Any] = [frame.positions, frame.step, frame.time]
        if len(rows) > 4:
            values += [frame.box, frame.step, frame.time]
        n = rows[-1].shape[0]
        try:
            for ds, value in zip(rows, [*values, index], strict=True):  # the index row last
                ds.resize(n + 1, axis=0)
                ds[n] = value
        except BaseException:
            with contextlib.suppress(Exception):  # (rows left over are cut when the file is resumed)
                for ds in [rows[-1], *rows[:-1]]:  # (the index first: cut short between two,
                    if ds.shape[0] > n:  # it never covers a row the others lost)
                        ds.resize(n, axis=0)
            raise
        self._last = index

    def flush(self) -> None:
        """Flush every appended frame to the file (readers and a restarted writer see them)."""
        if self._f is not None:
            self._f.flush()

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file."""
        if self._f is None:
            return np.zeros(0, dtype=np.int64)
        return np.asarray(self._rows[-1][:])

    def close(self) -> None:
        """Flush and close (and let go of the file's writer lock)."""
        try:
            if self._f is not None:
                with contextlib.suppress(Exception):
                    self._f.flush()
                self._f.close()
                self._f = None
        finally:
            self._unlock()


class H5mdReader:
    """Random access to an H5MD archive, also while its writer appends (SWMR).

    Parameters
    ----------
    path
        The archive file.
    stream
        Refuse an archive of another stream (``None``: any). An archive that names no stream
        (written by an older instride) is read.

    Raises
    ------
    ArchiveError
        The file is not an instride archive (of ``stream``).
    """

    def __init__(self, path: Path, stream: str | None = None) -> None:
        self.path = Path(path)
        self._stream = stream
        self._f = _open_checked(self.path, stream, unnamed_ok=True)
        self._rows = _rows(self._f)
        self._id = _file_id(self._f)

    def run(self) -> str | None:
        """The id of the stream's run whose frames the file holds (``None``: not recorded,
        by an instride before the run check)."""
        return _text(self._f["instride"].attrs.get("run"))

    def _follow(self) -> None:
        """Open the file now under the path if it replaced the one open (a resuming writer's
        copy of a file its killed writer left open); until it opens, read the one open."""
        if self._id is None:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._id:
            return
        try:  # (its frames: those of the file open, and those appended since)
            f = _open_checked(self.path, self._stream, unnamed_ok=True)
        except ArchiveError:  # (its writer holds it for a moment as it resumes it)
            return
        old, self._f, self._rows, self._id = self._f, f, _rows(f), _file_id(f)
        old.close()

    def _refresh(self) -> None:
        self._follow()
        for ds in [self._rows[-1], *self._rows[:-1]]:  # the index first: it never covers more
            ds.refresh()                               # rows than the others then show

    def indices(self) -> np.ndarray:
        """Stream indices of the frames in the file (refreshed): the rows every dataset has
        (an append's rollback cut short can leave the index a row longer than the others)."""
        self._refresh()
        index = np.asarray(self._rows[-1][:])
        index = index[:min(ds.shape[0] for ds in self._rows)]
        return index[:_written(index)]  # (a row reserved but not yet written is no frame)

    def read(self, index: int) -> Frame | None:
        """Stream frame ``index`` (its arrays are owned copies); ``None`` if not archived."""
        idx = self.indices()
        row = int(np.searchsorted(idx, index))
        if row >= len(idx) or idx[row] != index:
            return None
        value, step, time = self._rows[:3]
        positions = np.asarray(value[row])
        box = np.zeros((3, 3))
        if len(self._rows) > 4:
            box = np.asarray(self._rows[3][row])
        layout = "xyz32" if positions.dtype == np.float32 else "paper-soa"
        header = FrameHeader(
            natoms=positions.shape[0], step=int(step[row]), time=float(time[row]), box=box,
            layout=layout, payload_nbytes=positions.nbytes, payload_checksum=0,
        )
        return Frame(header, positions)

    def close(self) -> None:
        """Close the file."""
        self._f.close()
