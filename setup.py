"""Build of instride's C libraries, from one implementation of the protocol (csrc/core).

- ``libinstride_preload.so``: the LD_PRELOAD interposition library (csrc/core + csrc/preload);
  it exports only the wrapped libc symbols.
- ``libinstride.so``: the C API of ``include/instride/instride.h`` (csrc/core + csrc/api),
  which ``include/instride/stream.hpp`` wraps for C++; it exports only ``instride_*``.
- ``libinstride_ucx.so``: the UCX engine of the ``ucx`` transport (csrc/ucx, loaded with
  ctypes). It is built only when UCX's headers are installed (Debian ``libucx-dev``); without
  them the package still installs and selecting the ``ucx`` transport raises a
  ``ConfigError`` that names the package.
- ``libinstride_local.so``: node-local hot paths (csrc/local, loaded with ctypes by
  instride/native.py): the sleep of a wait (poll the thread's inotify descriptor, read the
  events, check the awaited files) and the ``paper`` frame layout's encode and decode (records
  interleaved or split and hashed with xxh3 in one pass; xxhash inlined from Debian
  ``libxxhash-dev``); without it the same logic runs in Python.
- ``libinstride_tcp.so``: the C engine of the ``tcp`` transport (csrc/tcp, loaded with ctypes):
  the data server (connections, framing, the signed-request fast path and ``sendfile`` in C,
  every other decision in Python) and the client's receive loop (recv, xxh3, write). Links
  OpenSSL's libcrypto (HMAC-SHA256; Debian ``libssl-dev``) and inlines xxhash (Debian
  ``libxxhash-dev``, header only).

All package metadata lives in pyproject.toml; this file only adds the C build.
The libraries are plain shared objects (never imported by Python): each is built
as a setuptools Extension whose file name is forced to ``instride/<name>.so`` and
which exports no ``PyInit_`` symbol. The headers are shipped in the package as
``instride/include/instride/`` (``python -m instride.interception.preload --cflags``).
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

PRELOAD = "instride.libinstride_preload"
CAPI = "instride.libinstride"
UCX = "instride.libinstride_ucx"
TCP = "instride.libinstride_tcp"
LOCAL = "instride.libinstride_local"
LIBRARIES = (PRELOAD, CAPI, UCX, TCP, LOCAL)


class BuildPreload(build_ext):
    """build_ext that names the C libraries exactly lib<name>.so."""

    def get_ext_filename(self, fullname: str) -> str:
        # Called with the dotted name and, by get_ext_fullpath, with its last part.
        if any(fullname in (lib, lib.rpartition(".")[2]) for lib in LIBRARIES):
            return os.path.join(*fullname.split(".")) + ".so"
        return super().get_ext_filename(fullname)

    def get_export_symbols(self, ext: Extension) -> list[str]:
        if ext.name in LIBRARIES:
            return []
        return super().get_export_symbols(ext)


CORE = sorted(glob.glob("csrc/core/*.c"))
HEADERS = sorted(glob.glob("csrc/*/*.h") + glob.glob("include/instride/*"))
CFLAGS = ["-std=c11", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra"]

preload = Extension(
    PRELOAD,
    sources=CORE + sorted(glob.glob("csrc/preload/*.c")),
    depends=HEADERS,
    include_dirs=["csrc/core", "csrc/preload"],
    extra_compile_args=CFLAGS,
    libraries=["dl", "pthread", "m"],
)

capi = Extension(
    CAPI,
    sources=CORE + sorted(glob.glob("csrc/api/*.c")),
    depends=HEADERS,
    include_dirs=["csrc/core", "include"],
    extra_compile_args=CFLAGS,
    extra_link_args=["-Wl,-soname,libinstride.so"],
    libraries=["pthread", "m"],
)

tcp = Extension(
    TCP,
    sources=sorted(glob.glob("csrc/tcp/*.c")),
    depends=sorted(glob.glob("csrc/tcp/*.h") + glob.glob("csrc/common/*.h")),
    extra_compile_args=CFLAGS,
    libraries=["crypto", "pthread", "m", "dl"],  # (dl: libxxhash's dispatch, csrc/common/ins_xxh.h)
)


def _have_ucx() -> bool:
    """Whether UCX's development headers (Debian ``libucx-dev``) are installed."""
    dirs = ("/usr/include", "/usr/local/include", os.environ.get("UCX_HOME", "/nonexistent") + "/include")
    return any(os.path.exists(os.path.join(d, "ucp", "api", "ucp.h")) for d in dirs)


local = Extension(
    LOCAL,
    sources=sorted(glob.glob("csrc/local/*.c")),
    depends=sorted(glob.glob("csrc/common/*.h")),
    extra_compile_args=CFLAGS,
    libraries=["pthread", "dl"],
)

extensions = [preload, capi, tcp, local]
if _have_ucx():
    ucx_home = os.environ.get("UCX_HOME")
    extensions.append(Extension(
        UCX,
        sources=sorted(glob.glob("csrc/ucx/*.c")),
        include_dirs=[os.path.join(ucx_home, "include")] if ucx_home else [],
        library_dirs=[os.path.join(ucx_home, "lib")] if ucx_home else [],
        extra_compile_args=CFLAGS,
        libraries=["ucp", "ucs"],
    ))
else:
    print("instride: UCX headers not found (apt-get install libucx-dev): "
          "the ucx transport is not built", flush=True)

# INSTRIDE_PATCH_OPEN=1 must work for scripts that never import instride: a .pth file at the
# top of site-packages installs the open() patch at interpreter start-up (it imports nothing
# unless the variable is set). It is added to regular wheels by build_py and to editable
# wheels by editable_wheel (which does not copy top-level files of build_lib).
PTH_SOURCE = os.path.join("src", "instride", "interception", "patch_open.pth")
PTH_NAME = "instride-patch-open.pth"


# The C/C++ headers go into regular wheels as instride/include/instride/* (an editable
# install finds them in the source tree's include/ instead).
PUBLIC_HEADERS = sorted(glob.glob("include/instride/*"))


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(PTH_SOURCE, os.path.join(self.build_lib, PTH_NAME))
        dest = os.path.join(self.build_lib, "instride", "include", "instride")
        self.mkpath(dest)
        for header in PUBLIC_HEADERS:
            self.copy_file(header, os.path.join(dest, os.path.basename(header)))

    def _header_outputs(self) -> list[str]:
        dest = os.path.join(self.build_lib, "instride", "include", "instride")
        return [os.path.join(dest, os.path.basename(h)) for h in PUBLIC_HEADERS]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME),
                *self._header_outputs()]


cmdclass: dict[str, type] = {"build_ext": BuildPreload, "build_py": BuildPyWithPth}

try:
    from setuptools.command.editable_wheel import editable_wheel

    class EditableWheelWithPth(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            shutil.copyfile(PTH_SOURCE, os.path.join(unpacked_wheel, PTH_NAME))
            return result

    cmdclass["editable_wheel"] = EditableWheelWithPth
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    pass

setup(ext_modules=extensions, cmdclass=cmdclass)
