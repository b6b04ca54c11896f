"""``instride run`` and ``instride preload-path``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from instride.interception.preload import preload_path


def _instride(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "instride", *args], capture_output=True, text=True,
                          timeout=60, **kw)  # type: ignore[call-overload]


def test_preload_path_points_at_the_built_library() -> None:
    out = _instride("preload-path")
    assert out.returncode == 0, out.stderr
    path = Path(out.stdout.strip())
    assert path.name == "libinstride_preload.so" and path.is_file()
    assert path.read_bytes()[:4] == b"\x7fELF"
    assert path == preload_path()  # (the command runs the code under test, and its library)


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
    assert res.returncode == 1  # cat's own status for a failed open
    assert "timed out" in res.stderr.lower()


def test_run_sets_the_command_environment(managed_dir: Path, tmp_path: Path) -> None:
    """The command gets the library first in LD_PRELOAD (entries already there kept after
    it), the managed directory and the timeout."""
    other = tmp_path / "other.so"
    env = dict(os.environ, LD_PRELOAD=str(other))
    res = _instride("run", "--timeout", "7", "--", "sh", "-c",
                    'printf "%s\\n" "$LD_PRELOAD" "$INSTRIDE_DIR" "$INSTRIDE_TIMEOUT"', env={
                        k: v for k, v in env.items() if k != "LD_PRELOAD"})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [str(preload_path()), str(managed_dir), "7.0"]
    res = _instride("run", "--", "sh", "-c", 'printf "%s\\n" "$LD_PRELOAD"', env=env)
    assert res.stdout.splitlines() == [f"{preload_path()}:{other}"]


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


def test_run_bad_managed_directory_is_a_usage_error(managed_dir: Path, tmp_path: Path) -> None:
    """A managed directory that cannot be made (`--dir` or INSTRIDE_DIR) is a bad setting: 2."""
    afile = tmp_path / "afile"
    afile.write_text("")
    for args, env, name in (
        (["--dir", "/proc/nope"], None, "--dir"),
        (["--dir", str(afile / "sub")], None, "--dir"),
        ([], dict(os.environ, INSTRIDE_DIR="/proc/nope"), "INSTRIDE_DIR"),
    ):
        res = _instride("run", *args, "--", "true", env=env)
        assert res.returncode == 2, res.stderr
        assert name in res.stderr and "managed directory" in res.stderr
        assert "Traceback" not in res.stderr


def test_run_reports_commands_it_cannot_execute_as_a_shell(managed_dir: Path, tmp_path: Path) -> None:
    """126: found but not executable (unknown format, no x bit, a directory); 127: not found
    (also a script whose interpreter is missing)."""
    binary = tmp_path / "garbage"
    binary.write_bytes(b"\x00\x01garbage")
    binary.chmod(0o755)
    plain = tmp_path / "plain"
    plain.write_text("echo hi\n")
    plain.chmod(0o644)
    script = tmp_path / "bad-interpreter"
    script.write_text("#!/nonexistent/interpreter\necho hi\n")
    script.chmod(0o755)
    for path, status, why in ((binary, 126, "Exec format error"), (plain, 126, "Permission denied"),
                              (tmp_path, 126, "Is a directory"),
                              (script, 127, "No such file or directory"),
                              (tmp_path / "missing", 127, "not found")):
        res = _instride("run", "--", str(path))
        assert res.returncode == status, (path, res.stderr)
        assert why in res.stderr and "Traceback" not in res.stderr


GRO = """water
    3
    1SOL     OW    1   0.126   1.624   1.679
    1SOL    HW1    2   0.190   1.661   1.747
    1SOL    HW2    3   0.177   1.568   1.613
   3.00000   3.00000   3.00000
"""


def test_run_gromacs_writes_keys_without_waiting_for_them(managed_dir: Path, tmp_path: Path) -> None:
    """GROMACS checks whether each output file exists (to back it up) with fopen(path, "r"),
    which waits for the key: ``instride run`` sets GMX_MAXBACKUP=-1 (no backup, no check)."""
    gmx = shutil.which("gmx")
    assert gmx is not None, "GROMACS is needed (apt-get install gromacs)"
    gro = tmp_path / "water.gro"
    gro.write_text(GRO)
    env = {k: v for k, v in os.environ.items() if k != "GMX_MAXBACKUP"}
    env["INSTRIDE_TIMEOUT"] = "30"
    target = managed_dir / "g" / "out.gro"
    start = time.monotonic()
    res = _instride("run", "--", gmx, "-quiet", "editconf", "-f", str(gro), "-o", str(target),
                    env=env)
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - start < 20  # (it waited 30 s for its own output before)
    lines = target.read_text().splitlines()
    assert lines[1].strip() == "3" and [ln.split()[1] for ln in lines[2:5]] == ["OW", "HW1", "HW2"]
    # a value of the caller's own is kept
    echo = ["--", "sh", "-c", "echo $GMX_MAXBACKUP"]
    assert _instride("run", *echo, env=env).stdout == "-1\n"
    assert _instride("run", *echo, env=dict(env, GMX_MAXBACKUP="5")).stdout == "5\n"


def test_run_refuses_a_managed_directory_others_may_write(tmp_path: Path) -> None:
    """``instride run --dir D`` made D with the usual 0777 less the umask (readable by every
    user) and used one another user could write (plant or take keys); the Python client
    refuses such a directory. It is made 0700 now, and one others may write is a bad
    setting (exit status 2) before the command runs."""
    fresh = tmp_path / "fresh"
    assert _instride("run", "--dir", str(fresh), "--", "true").returncode == 0
    assert fresh.stat().st_mode & 0o777 == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    proc = _instride("run", "--dir", str(shared), "--", "touch", str(tmp_path / "ran"))
    assert proc.returncode == 2 and "writable by every user" in proc.stderr, proc.stderr
    assert not (tmp_path / "ran").exists()
