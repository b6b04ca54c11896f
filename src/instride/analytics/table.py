"""Results that stream to a CSV table as frames arrive.

Each row is written and flushed the moment its frame has been analysed, so ``tail -f`` (or a
notebook re-reading the file) follows the analysis live, and a crash loses at most the frame
being analysed.

Examples
--------
>>> with StreamingTable("out/rmsd.csv", ["frame", "time_ps", "rmsd"]) as table:  # doctest: +SKIP
...     table.append({"frame": 0, "time_ps": 0.02, "rmsd": 0.0})
>>> read_table("out/rmsd.csv")["rmsd"]                                           # doctest: +SKIP
"""

from __future__ import annotations

import csv
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["StreamingTable", "read_table"]


class StreamingTable:
    """A CSV file written one flushed row at a time.

    Parameters
    ----------
    path
        File to create (parent directories are created; an existing file is replaced).
    columns
        Column names, written as the header row.
    fsync
        Also ``fsync`` every row (default: flush to the OS only).
    """

    def __init__(
        self, path: str | os.PathLike[str], columns: Sequence[str], *, fsync: bool = False
    ) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        if len(set(self.columns)) != len(self.columns):
            raise ValueError(f"duplicate column names in {self.columns}")
        self.fsync = fsync
        self.rows = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "w", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._fh)
        self._writer.writerow(self.columns)
        self._flush()

    def _flush(self) -> None:
        self._fh.flush()
        if self.fsync:
            os.fsync(self._fh.fileno())

    def append(self, row: Mapping[str, Any] | Sequence[Any]) -> None:
        """Write one row (a mapping by column name, or values in column order) and flush it."""
        if isinstance(row, Mapping):
            missing = [c for c in self.columns if c not in row]
            if missing:
                raise ValueError(f"row lacks columns {missing}")
            values = [row[c] for c in self.columns]
        else:
            values = list(row)
            if len(values) != len(self.columns):
                raise ValueError(
                    f"row has {len(values)} values, table has {len(self.columns)} columns"
                )
        self._writer.writerow([_fmt(v) for v in values])
        self._flush()
        self.rows += 1

    def close(self) -> None:
        """Close the file. Idempotent."""
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> StreamingTable:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _fmt(value: Any) -> Any:
    if isinstance(value, (float, np.floating)):
        return repr(float(value))  # shortest round-trip representation
    return value


def read_table(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read a table written by :class:`StreamingTable`: column name -> float array."""
    with open(path, newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader)
        rows = [r for r in reader if r]
    data = np.array(rows, dtype=np.float64).reshape(len(rows), len(header))
    return {name: data[:, j] for j, name in enumerate(header)}
