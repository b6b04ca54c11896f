"""The C API (include/instride/instride.h, libinstride.so), from a C program built by the test.

The program is compiled with the flags ``instride preload-path --cflags --libs`` prints and
runs WITHOUT the preload library: the API works on its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import Builder, Shim, compiler

SCENARIOS = ["settings", "produce", "abort", "wait", "timeout", "not_key", "publish"]


def plain(shim: Shim, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in shim.env.items() if k != "LD_PRELOAD"}
    env.update({"INSTRIDE_TIMEOUT": "0.5", **extra})
    return env


def run_api(shim: Shim, exe: Path, name: str, **extra: str) -> None:
    proc = subprocess.run([str(exe), name, str(shim.dir), str(shim.outside)],
                          env=plain(shim, **extra), capture_output=True, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == f"PASS {name}"


@pytest.mark.parametrize("name", SCENARIOS)
def test_api_scenario(shim: Shim, build: Builder, name: str) -> None:
    run_api(shim, build("api.c", api=True), name)
    assert shim.temps() == []


def test_api_overwrite(shim: Shim, build: Builder) -> None:
    run_api(shim, build("api.c", api=True), "overwrite", INSTRIDE_OVERWRITE="1")
    assert (shim.dir / "ow" / "k.bin").read_text() == "two"


def test_cli_flags_build_a_program(shim: Shim, tmp_path: Path) -> None:
    """`instride preload-path --cflags --libs` is all a C program needs to use the API."""
    flags = subprocess.run(
        [sys.executable, "-m", "instride", "preload-path", "--cflags", "--libs"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert any(f.startswith("-I") for f in flags) and "-linstride" in flags
    src = tmp_path / "hello.c"
    src.write_text(
        "#include <instride/instride.h>\n#include <stdio.h>\n#include <unistd.h>\n"
        "int main(int c, char **v) { (void)c; instride_writer *w;\n"
        "  if (instride_create(v[1], 0, 0644, &w)) { puts(instride_last_error()); return 1; }\n"
        "  if (write(instride_writer_fd(w), \"hi\", 2) != 2) return 1;\n"
        "  return instride_commit(w); }\n"
    )
    exe = tmp_path / "hello"
    subprocess.run([compiler("gcc"), str(src), "-o", str(exe), *flags], check=True)
    key = shim.dir / "hello" / "k.txt"
    subprocess.run([str(exe), str(key)], env=plain(shim), check=True, timeout=30)
    assert key.read_text() == "hi"
    assert shim.temps() == []


def test_library_exports_only_the_api() -> None:
    from instride.interception.preload import c_library_path, preload_path

    def exported(lib: Path) -> set[str]:
        out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                             text=True, check=True).stdout
        return {line.split()[-1] for line in out.splitlines() if " T " in line}

    api = exported(c_library_path())
    assert api and all(name.startswith("instride_") for name in api), api
    assert {"instride_create", "instride_commit", "instride_consume"} <= api
    wrappers = exported(preload_path())
    assert "open" in wrappers and not any(n.startswith("instride_") for n in wrappers)


def test_library_can_be_dlopened(shim: Shim) -> None:
    """libinstride.so loads with dlopen too (ctypes here): no initial-exec TLS in it."""
    key = shim.dir / "ct" / "k.bin"
    code = (
        "import ctypes, sys\n"
        "from instride.interception.preload import c_library_path\n"
        "lib = ctypes.CDLL(str(c_library_path()))\n"
        "lib.instride_is_key.argtypes = [ctypes.c_char_p]\n"
        "lib.instride_last_error.restype = ctypes.c_char_p\n"
        f"assert lib.instride_is_key({str(key).encode()!r}) == 1\n"
        "buf = ctypes.create_string_buffer(4096)\n"
        f"err = lib.instride_consume({str(key).encode()!r}, buf, 4096)\n"
        "assert err == 110, err\n"
        "assert b'ct/k.bin' in lib.instride_last_error()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=plain(shim, INSTRIDE_TIMEOUT="0.2"),
                          capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    from instride.interception.preload import c_library_path

    dynamic = subprocess.run(["readelf", "-d", str(c_library_path())], capture_output=True,
                             text=True, check=True).stdout
    assert "STATIC_TLS" not in dynamic  # initial-exec TLS could fail to dlopen late


def run_guard(shim: Shim, build: Builder, name: str, **extra: str) -> None:
    """One scenario of api_guards.c (it checks itself and prints PASS)."""
    proc = subprocess.run([str(build("api_guards.c", api=True)), name, str(shim.dir),
                           str(shim.outside)], env=plain(shim, **extra), capture_output=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().strip() == f"PASS {name}"


def test_forked_child_neither_publishes_nor_removes(shim: Shim, build: Builder) -> None:
    """In a forked child, commit of an inherited writer is EPERM and abort leaves the temp:
    only the process that created a writer publishes or removes it."""
    run_guard(shim, build, "fork")
    assert shim.temps() == []


def test_publish_onto_its_own_inode_is_still_confined(shim: Shim, build: Builder) -> None:
    """instride_publish's "same file" shortcut looks at the key confined: reaching the source
    through a symbolic link inside the managed directory is ELOOP, not success."""
    run_guard(shim, build, "publish_same")
    assert (shim.outside / "f").read_text() == "x"


def test_publish_with_a_refused_setting_fails_even_onto_itself(shim: Shim,
                                                               build: Builder) -> None:
    (shim.dir / "k").write_text("k")
    run_guard(shim, build, "publish_refused", INSTRIDE_TIMEOUT="-1")


def test_create_of_a_name_too_long_has_a_message(shim: Shim, build: Builder) -> None:
    run_guard(shim, build, "long_name")
    assert list(shim.dir.iterdir()) == []
