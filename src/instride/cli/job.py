"""``instride job``: start a job's instride services around a command (Slurm, mpiexec)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: options of starting services (name -> default): ``--cleanup`` uses none of them
_START_OPTIONS = {"launcher": "auto", "hostfile": None, "mpiexec": None, "dir": None,
                  "port": 7437, "iface": None, "ready_timeout": 60.0, "dry_run": False}


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_options(args: argparse.Namespace, command: list[str]) -> None:
    """Refuse options that the chosen mode would ignore (a ``--dry-run`` that ``--cleanup``
    ignored killed the live service it was meant to show)."""
    from ..errors import ConfigError

    if args.cleanup:
        given = [_option(k) for k, default in _START_OPTIONS.items()
                 if getattr(args, k) != default]
        if given:
            raise ConfigError(given[0], getattr(args, given[0][2:].replace("-", "_")),
                              "--cleanup stops this node's recorded service and takes no "
                              f"option of starting one ({', '.join(given)}); --cleanup has "
                              "no dry run")
        if command:
            raise ConfigError("command", " ".join(command),
                              "--cleanup runs no command: give one without --cleanup")
    elif args.only_job is not None:
        raise ConfigError("--only-job", args.only_job, "only goes with --cleanup")
    if args.launcher == "slurm":
        for name in ("hostfile", "mpiexec"):
            if getattr(args, name) is not None:
                raise ConfigError(_option(name), getattr(args, name),
                                  "is an option of --launcher mpiexec, not slurm")


def _state_dir(args: argparse.Namespace) -> Path:
    """The state directory, checked: an unusable one is a bad option or setting (exit 2)."""
    from ..errors import ConfigError
    from ..launch.agent import check_state_dir, state_dir
    from ..launch.base import LaunchError

    states = Path(args.state_dir) if args.state_dir else state_dir()
    try:
        check_state_dir(states, create=False)  # (a missing one is fine: made when needed)
    except LaunchError as exc:
        name = "--state-dir" if args.state_dir else "INSTRIDE_JOB_STATE_DIR"
        raise ConfigError(name, str(states), str(exc)) from None
    return states


def cmd_job(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    _check_options(args, command)
    states = _state_dir(args)
    if args.cleanup:
        from ..launch.agent import cleanup_node

        record = cleanup_node(states=states, job=args.only_job)
        if record is None:
            of = f" for job {args.only_job}" if args.only_job else ""
            print(f"instride job: no instride service recorded on this node{of}")
        else:
            print(f"instride job: stopped the service of job {record.get('job', '?')} and "
                  f"removed {record.get('dir', 'nothing')}")
        return 0
    from ..launch import services

    svc = services(args.launcher, hostfile=args.hostfile, dir_pattern=args.dir, port=args.port,
                   iface=args.iface, ready_timeout=args.ready_timeout, state_dir=args.state_dir,
                   mpiexec=args.mpiexec)
    if args.dry_run:
        svc.detect()
        print(svc.describe())
        return 0
    if not command:
        print("instride job: error: give the command to run after --", file=sys.stderr)
        return 2
    return svc.run(command)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "job",
        help="run a command with the job's instride services up on every node (Slurm, mpiexec)",
        description="Inside an allocation: start Redis on this (the first) node, one "
                    "`instride serve` per node and a fresh job token; run COMMAND with the "
                    "settings its job steps need (srun steps get their node's INSTRIDE_DIR/ADDR/"
                    "NODE from a task prolog; mpiexec ranks by prefixing $INSTRIDE_NODE_ENV); "
                    "stop everything when COMMAND ends, fails or the job is cancelled; stop "
                    "COMMAND when a node's service ends under it. Exit status: COMMAND's "
                    "(128+N after signal N); 2 for a bad option or setting, or outside an "
                    "allocation; 6 when Redis cannot be reached or a node's service did not "
                    "start or ended; 1 for any other error.",
        epilog="example (in an sbatch script): instride job -- sh -c 'srun -N1 -w $(hostname) "
               "producer & srun -N1 consumer; wait'",
    )
    p.add_argument("--launcher", choices=("auto", "slurm", "mpiexec"), default="auto",
                   help="auto: slurm inside a Slurm job, mpiexec with --hostfile")
    p.add_argument("--hostfile", metavar="FILE",
                   help="mpiexec host file (one host per line; run on the first host)")
    p.add_argument("--mpiexec", metavar="PATH",
                   help="the mpiexec to use (default: the one next to Python, else on PATH)")
    p.add_argument("--dir", metavar="PATTERN", default=None,
                   help="managed directory on every node, %%n = node, %%j = job id (default: "
                        "$INSTRIDE_JOB_DIR or /dev/shm/instride-<uid>-job%%j)")
    p.add_argument("--port", type=int, default=7437, help="data server port (default 7437)")
    p.add_argument("--iface", metavar="NAME", default=None,
                   help="interface the data servers listen on, e.g. ib0 (default: the address "
                        "on the route to Redis)")
    p.add_argument("--ready-timeout", type=float, default=60.0, metavar="S",
                   help="seconds the services have to start (default 60)")
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="node-local directory of service records, mode 0700 (default "
                        "$INSTRIDE_JOB_STATE_DIR or /tmp/instride-<uid>-services; in a Slurm "
                        "Epilog, which runs as root: /tmp/instride-$SLURM_JOB_UID-services)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be started, start nothing")
    p.add_argument("--cleanup", action="store_true",
                   help="stop this node's recorded service and remove its directory (for a "
                        "Slurm Epilog or after a crash), then exit")
    p.add_argument("--only-job", metavar="ID", default=None,
                   help="with --cleanup: only a service of job ID (in an Epilog: "
                        "$SLURM_JOB_ID), never another job's")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command to run on this node with the services up")
    p.set_defaults(func=cmd_job)
