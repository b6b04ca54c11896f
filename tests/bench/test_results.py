"""Benchmark results on disk (instride.bench.results): their staged output."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_an_interrupted_swap_never_loses_both_results(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A study re-run into the directory of an earlier one, Ctrl-C landing while the earlier
    result was being deleted (an rmtree of many files: seconds): the finally block then
    removed the staging directory, which held the complete new result — both lost. The swap
    is renames now (the old result deleted last): the new result is there."""
    from instride.bench import results

    out = tmp_path / "out"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / "old.json").write_text("old")
    real, calls = results.shutil.rmtree, []

    def interrupted(path: object, *args: object, **kwargs: object) -> None:
        calls.append(path)
        if len(calls) == 1:
            raise KeyboardInterrupt
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(results.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with results.staged_output(out, ["runs", "done"]) as staging:
            (staging / "runs").mkdir()
            (staging / "runs" / "new.json").write_text("new")
            (staging / "done").write_text("")
    assert (out / "runs" / "new.json").read_text() == "new" and (out / "done").exists()


def test_a_failed_run_leaves_no_empty_result_directory(tmp_path: Path) -> None:
    """A run that failed left the ``--out`` directory it made, empty."""
    from instride.bench import results

    out = tmp_path / "never"
    with pytest.raises(RuntimeError), results.staged_output(out, ["runs", "done"]):
        raise RuntimeError("the run failed")
    assert not out.exists()
    kept = tmp_path / "mine"
    kept.mkdir()
    with pytest.raises(RuntimeError), results.staged_output(kept, ["runs", "done"]):
        raise RuntimeError("the run failed")
    assert kept.is_dir()  # (the user's own directory stays)
