"""Commands of the MD group: ``instride demo``, ``instride imd-bridge`` and ``instride imd-serve``."""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import signal
import sys

from . import (
    EXIT_HUNG_UP,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    HungUp,
    md_step_ps,
    no_limit_as_none,
    positive_int,
    positive_seconds,
    timeout_arg,
)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..md.demo import run_demo

    run_demo(
        args.out, steps=args.steps, interval=args.interval, replicas=args.replicas,
        threads=args.threads, baseline=not args.no_baseline, timeout=args.timeout,
    )
    return 0


def cmd_imd_bridge(args: argparse.Namespace) -> int:
    from ..md.imd_bridge import bridge, natoms_from_gro

    if (args.natoms is None) == (args.gro is None):
        print("instride imd-bridge: give exactly one of --natoms or --gro", file=sys.stderr)
        return 2
    try:
        natoms = args.natoms if args.natoms is not None else natoms_from_gro(args.gro)
    except (OSError, ValueError) as exc:
        print(f"instride imd-bridge: {exc}", file=sys.stderr)
        return EXIT_INVALID  # an unreadable or bad .gro file: invalid input
    report = bridge(
        args.address, args.stream, natoms, dt=args.dt, first_step=args.first_step, every=args.every,
        connect_timeout=args.connect_timeout,
        timeout=math.inf if args.timeout is None else args.timeout, layout=args.layout,
        overwrite=args.overwrite,
    )
    print(
        f"{report.frames} frames ({report.bytes} bytes, IMD v{report.imd_version}) published "
        f"to {report.stream} in {report.seconds:.2f} s; end-of-stream written"
    )
    return 0


#: seconds imd-serve may take to stop after SIGTERM before it dumps its threads and exits
_STOP_WATCHDOG_S = 40


def cmd_imd_serve(args: argparse.Namespace) -> int:
    from ..md.imd_server import ClientReport, IMDServer, serve

    def ready(server: IMDServer) -> None:
        print(f"serving stream {server.stream} on {server.address} (IMD v{server.version}, "
              f"clients start at the {server.start_at} frame)", flush=True)

    def done(r: ClientReport) -> None:
        how = "end of stream" if r.ended else f"stopped: {r.error}"
        missed = f" ({r.missed} retired before it was sent them)" if r.missed else ""
        print(f"client {r.peer}: {r.frames} frames{missed} in {r.seconds:.2f} s, {how}", flush=True)

    stopped_by: list[int] = []

    def stop(signum: int, frame: object) -> None:
        # A stop must never hang: should closing the sessions take longer than this, every
        # thread's stack goes to stderr and the process exits (status 1) -- for SIGTERM,
        # Ctrl-C and SIGHUP alike.
        faulthandler.dump_traceback_later(_STOP_WATCHDOG_S, exit=True)
        stopped_by.append(signum)
        raise HungUp if signum == signal.SIGHUP else KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            signal.signal(sig, stop)
    try:
        reports = serve(
            args.stream, host=args.host, port=args.port, version=args.imd_version, start=args.start,
            clients=args.clients, timeout=no_limit_as_none(args.timeout), dt=args.dt, on_ready=ready,
            on_client_done=done, max_clients=args.max_clients,
        )
    except KeyboardInterrupt:
        print("imd-serve: stopped", flush=True)
        sys.stderr.flush()
        # Every session is closed and its threads joined (or given up on after 5 s): leave
        # now rather than wait at interpreter shutdown on a session thread still blocked.
        # SIGTERM is how a server is stopped (status 0); Ctrl-C is an interruption (130);
        # SIGHUP (its terminal closed) 129, as for every command.
        first = stopped_by[0] if stopped_by else signal.SIGINT
        os._exit(0 if first == signal.SIGTERM else EXIT_HUNG_UP if first == signal.SIGHUP
                 else EXIT_INTERRUPTED)
    print(f"served {len(reports)} clients", flush=True)
    return 0


def _listen_host(text: str) -> str:
    """``--host`` of ``imd-serve``: an address written out (an empty one would listen on
    every interface, unannounced: write ``0.0.0.0`` for that) (argparse type)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty address listens on every interface; "
                                         "write 0.0.0.0 to mean that")
    return text.strip()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``demo``, ``imd-bridge`` and ``imd-serve`` to the ``instride`` command."""
    p = subparsers.add_parser(
        "demo",
        help="two OpenMM replicas with concurrent in situ analytics, vs. files + barriers",
        description=(
            "Run two OpenMM replicas of the villin system shipped with OpenMM (3 ps each by "
            "default), each streamed into an analytics consumer (RMSD, radius of gyration, "
            "distance-matrix eigenvalues) running concurrently, then the same workflow through "
            "plain files and a pairwise barrier per frame, and check that both workflows "
            "simulated the same trajectories. Writes tables, science and performance plots and "
            "a summary to --out. Uses INSTRIDE_DIR if set, else a temporary managed directory. "
            "Takes about 3 minutes on an idle 2-core machine."
        ),
    )
    p.add_argument("--out", default="demo-output", help="output directory (default: %(default)s)")
    p.add_argument("--steps", type=int, default=1500,
                   help="MD steps of 2 fs per replica (%(default)s = 3 ps)")
    p.add_argument("--interval", type=int, default=15, help="steps between frames (%(default)s)")
    p.add_argument("--replicas", type=int, default=2, help="replicas (%(default)s)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per replica (%(default)s)")
    p.add_argument("--timeout", type=positive_seconds, default=300.0,
                   help="seconds a consumer waits for one frame (%(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip the files+barrier run")
    p.set_defaults(func=cmd_demo)

    p = subparsers.add_parser(
        "imd-bridge",
        help="publish the frames of an MD engine's IMD socket (GROMACS, LAMMPS) into a stream",
        description=(
            "Connect to an engine started with IMD (gmx mdrun -imdport PORT -imdwait; LAMMPS "
            "fix imd), publish every frame it sends into STREAM, and end the stream when the "
            "engine terminates. Speaks IMD v2 (GROMACS 2022, LAMMPS 2021) and v3 (LAMMPS fix "
            "imd ... version 3, GROMACS 2025, NAMD 3); v3 frames bring their own step, time "
            "and box."
        ),
    )
    p.add_argument("address", metavar="HOST:PORT", help="the engine's IMD address")
    p.add_argument("stream", metavar="STREAM", help="stream name to publish into")
    p.add_argument("--natoms", type=int, help="atoms per frame (size of the IMD group)")
    p.add_argument("--gro", help="take the atom count from this .gro file (IMD-group = System)")
    p.add_argument("--dt", type=md_step_ps, default=None,
                   help="ps per MD step, for frame times (IMD v2 sends none)")
    p.add_argument("--first-step", type=int, default=0,
                   help="step of the first frame (IMD v2 sends no step; GROMACS: 0, LAMMPS: 1; "
                        "default %(default)s)")
    p.add_argument("--every", type=positive_int, default=1,
                   help="MD steps between two IMD v2 frames (the engine's transmission rate; "
                        "default %(default)s)")
    p.add_argument("--layout", choices=["xyz32", "paper"], default="xyz32")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier stream")
    p.add_argument("--connect-timeout", type=positive_seconds, default=60.0,
                   help="seconds to retry connecting (%(default)s)")
    p.add_argument("--timeout", type=timeout_arg, default=600.0,
                   help="seconds without a frame before giving up (%(default)s; inf: as long "
                        "as the engine's connection is open; 0 is refused)")
    p.set_defaults(func=cmd_imd_bridge)

    p = subparsers.add_parser(
        "imd-serve",
        help="serve a stream over IMD v3 to imd:// clients (MDAnalysis), any number at once",
        description=(
            "Listen for IMD clients and send each the frames of STREAM (time, step, box, "
            "positions), from the first frame or the newest one, at the client's own pace; "
            "when the producer ends the stream, each client's iteration ends after the last "
            "frame. MDAnalysis reads it with mda.Universe(TOPOLOGY, 'imd://HOST:PORT'). "
            "Runs until stopped (SIGTERM: exit status 0; Ctrl-C: 130) or until --clients "
            "sessions have ended. A client that takes no data of a frame for 60 s (or "
            "--timeout, if longer) is disconnected."
        ),
    )
    p.add_argument("stream", metavar="STREAM", help="stream to serve (it may not exist yet)")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on (0: any free port)")
    p.add_argument("--host", type=_listen_host, default="127.0.0.1",
                   help="address to listen on (default %(default)s; 0.0.0.0 for other nodes: "
                        "IMD has no authentication)")
    p.add_argument("--start", choices=["first", "newest"], default="first",
                   help="where a new client starts (default %(default)s)")
    p.add_argument("--imd-version", type=int, choices=[2, 3], default=3,
                   help="IMD version to speak (default %(default)s; MDAnalysis needs 3)")
    p.add_argument("--clients", type=positive_int, default=None,
                   help="exit after this many client sessions have ended (default: run until stopped)")
    p.add_argument("--timeout", type=timeout_arg, default=None,
                   help="seconds (above 0) a session waits for the producer's next frame; "
                   "inf: forever (default: no limit)")
    p.add_argument("--dt", type=md_step_ps, default=None,
                   help="ps per MD step sent in the TIME packet (default: from consecutive frames)")
    p.add_argument("--max-clients", type=int, default=64,
                   help="client sessions at once; one more is refused (its connection closed) "
                   "and may connect again later (default %(default)s)")
    p.set_defaults(func=cmd_imd_serve)
