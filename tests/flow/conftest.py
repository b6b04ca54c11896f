"""Fixtures of the flow tests: a fresh managed directory and a private run-state directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


def pythonpath() -> str:
    """``PYTHONPATH`` of a command a test starts: the repository (for ``tests.flow``), then the
    test's own (so a checkout's ``src`` run with ``PYTHONPATH=src`` is what the command runs)."""
    return os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)


@pytest.fixture
def flow_env(managed_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Path]]:
    """Local mode, run state under the test's temp dir; checks nothing is left behind."""
    state = tmp_path / "flow-state"
    monkeypatch.setenv("INSTRIDE_FLOW_STATE", str(state))
    out = tmp_path / "out"
    yield {"managed": managed_dir, "state": state, "out": out}
    leftovers = sorted(p.relative_to(managed_dir).as_posix() for p in managed_dir.rglob("*"))
    assert [p for p in leftovers if p.startswith("flow")] == [], "streams left behind"
    assert [p for p in leftovers if p.startswith(".instride/streams/flow")] == [], \
        "stream state (heads, groups, pools) left behind"
    assert not state.exists() or list(state.iterdir()) == [], "run state left behind"
