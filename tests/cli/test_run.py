"""``instride run`` and ``instride preload-path``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path


def _instride(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True, text=True,
                          timeout=60, **kw)  # type: ignore[call-overload]


def test_preload_path_points_at_the_built_library() -> None:
    out = _instride("preload-path")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.name == "libinstride_preload.so" and path.is_file()
    assert path.read_bytes()[:4] == b"\x7fELF"


def test_run_couples_cat_and_cp(managed_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.txt"
    src.write_text("via cp\n")
    target = managed_dir / "run" / "x.txt"
    cat = subprocess.Popen([sys.executable, "-m", "instride", "run", "--timeout", "30", "--",
                            "cat", str(target)], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    assert cat.poll() is None
    cp = _instride("run", "--", "cp", str(src), str(target))
    assert cp.returncode == 0, cp.stderr
    out, _ = cat.communicate(timeout=60)
    assert cat.returncode == 0
    assert out == "via cp\n"


def test_run_passes_exit_status_and_reports_missing_commands(managed_dir: Path) -> None:
    assert _instride("run", "--", "sh", "-c", "exit 7").returncode == 7
    res = _instride("run", "--", "no-such-program-xyz")
    assert res.returncode == 127 and "not found" in res.stderr
    res = _instride("run")
    assert res.returncode == 2


def test_run_timeout_becomes_etimedout(managed_dir: Path) -> None:
    res = _instride("run", "--timeout", "0.3", "--", "cat", str(managed_dir / "never"))
    assert res.returncode != 0
    assert "timed out" in res.stderr.lower()
    assert "LD_PRELOAD" not in os.environ


def test_run_timeout_inf_overrides_instride_timeout(managed_dir: Path) -> None:
    """``instride run --timeout inf`` gives the command no limit, whatever INSTRIDE_TIMEOUT says."""
    env = dict(os.environ, INSTRIDE_TIMEOUT="0.5")
    target = managed_dir / "late" / "k.txt"
    res = _instride("run", "--", "cat", str(target), env=env)  # (the setting applies)
    assert res.returncode == 1 and "timed out" in res.stderr.lower()
    cat = subprocess.Popen([sys.executable, "-m", "instride", "run", "--timeout", "inf", "--",
                            "cat", str(target)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env)
    try:
        time.sleep(1.5)
        assert cat.poll() is None, cat.communicate()
        cp = _instride("run", "--", "sh", "-c", f"echo late > {target}", env=env)
        assert cp.returncode == 0, cp.stderr
        out, err = cat.communicate(timeout=60)
    finally:
        if cat.poll() is None:
            cat.kill()
            cat.wait()
    assert cat.returncode == 0, err
    assert out == "late\n"
