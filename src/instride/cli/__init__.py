"""The ``instride`` command.

Each command parses its arguments, calls one library function and prints. Heavy imports
(numpy-based benchmarks, OpenMM, MDAnalysis) happen inside the command that needs them, so
``instride --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import InstrideError

Handler = Callable[[argparse.Namespace], int]
#: Extra command groups: module path of a function ``add_parser(subparsers)``.
_PLUGINS = [
    "instride.cli.keys",  # info, ls, wait, cat, gc
    "instride.cli.serve",  # serve
    "instride.cli.cluster",  # cluster up/down/exec/status
    "instride.cli.run",  # run, preload-path
    "instride.cli.md",  # demo, imd-bridge
    "instride.cli.bench",  # bench run/study
    "instride.cli.analyze",  # analyze, export
    "instride.cli.archive",  # archive
    "instride.cli.flow",  # flow run/check/draw, top
    "instride.cli.job",  # job (Slurm / mpiexec services)
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``instride`` command."""
    parser = argparse.ArgumentParser(
        prog="instride",
        description="Producer/consumer data movement for in situ MD workflows.",
        epilog="Settings come from INSTRIDE_* environment variables; see `instride info`.",
    )
    parser.add_argument("--version", action="version", version=f"instride {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for name in _PLUGINS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``instride`` command; return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.func
    try:
        return handler(args)
    except InstrideError as exc:
        print(f"instride: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
