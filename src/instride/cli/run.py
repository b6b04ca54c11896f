"""``instride run`` and ``instride preload-path``: unmodified programs with the preload library."""

from __future__ import annotations

import argparse
import errno
import os
import shutil
import sys

from . import TIMEOUT_HELP, timeout_arg


def cmd_preload_path(args: argparse.Namespace) -> int:
    from ..interception.preload import build_flags, preload_path

    if args.cflags or args.libs:  # flags for C/C++ programs using instride.h / stream.hpp
        print(" ".join(build_flags(cflags=args.cflags, libs=args.libs)))
    else:
        print(preload_path())
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from ..config import Settings
    from ..errors import ConfigError
    from ..interception.preload import preload_env
    from ..store import ensure_private_dir

    argv = list(args.cmd)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("instride run: error: no command given (instride run -- CMD ARGS...)", file=sys.stderr)
        return 2
    extra: dict[str, str] = {}
    if args.dir:
        extra["INSTRIDE_DIR"] = os.path.abspath(args.dir)
    if args.timeout is not None:
        extra["INSTRIDE_TIMEOUT"] = str(args.timeout)
    if args.overwrite:
        extra["INSTRIDE_OVERWRITE"] = "1"
    if args.patch_python_open:
        extra["INSTRIDE_PATCH_OPEN"] = "1"
    env = preload_env(extra)
    # GROMACS backs up an existing output file first, and checks whether it exists with
    # fopen(path, "r"): a read, which waits for the key. -1: no backup, no check.
    env.setdefault("GMX_MAXBACKUP", "-1")
    settings = Settings.from_env(env)  # validates the settings before the program starts
    env["INSTRIDE_DIR"] = str(settings.dir)
    try:  # (made 0700, and refused where another user could plant or take keys: a link,
        # another user's directory, one its group or every user may write; as any client's)
        ensure_private_dir(settings.dir)
    except ConfigError as exc:  # (/proc/x, a file on the way, no permission: a bad setting)
        raise ConfigError("--dir" if args.dir else "INSTRIDE_DIR", str(settings.dir),
                          f"the managed directory: {exc.reason}") from None
    # A quoted '$INSTRIDE_DIR' reaches us unexpanded: fill in the managed directory, so the
    # command works in a shell where the variable is not set (or with --dir).
    argv = [a.replace("${INSTRIDE_DIR}", env["INSTRIDE_DIR"]).replace("$INSTRIDE_DIR", env["INSTRIDE_DIR"])
            for a in argv]
    exe = shutil.which(argv[0], path=env.get("PATH"))
    if exe is None and "/" in argv[0] and os.path.lexists(argv[0]):
        exe = argv[0]  # not executable: execve says why (as a shell does, status 126)
    if exe is None:
        print(f"instride run: error: command not found: {argv[0]}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(exe, argv, env)  # the program keeps our PID; signals reach it directly
    except OSError as exc:  # as a shell: 127 when a file is missing (an interpreter), else 126
        why = "Is a directory" if os.path.isdir(exe) else exc.strerror
        print(f"instride run: error: cannot execute {argv[0]}: {why}", file=sys.stderr)
        return 127 if exc.errno == errno.ENOENT else 126
    return 0  # pragma: no cover


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preload-path", help="print the path of libinstride_preload.so",
        description="Print the path of libinstride_preload.so, or with --cflags/--libs the "
        "flags to build a C/C++ program with instride/instride.h or instride/stream.hpp: "
        "cc prog.c $(instride preload-path --cflags --libs)",
    )
    p.add_argument("--cflags", action="store_true", help="print -I<include dir>")
    p.add_argument("--libs", action="store_true",
                   help="print -L<dir> -Wl,-rpath,<dir> -linstride (libinstride.so, the C API)")
    p.set_defaults(func=cmd_preload_path)

    p = sub.add_parser(
        "run",
        help="run an unmodified program with the preload library",
        description="Run CMD with libinstride_preload.so preloaded and the instride environment "
        "set: its opens of files under the managed directory wait for publication (reads) or "
        "publish on close (writes). A quoted '$INSTRIDE_DIR' in CMD's arguments is replaced "
        "by the managed directory (the calling shell would expand an unquoted one, to nothing "
        "if it is not set there): instride run -- cp a.dat '$INSTRIDE_DIR/run7/a.dat'. "
        "GMX_MAXBACKUP=-1 is set unless it is set already (GROMACS would wait for each output "
        "key: it checks whether the file exists with a read open). Exit "
        "status: CMD's own; as a shell, 127 when CMD is not found and 126 when it cannot be "
        "executed.",
    )
    p.add_argument("--dir", help="managed directory (default: INSTRIDE_DIR)")
    p.add_argument("--timeout", type=timeout_arg,
                   help="the command's consume timeout (INSTRIDE_TIMEOUT for it): " + TIMEOUT_HELP)
    p.add_argument("--overwrite", action="store_true",
                   help="let writes replace published keys (INSTRIDE_OVERWRITE=1)")
    p.add_argument("--patch-python-open", action="store_true",
                   help="also route Python's open() through instride (INSTRIDE_PATCH_OPEN=1)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                   help="the program and its arguments")
    p.set_defaults(func=cmd_run)
