"""Fixtures for the LD_PRELOAD shim tests: compiled test programs and a shim environment.

Every test runs real processes with ``LD_PRELOAD=libinstride_preload.so`` (never the
pytest process itself) against a fresh managed directory under ``tmp_path``.
The C/C++/Fortran test programs in ``tests/preload/c`` are compiled once per session;
a missing compiler is an error, not a skip. C++ programs and programs marked
``uses_api`` are linked with ``libinstride.so`` (the C API) through the flags
``instride preload-path --cflags --libs`` prints.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from instride.emulate import EmulatedCluster
from instride.interception.preload import build_flags, preload_env, preload_path

C_DIR = Path(__file__).resolve().parent / "c"


def compiler(name: str) -> str:
    """Path of ``gcc``/``g++``/``gfortran``; raises (the test fails) when it is missing."""
    exe = shutil.which(name)
    if exe is None:
        package = "gfortran" if name == "gfortran" else "build-essential"
        raise RuntimeError(f"{name} is required by the preload tests: apt-get install {package}")
    return exe


class Builder:
    """Compiles the test programs once per session into a temporary directory."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.cache: dict[tuple, Path] = {}

    def __call__(
        self, source: str, *flags: str, name: str | None = None, api: bool | None = None
    ) -> Path:
        """Compile ``source``; ``api`` links libinstride.so (default: for C++ sources)."""
        src = C_DIR / source
        cxx = src.suffix == ".cpp"
        fortran = src.suffix == ".f90"
        api = cxx if api is None else api
        key = (source, flags, api)
        if key in self.cache:
            return self.cache[key]
        exe = self.out / (name or src.stem)
        if fortran:
            cmd = [compiler("gfortran"), "-Wall", "-Werror", "-O1", *flags, "-o", str(exe), str(src)]
        else:
            cmd = [compiler("g++" if cxx else "gcc")]
            cmd += ["-std=c++17"] if cxx else ["-std=c11"]
            cmd += ["-Wall", "-Wextra", "-Werror", "-O1", *flags, "-o", str(exe), str(src),
                    "-pthread"]
        if api:
            cmd += build_flags()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"compile failed: {' '.join(cmd)}\n{proc.stderr}"
        self.cache[key] = exe
        return exe


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory) -> Builder:
    """``build("calls.c", *flags) -> Path`` of the compiled program."""
    return Builder(tmp_path_factory.mktemp("preload-bin"))


@pytest.fixture(scope="session")
def lib() -> Path:
    """The built shim; its absence fails every test that needs it."""
    return preload_path()


#: An unmodified program (never imports instride) that opens the file at ``argv[1]``, reads
#: it, says "read", waits for a line, then reads it again: "same" or "changed".
HOLDING_READER = """
import sys
fh = open(sys.argv[1], "rb")
first = fh.read()
print("read", flush=True)
sys.stdin.readline()
fh.seek(0)
print("same" if fh.read() == first else "changed", flush=True)
"""


@dataclass
class Shim:
    """A managed directory, a plain directory beside it, and an env that preloads the shim."""

    dir: Path
    outside: Path
    env: dict[str, str] = field(default_factory=dict)

    def with_env(self, **extra: str) -> Shim:
        env = dict(self.env)
        env.update(extra)
        return Shim(self.dir, self.outside, env)

    def run(
        self, args: Sequence[str | os.PathLike], *, timeout: float = 60, check: bool = False,
        **kw: object,
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(a) for a in args], env=self.env, capture_output=True, timeout=timeout,
            **kw,  # type: ignore[arg-type]
        )
        if check:
            assert proc.returncode == 0, (
                f"{args} exited {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}"
            )
        return proc

    def popen(self, args: Sequence[str | os.PathLike], **kw: object) -> subprocess.Popen:
        return subprocess.Popen(
            [str(a) for a in args], env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            **kw,  # type: ignore[arg-type]
        )

    def py(self, code: str, **kw: object) -> subprocess.CompletedProcess:
        """Run ``python -c code`` under the shim (the code never imports instride)."""
        return self.run([sys.executable, "-I", "-c", code], **kw)

    def temps(self) -> list[Path]:
        """instride temp files left anywhere under the managed directory."""
        return [p for p in self.dir.rglob("*") if ".instride-" in p.name]


@pytest.fixture
def shim(tmp_path: Path, lib: Path) -> Shim:
    """Local mode: INSTRIDE_DIR=<tmp>/managed, INSTRIDE_TIMEOUT=10, the shim preloaded."""
    managed = tmp_path / "managed"
    outside = tmp_path / "outside"
    managed.mkdir()
    outside.mkdir()
    ours = {"INSTRIDE_DIR": str(managed), "INSTRIDE_TIMEOUT": "10"}
    env = {k: v for k, v in preload_env(ours).items()
           if not k.startswith("INSTRIDE_") or k in ours}
    assert env["LD_PRELOAD"].split(":")[0] == str(lib)
    return Shim(managed, outside, env)


@pytest.fixture(scope="module")
def nodes() -> Iterator[EmulatedCluster]:
    """Two emulated nodes in cluster mode (network namespaces, Redis, a node server each), for
    the tests of a module; their C programs wait 30 s at most."""
    with EmulatedCluster(nodes=2, env={"INSTRIDE_TIMEOUT": "30"}) as c:
        yield c


def run_preloaded(c: EmulatedCluster, node: int, argv: Sequence[object], timeout_s: str = "30"
                  ) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` on ``node`` under the preload library (``INSTRIDE_TIMEOUT=timeout_s``)."""
    env = {"LD_PRELOAD": str(preload_path()), "INSTRIDE_TIMEOUT": timeout_s}
    return c.run(node, [str(a) for a in argv], env=env, capture_output=True, timeout=120)

