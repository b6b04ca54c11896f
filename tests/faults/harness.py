"""What every fault case shares: the result record, deterministic payloads, bounded calls.

A case runs *trials*, each injecting one fault into real processes, and counts what the
promise of instride forbids: **lost** frames (acknowledged by a producer, then not
consumable), **corrupted** frames (a consumer got bytes that differ from what was produced) and
**hangs** (a call that did not return within its timeout plus a margin). It also tallies the
*outcomes* observed (the typed error raised, or the recovery), which docs/reliability.md lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash

T = TypeVar("T")

#: Extra seconds a call may take beyond its own timeout before it counts as a hang.
HANG_MARGIN = 10.0


@dataclass
class CaseResult:
    """Counts of one fault case."""

    name: str
    trials: int = 0
    lost: int = 0
    corrupted: int = 0
    hangs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def saw(self, outcome: str, n: int = 1) -> None:
        """Count an observed outcome (a typed error's name, or a recovery)."""
        self.outcomes[outcome] += n

    @property
    def ok(self) -> bool:
        """No frame lost or corrupted, no hang."""
        return self.lost == 0 and self.corrupted == 0 and self.hangs == 0

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "trials": self.trials, "lost": self.lost,
                "corrupted": self.corrupted, "hangs": self.hangs,
                "outcomes": dict(self.outcomes), "notes": self.notes,
                "seconds": round(self.seconds, 2)}

    def __str__(self) -> str:
        return json.dumps(self.as_dict())


@contextlib.contextmanager
def timed(result: CaseResult) -> Iterator[CaseResult]:
    t0 = time.monotonic()
    try:
        yield result
    finally:
        result.seconds += time.monotonic() - t0


def payload(seed: int, size: int) -> bytes:
    """Deterministic bytes for ``seed`` (what a producer writes and a consumer checks)."""
    return random.Random(seed).randbytes(size)


def digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def file_digest(path: str | os.PathLike[str]) -> str:
    with open(path, "rb") as fh:
        return digest(fh.read())


def bounded(fn: Callable[[], T], limit: float) -> tuple[str, T | BaseException | None]:
    """Run ``fn`` in a thread for at most ``limit`` seconds.

    Returns ``("ok", value)``, ``("error", exception)`` or ``("hang", None)`` (the thread is
    left behind as a daemon: a hang is a failure of the case, not of the harness).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the outcome is what we record
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    if t.is_alive():
        return "hang", None
    if "error" in box:
        return "error", box["error"]
    return "ok", box.get("value")


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (relative), for "nothing left behind" checks."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def leftovers(root: Path) -> list[str]:
    """Temporary (``.instride-<pid>-...tmp``) files under ``root``, instride's own dir excluded."""
    return [p for p in tree(root) if ".instride-" in p and not p.startswith(".instride")]
