"""``instride bench run`` and ``instride bench study``: the paper's workflow benchmark."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any


def _print_summary(summary: dict[str, Any]) -> None:
    cfg = summary["config"]
    print(f"{cfg['name']}: {cfg['frames']} frames x {cfg['pairs']} pair(s) x "
          f"{cfg['repetitions']} repetition(s), frame {cfg['frame_bytes']} B, "
          f"period {cfg['frame_period_s'] * 1e3:.1f} ms")
    print(f"{'role':10} {'movement ms':>12} {'idle ms':>10} {'idle after 1st':>15} "
          f"{'overall ms':>11} {'wall s':>8}")
    for role in ("producer", "consumer"):
        s = summary[role]
        steady = s.get("idle_steady_s")
        steady_text = f"{steady * 1e3:15.3f}" if steady is not None else f"{'n/a':>15}"
        print(f"{role:10} {s['movement_s'] * 1e3:12.3f} {s['idle_s'] * 1e3:10.3f} "
              f"{steady_text} {s['overall_s'] * 1e3:11.3f} {s['wall_s']:8.2f}")
    fr = summary["frames"]
    print(f"frames verified: {fr['verified']}/{fr['expected']}")
    for where in summary.get("frames_kept") or ():
        print(f"frames kept in {where}")


def cmd_run(args: argparse.Namespace) -> int:
    from ..bench.workflow_run import RunConfig, run
    from ..errors import ConfigError

    if args.workdir is not None and args.nodes > 1:  # (emulated nodes use their own: ignored)
        raise ConfigError("--workdir", args.workdir,
                          "only one-node runs use it; on emulated nodes each node's managed "
                          "directory (and the cluster's shared one) hold the data")

    # --model and --atoms exclude each other; with neither, the model is JAC (the help says so)
    model = args.model if args.model is not None or args.atoms is not None else "JAC"
    cfg = RunConfig(
        model=model, atoms=args.atoms, stride=args.stride,
        steps_per_second=args.steps_per_second, frames=args.frames, pairs=args.pairs,
        nodes=args.nodes, backend=args.backend, sync=args.sync,
        sharedfs_kind=args.sharedfs_kind, repetitions=args.repetitions,
        time_scale=args.time_scale, sleep=args.sleep, fsync=args.fsync,
        keep_frames=args.keep_frames, timeout=args.timeout, workdir=args.workdir,
    )
    out = args.out or f"bench-out/{cfg.validate().name}"
    summary = run(cfg, out, progress=not args.quiet)
    _print_summary(summary)
    print(f"results in {out}/ (timings.csv, ranks.csv, summary.json)")
    return 0


def cmd_study(args: argparse.Namespace) -> int:
    from ..bench.study import EXPERIMENTS, run_study
    from ..errors import ConfigError

    if args.launcher == "slurm":  # (both were switched or left out silently)
        if args.sharedfs_kind == "sshfs":
            raise ConfigError("--sharedfs-kind", args.sharedfs_kind,
                              "--launcher slurm runs sharedfs in the Slurm cluster's shared "
                              "directory: leave it out, or give dir")
        if args.workdir is not None:
            raise ConfigError("--workdir", args.workdir,
                              "--launcher slurm keeps node-local data in each node's /dev/shm")
    experiments = tuple(args.experiments.split(",")) if args.experiments else EXPERIMENTS
    command = "instride " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    study = run_study(
        args.preset, args.out, experiments=experiments, repetitions=args.repetitions,
        workdir=args.workdir, progress=not args.quiet, command=command,
        sharedfs_kind=args.sharedfs_kind, launcher=args.launcher, sync=args.sync,
    )
    print(f"{len(study['results'])} configurations in {study['elapsed_s'] / 60:.1f} min; "
          f"report: {args.out}/report.md")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add the ``bench`` command group (``run``, ``study``)."""
    bench = subparsers.add_parser(
        "bench", help="the paper's producer/consumer workflow benchmark",
        description="Reproduce the DYAD data-movement study: instride vs node-local and "
                    "shared file systems with explicit MPI synchronization.",
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("run", help="run one workflow configuration")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None,
                   help="JAC, ApoA1, F1-ATPase or STMV (Table I; default JAC)")
    g.add_argument("--atoms", type=int, default=None, help="custom atom count (JAC's timing)")
    p.add_argument("--stride", type=int, default=None,
                   help="MD steps per frame (default: Table II)")
    p.add_argument("--steps-per-second", type=float, default=None,
                   help="MD steps per second (default: Table I)")
    p.add_argument("--frames", type=int, default=128, help="frames per pair (paper: 128)")
    p.add_argument("--pairs", type=int, default=1, help="producer/consumer pairs")
    p.add_argument("--nodes", type=int, default=1,
                   help="1, or an even number of emulated nodes (producers on half)")
    p.add_argument("--backend", choices=("instride", "localfs", "sharedfs"), default="instride")
    p.add_argument("--sync", choices=("serialized", "pipelined"), default="serialized",
                   help="file systems' pair synchronization: serialized (default, the paper's: "
                        "a barrier after the write and one after the analytics, MD and "
                        "analytics never overlap) or pipelined (one barrier per frame)")
    p.add_argument("--sharedfs-kind", choices=("auto", "sshfs", "dir"), default="auto",
                   help="sharedfs as a storage server mounted with sshfs over the emulated "
                        "network (sshfs; needs --nodes >= 2) or a plain shared directory (dir); "
                        "auto: sshfs on >= 2 nodes, dir on one")
    p.add_argument("--repetitions", type=int, default=1, help="runs (paper: 10)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply MD/analytics sleeps (1 = a frame every 0.82 s; e.g. 0.01); "
                        "data movement is not scaled")
    p.add_argument("--sleep", choices=("stride", "step"), default="stride",
                   help="one MD sleep per frame (default) or per step (absolute deadlines)")
    p.add_argument("--fsync", action="store_true", help="fsync every frame (all backends)")
    p.add_argument("--keep-frames", action="store_true",
                   help="keep the frames after the run (one node with --workdir; elsewhere "
                        "until their repetition ends)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds any wait may take before the run fails (inf: no limit)")
    p.add_argument("--workdir", default=None,
                   help="node-local data directory of a one-node run (default /dev/shm); "
                        "refused with --nodes >= 2, whose nodes have their own")
    p.add_argument("--out", default=None,
                   help="output directory (default bench-out/<name>); replaced only by a "
                        "complete run")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("study", help="run the paper's five experiments and write a report")
    p.add_argument("--preset", choices=("small", "paper", "tiny"), default="small",
                   help="small: about 7 min on 2 cores (docs/reproduction.md records a "
                        "measured run); paper: the paper's scale; tiny: smoke test")
    p.add_argument("--out", default="bench-study", help="report directory")
    p.add_argument("--experiments", default=None,
                   help="comma-separated subset of single_node,two_node,multi_node,"
                        "model_scaling,stride_scaling")
    p.add_argument("--repetitions", type=int, default=None, help="override the preset's")
    p.add_argument("--sharedfs-kind", choices=("sshfs", "dir"), default=None,
                   help="sharedfs on emulated nodes: sshfs (default: a storage server mounted "
                        "over the network) or dir (a plain shared directory, no data movement);"
                        " --launcher slurm: always the Slurm cluster's shared directory")
    p.add_argument("--sync", choices=("serialized", "pipelined"), default=None,
                   help="file systems' pair synchronization (default serialized, the paper's; "
                        "pipelined: one barrier per frame)")
    p.add_argument("--workdir", default=None,
                   help="node-local data directory of the one-node runs (default /dev/shm; "
                        "emulated nodes have their own); refused with --launcher slurm")
    p.add_argument("--launcher", choices=("emulated", "slurm"), default="emulated",
                   help="emulated: mpiexec inside emulated nodes; slurm: every repetition a "
                        "batch job on a real Slurm of emulated nodes (needs slurm-wlm, munge)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_study)


__all__ = ["add_parser", "cmd_run", "cmd_study"]
