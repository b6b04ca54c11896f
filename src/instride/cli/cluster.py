"""``instride cluster up/down/exec/status``: emulated nodes from the command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from typing import Any

from ..emulate.netns import ClusterError
from ..errors import ConfigError

DEFAULT_NAME = "default"


def _name_arg(p: argparse.ArgumentParser, default: str | None = DEFAULT_NAME) -> None:
    p.add_argument(
        "--name", default=default,
        help=f"cluster name (default: {default or 'every cluster'})",
    )


def _env_pairs(pairs: list[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("--env", pair, "expected KEY=VALUE")
        env[key] = value
    return env


def _print_status(info: dict[str, Any]) -> None:
    print(f"cluster {info['name']} ({info['status']}), subnet {info['subnet']}, "
          f"hub {info['hub']['netns']}"
          + (", node processes without capabilities" if info.get("unprivileged") else "")
          + (", on a huge-page tmpfs" if info.get("huge_pages") else ""))
    redis = info["redis"]
    if redis:
        state = "listening" if redis["listening"] else ("alive" if redis["alive"] else "DOWN")
        print(f"  redis   {redis['url']:<32} pid {redis['pid']}  {state}")
    for n in info["nodes"]:
        server = n["server"]
        if server is None:
            srv = "no server"
        else:
            state = "listening" if server["listening"] else (
                "alive" if server["alive"] else "DOWN")
            srv = f"server pid {server['pid']} {state}"
        print(f"  {n['name']:<7} {n['addr']:<21} netns {n['netns']:<14} {n['dir']}  {srv}")
    print(f"  shared  {info['shared_dir']}")


def cmd_up(args: argparse.Namespace) -> int:
    from ..emulate.emulated import EmulatedCluster

    cluster = EmulatedCluster(
        nodes=args.nodes, name=args.name, base_dir=args.base_dir, serve=not args.no_serve,
        redis=not args.no_redis, token=args.token, env=_env_pairs(args.env),
        unprivileged=args.unprivileged, huge_pages=args.huge_pages,
    ).up()
    info = cluster.status()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_status(info)
        print(f"run a command on node 1: instride cluster exec 1 --name {cluster.name} -- CMD")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from ..emulate.emulated import EmulatedCluster, list_clusters

    names = list_clusters() if args.all else [args.name]
    failed = 0
    for name in names:
        try:
            removed = EmulatedCluster.destroy(name)
        except (ClusterError, ConfigError) as exc:  # (a corrupt state file, a stray file of
            # another name) reported, the others gone on with
            if isinstance(exc, ConfigError) and not args.all:
                raise  # a bad --name: a usage error (exit 2), as for status and exec
            print(f"instride: error: cluster {name}: {exc}", file=sys.stderr)
            failed += 1
            continue
        if removed:
            print(f"cluster {name} removed")
        else:
            print(f"no cluster {name}", file=sys.stderr)
    return 1 if failed else 0


def cmd_exec(args: argparse.Namespace) -> int:
    from ..emulate.emulated import EmulatedCluster

    argv = list(args.argv)
    # Options given after NODE land in the remainder (`exec 1 --name X -- CMD`): parse them
    # here, up to the first `--`. Otherwise argparse has dropped the `--` after NODE already
    # and the remainder is CMD itself, verbatim: a `--` of its own (`sh -c '...' -- x`,
    # `instride run -- prog`) is CMD's, not a separator.
    if argv and (argv[0] == "--name" or argv[0].startswith("--name=")):
        cut = argv.index("--") if "--" in argv else len(argv)
        before, argv = argv[:cut], argv[cut + 1:]
        opts = argparse.ArgumentParser(prog="instride cluster exec NODE", add_help=False)
        opts.add_argument("--name", default=args.name)
        args.name = opts.parse_args(before).name
    elif argv and argv[0] == "--":  # (`exec 1 -- -- CMD`: the one argparse left)
        argv = argv[1:]
    if not argv:
        raise ConfigError("command", "", "give the command after `--`")
    cluster = EmulatedCluster.attach(args.name)
    cmd = cluster.command(args.node, argv)
    started: list[subprocess.Popen[bytes]] = []
    came: list[int] = []

    # SIGTERM and SIGHUP (a batch system, a closed terminal) go on to the command, which can
    # end its streams, and this waits for it (it used to be killed from here, its children
    # left running); Ctrl-C reaches it from the terminal: this one just goes on waiting
    def forward(signum: int, frame: object) -> None:
        if not started:
            came.append(signum)  # (before it started: given to it once it has)
            return
        with contextlib.suppress(ProcessLookupError):
            started[0].send_signal(signum)

    handled = {signal.SIGTERM: forward, signal.SIGHUP: forward,
               signal.SIGINT: lambda signum, frame: None}
    previous = {s: signal.signal(s, h) for s, h in handled.items()}
    try:
        started.append(subprocess.Popen(cmd, env=dict(cluster.node(args.node).env)))
        for signum in came:
            forward(signum, None)
        code = started[0].wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell does


def cmd_status(args: argparse.Namespace) -> int:
    from ..emulate.emulated import EmulatedCluster, list_clusters

    failed = 0
    if args.name:
        infos = [EmulatedCluster.attach(args.name).status()]
    else:  # every cluster: one whose state file is corrupt is reported, the others shown
        infos = []
        for name in list_clusters():
            try:
                infos.append(EmulatedCluster.attach(name).status())
            except (ClusterError, ConfigError) as exc:  # (or a stray file's name)
                print(f"instride: error: cluster {name}: {exc}", file=sys.stderr)
                failed += 1
    if args.json:
        print(json.dumps(infos if args.name is None else infos[0], indent=2))
    elif not infos:
        print("no clusters")
    else:
        for info in infos:
            _print_status(info)
    return 1 if failed else 0


def add_parser(subparsers: Any) -> None:
    """Add the ``cluster`` command group to the ``instride`` parser."""
    group = subparsers.add_parser(
        "cluster", help="emulated nodes on this machine (network namespaces; needs root)",
        description="Emulated nodes: one network namespace per node joined by a bridge, each "
                    "with its own address, managed directory and `instride serve`, plus one "
                    "Redis server. Needs root, iproute2 and redis-server.",
    )
    sub = group.add_subparsers(dest="cluster_command", metavar="SUBCOMMAND", required=True)

    p = sub.add_parser("up", help="create N emulated nodes and start their servers",
                       description="Create the namespaces, bridge, directories, Redis and "
                                   "data servers of an emulated cluster, and leave them running.")
    p.add_argument("--nodes", "-n", type=int, default=2, help="number of nodes (default: 2)")
    _name_arg(p)
    p.add_argument("--base-dir", default=None,
                   help="directory for node<i>/, shared/ and logs (default: new dir on /dev/shm)")
    p.add_argument("--no-serve", action="store_true", help="do not start `instride serve`")
    p.add_argument("--no-redis", action="store_true",
                   help="do not start Redis (nodes run in local mode)")
    p.add_argument("--token", default=None, help="job token (default: random)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable for every node (repeatable)")
    p.add_argument("--unprivileged", action="store_true",
                   help="run every node's processes (data servers, `cluster exec`) without"
                        " root's capabilities, as a user's processes on a cluster node run")
    p.add_argument("--huge-pages", action="store_true",
                   help="put the base directory on a tmpfs of its own mounted with huge pages"
                        " (huge=within_size; unmounted by `down`): far fewer page allocations"
                        " for large new files than /dev/shm")
    p.add_argument("--json", action="store_true", help="print the status as JSON")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("down", help="stop and remove an emulated cluster (idempotent)",
                       description="Stop the cluster's processes and remove its namespaces, "
                                   "interfaces, directories and state file.")
    _name_arg(p)
    p.add_argument("--all", action="store_true", help="remove every cluster with a state file")
    p.set_defaults(func=cmd_down)

    p = sub.add_parser("exec", help="run a command on one node: exec NODE -- CMD...",
                       description="Run CMD inside node NODE's namespace with its environment "
                                   "(INSTRIDE_DIR, INSTRIDE_REDIS_URL, INSTRIDE_TOKEN, "
                                   "INSTRIDE_NODE, INSTRIDE_ADDR); exit with CMD's status.")
    p.add_argument("node", help="node number 1..N (or node<i>)")
    _name_arg(p)
    p.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- CMD ...",
                   help="the command and its arguments, after `--`")
    p.set_defaults(func=cmd_exec)

    p = sub.add_parser("status", help="show nodes, addresses and server liveness",
                       description="Show an emulated cluster (or all of them).")
    _name_arg(p, default=None)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_status)
