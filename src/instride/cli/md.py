"""Commands of the MD group: ``instride demo`` and ``instride imd-bridge``."""

from __future__ import annotations

import argparse
import sys


def cmd_demo(args: argparse.Namespace) -> int:
    from ..md.demo import run_demo

    run_demo(
        args.out, steps=args.steps, interval=args.interval, replicas=args.replicas,
        threads=args.threads, baseline=not args.no_baseline, timeout=args.timeout,
    )
    return 0


def cmd_imd_bridge(args: argparse.Namespace) -> int:
    from ..md.imd import bridge, natoms_from_gro

    if (args.natoms is None) == (args.gro is None):
        print("instride imd-bridge: give exactly one of --natoms or --gro", file=sys.stderr)
        return 2
    try:
        natoms = args.natoms if args.natoms is not None else natoms_from_gro(args.gro)
    except (OSError, ValueError) as exc:
        print(f"instride imd-bridge: {exc}", file=sys.stderr)
        return 2
    report = bridge(
        args.address, args.stream, natoms, dt=args.dt, first_step=args.first_step,
        connect_timeout=args.connect_timeout, timeout=args.timeout, layout=args.layout,
        overwrite=args.overwrite,
    )
    print(
        f"{report.frames} frames ({report.bytes} bytes, IMD v{report.imd_version}) published "
        f"to {report.stream} in {report.seconds:.2f} s; end-of-stream written"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo`` and ``imd-bridge`` to the ``instride`` command."""
    p = subparsers.add_parser(
        "demo",
        help="two OpenMM replicas with concurrent in situ analytics, vs. files + barriers",
        description=(
            "Run two OpenMM replicas of the villin system shipped with OpenMM, each streamed "
            "into an analytics consumer (RMSD, radius of gyration, distance-matrix "
            "eigenvalues) running concurrently, then the same workflow through plain files "
            "and a pairwise barrier per frame. Writes tables, plots and a summary to --out. "
            "Uses INSTRIDE_DIR if set, else a temporary managed directory."
        ),
    )
    p.add_argument("--out", default="demo-output", help="output directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=600, help="MD steps per replica (%(default)s)")
    p.add_argument("--interval", type=int, default=10, help="steps between frames (%(default)s)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (%(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica (%(default)s)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a consumer waits for one frame (%(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the files+barrier run")
    p.set_defaults(func=cmd_demo)

    p = subparsers.add_parser(
        "imd-bridge",
        help="publish the frames of an MD engine's IMD socket (GROMACS) into a stream",
        description=(
            "Connect to an engine started with IMD (gmx mdrun -imdport PORT -imdwait), "
            "publish every frame it sends into STREAM, and end the stream when the engine "
            "terminates."
        ),
    )
    p.add_argument("address", metavar="HOST:PORT", help="the engine's IMD address")
    p.add_argument("stream", metavar="STREAM", help="stream name to publish into")
    p.add_argument("--natoms", type=int, help="atoms per frame (size of the IMD group)")
    p.add_argument("--gro", help="take the atom count from this .gro file (IMD-group = System)")
    p.add_argument("--dt", type=float, default=None,
                   help="ps per MD step, for frame times (IMD v2 sends none)")
    p.add_argument("--first-step", type=int, default=0,
                   help="step of the first frame (IMD v2 sends no step; default %(default)s)")
    p.add_argument("--layout", choices=["xyz32", "paper"], default="xyz32")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier stream")
    p.add_argument("--connect-timeout", type=float, default=60.0,
                   help="seconds to retry connecting (%(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds without a frame before giving up (%(default)s)")
    p.set_defaults(func=cmd_imd_bridge)
