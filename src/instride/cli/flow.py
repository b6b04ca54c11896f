"""``instride flow run/check/draw`` and ``instride top`` (a plugin of :mod:`instride.cli`).

``instride flow run GRAPH.py [--out DIR] [--param KEY=VALUE ...] [--cluster NAME]`` loads a
graph file (it defines ``graph`` or ``build(**params)``), validates it and runs it: on this
machine, on the emulated nodes of ``instride cluster up --name NAME``, or as job steps of the
Slurm allocation it runs in (``instride job -- instride flow run ...``). ``instride top`` shows
the counters of a running graph, refreshed every second.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from . import positive_seconds, timeout_arg


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _graph(args: argparse.Namespace) -> Any:
    from ..flow import load_graph

    return load_graph(args.graph, dict(args.param or []))


def _launcher(args: argparse.Namespace) -> Any:
    """``--launcher``, else emulated with ``--cluster``, Slurm inside an allocation, local."""
    from ..errors import ConfigError
    from ..flow import EmulatedLauncher, LocalLauncher, SlurmLauncher

    kind = args.launcher or ("emulated" if args.cluster else
                             "slurm" if os.environ.get("SLURM_JOB_ID") else "local")
    if kind == "emulated":
        if not args.cluster:
            raise ConfigError("--launcher", kind, "the emulated launcher needs --cluster NAME")
        return EmulatedLauncher(args.cluster)
    if args.cluster:
        raise ConfigError("--cluster", args.cluster, f"--cluster is for the emulated launcher, not {kind!r}")
    return SlurmLauncher() if kind == "slurm" else LocalLauncher()


def cmd_run(args: argparse.Namespace) -> int:
    from ..flow import run
    from ..flow.monitor import render, rows

    graph = _graph(args)
    launcher = _launcher(args)
    started = time.time()
    # (inf as given: the run has no limit, and neither do the writers' puts, whatever
    # INSTRIDE_TIMEOUT says)
    result = run(graph, out=args.out, launcher=launcher, timeout=args.timeout,
                 keep_streams=args.keep_streams, trace=not args.no_trace,
                 on_event=None if args.quiet else lambda line: print(line, flush=True))
    table = rows({"stats": result.stats, "run": {}, "taken": time.time()})
    print(render(table, title=f"graph {graph.name}: {len(result.stats)} instances, "
                             f"{result.seconds:.2f} s ({time.time() - started:.2f} s total)"))
    if result.out:
        print(f"trace: {result.out / 'trace.json'} (open in https://ui.perfetto.dev)")
        print(f"timeline: {result.out / 'timeline.png'}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    graph = _graph(args)
    graph.validate(args.nodes.split(",") if args.nodes else None)
    print(f"graph {graph.name}: {len(graph.modules)} modules, "
          f"{len(graph.instances())} instances, {len(graph.edges)} connections: valid")
    for m in graph.modules.values():
        what = m.target or " ".join(m.command or [])
        print(f"  {m.name} x{m.instances}: {what}")
    return 0


def cmd_draw(args: argparse.Namespace) -> int:
    from ..flow.draw import draw

    graph = _graph(args)
    graph.validate()  # what cannot run is not drawn either
    print(draw(graph, args.output))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..flow import FlowError, UnknownRunError
    from ..flow.monitor import live_runs, other_hosts_runs, remote_state, render, rows, runner_alive, snapshot
    from ..flow.runner import state_roots

    if args.run:
        named = Path(args.run)
        where = [named] if named.is_absolute() else [root / args.run for root in state_roots()]
        found = [p for p in where if (p / "run.json").is_file()]
        if not found:
            raise UnknownRunError(
                f"no run {args.run!r} is recorded (looked in {', '.join(map(str, where))}): it "
                "never started or has ended; `instride top` without RUN shows the newest")
        run_dir = found[0]
    else:
        runs = live_runs()
        if not runs:
            print("no graph is running on this host (start one with `instride flow run "
                  "GRAPH.py`)")
            elsewhere = other_hosts_runs()
            if elsewhere:  # (their runners cannot be checked from here: named, not guessed)
                print("recorded by other hosts, alive or not (`instride top RUN` shows one): "
                      + ", ".join(f"{p.name} ({h})" for p, h in elsewhere))
            return 1
        run_dir = runs[-1]
    tty = sys.stdout.isatty()
    previous = None
    while (run_dir / "run.json").exists():
        try:
            snap = snapshot(run_dir)
        except (OSError, ValueError):
            break
        if runner_alive(snap["run"]) is False and (run_dir / "run.json").exists():
            raise FlowError(
                f"run {run_dir.name}: its runner (pid {snap['run']['pid']}) is gone but the run "
                "is still recorded: it was killed (SIGKILL); the next `instride flow run` here "
                "removes what it left")
        # (a run of another host: its runner is not known alive — said, not shown as live)
        remote = remote_state(snap)
        text = render(rows(snap, previous),
                      title=f"{snap['run']['graph']} ({run_dir.name}) "
                            f"{time.strftime('%H:%M:%S')}" + (f"\n{remote}" if remote else ""))
        print(("\x1b[H\x1b[2J" if tty else "") + text + ("" if tty else "\n"), flush=True)
        if args.once:
            return 0
        previous = snap
        time.sleep(args.interval)
    print(f"run {run_dir.name} has ended")
    return 0


def add_parser(sub: Any) -> None:
    """Register ``flow`` and ``top``."""
    p = sub.add_parser("flow", help="dataflow graphs: run, check, draw",
                       description="Dataflow graphs of modules connected by ports.")
    fsub = p.add_subparsers(dest="flow_command", metavar="SUBCOMMAND", required=True)

    def graph_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("graph", help="graph file: defines `graph` or `build(**params)`")
        q.add_argument("--param", "-p", action="append", type=_param, metavar="KEY=VALUE",
                       help="keyword argument for build() (JSON value or string); repeatable")

    r = fsub.add_parser("run", help="validate and run a graph",
                        description="Validate a graph file and run it to completion.")
    graph_args(r)
    r.add_argument("--out", "-o", help="output directory: trace.json, timeline.png, logs/")
    r.add_argument("--cluster", help="run on the emulated nodes of this `instride cluster`")
    r.add_argument("--launcher", choices=["local", "emulated", "slurm"],
                   help="where instances run (default: emulated with --cluster, slurm when "
                        "SLURM_JOB_ID is set, else local)")
    r.add_argument("--timeout", type=timeout_arg,
                   help="stop the graph after this many seconds; 0: at once; inf: never "
                        "(default: never)")
    r.add_argument("--keep-streams", action="store_true",
                   help="leave the run's streams in place after it ends")
    r.add_argument("--no-trace", action="store_true", help="record no trace regions")
    r.add_argument("--quiet", "-q", action="store_true", help="no start/finish lines")
    r.set_defaults(func=cmd_run)

    c = fsub.add_parser("check", help="validate a graph without running it",
                        description="Load and validate a graph file; print its modules.")
    graph_args(c)
    c.add_argument("--nodes", help="comma-separated node names placement must stay within")
    c.set_defaults(func=cmd_check)

    d = fsub.add_parser("draw", help="draw a graph as a picture",
                        description="Draw a graph file's modules and connections.")
    graph_args(d)
    d.add_argument("--output", "-o", default="graph.png", help="picture file (default graph.png)")
    d.set_defaults(func=cmd_draw)

    t = sub.add_parser("top", help="live counters of a running graph",
                       description="Per module instance and port: messages, rate, queue "
                                   "depth, idle %, MiB; refreshed until the run ends.")
    t.add_argument("run", nargs="?", help="run directory name (default: the newest running)")
    t.add_argument("--interval", type=positive_seconds, default=1.0,
                   help="seconds between refreshes (default %(default)s)")
    t.add_argument("--once", action="store_true", help="print one table and exit")
    t.set_defaults(func=cmd_top)
