"""``instride serve``: the per-node data server."""

from __future__ import annotations

import argparse
import logging
import sys

from . import non_negative_seconds, positive_int, positive_seconds

#: Hosts that listen on every interface: never an address peers can be told.
WILDCARDS = ("0.0.0.0", "::", "*", "")
#: Loopback hosts: peers on other nodes cannot reach them.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def address_warnings(addr: str, addr_set: bool, listen: str | None) -> list[str]:
    """What is wrong with the address peers are told, given where the server listens.

    Producers record their node's ``INSTRIDE_ADDR`` as the owner of a key: that, not
    ``--listen``, is where peers fetch from.

    Parameters
    ----------
    addr
        ``INSTRIDE_ADDR`` as parsed (its default when unset).
    addr_set
        Whether ``INSTRIDE_ADDR`` is set.
    listen
        ``--listen``, if given.

    Returns
    -------
    list of str
        One message per problem (none: peers reach the server at ``addr``).
    """
    from ..config import parse_addr

    host, port = parse_addr(addr)
    out = []
    if not addr_set and listen is not None:
        out.append(f"INSTRIDE_ADDR is unset: producers of this node record {addr} as the owner "
                   f"of their keys, yet the server listens on {listen}; set INSTRIDE_ADDR to "
                   "the address peers reach this node at (--listen only chooses where it "
                   "listens)")
    elif listen is not None and listen != addr:
        lhost, lport = parse_addr(listen, "--listen")
        if lhost not in WILDCARDS or lport != port:
            out.append(f"the server listens on {listen} but peers are told INSTRIDE_ADDR={addr} "
                       "(producers record it as the owner of their keys): they cannot fetch "
                       "from this node unless the two lead to the same server")
    if host in WILDCARDS:
        out.append(f"INSTRIDE_ADDR is {addr}, a wildcard: peers cannot connect to it; set it "
                   "to this node's address (--listen may stay a wildcard)")
    elif host in LOOPBACK:
        out.append(f"INSTRIDE_ADDR is {addr}, a loopback address: peers on other nodes cannot "
                   "reach it, and every node left at this default believes it owns every key; "
                   "set INSTRIDE_ADDR to this node's address")
    return out


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from ..config import Settings, parse_addr, strip
    from ..server import serve

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    settings = Settings.from_env()
    told = settings.addr  # where peers are told to fetch from (INSTRIDE_ADDR)
    if args.listen:
        parse_addr(args.listen, "--listen")
        settings = settings.with_(addr=args.listen)
    if args.socket:
        from pathlib import Path

        settings = settings.with_(socket_path=Path(args.socket))
    if settings.mode == "cluster" and not settings.token:
        print("instride serve: error: INSTRIDE_TOKEN must be set in cluster mode", file=sys.stderr)
        return 2
    if settings.mode == "cluster":
        addr_set = strip(os.environ.get("INSTRIDE_ADDR", "")) != ""
        for warning in address_warnings(told, addr_set, args.listen):
            logging.getLogger("instride.server").warning("%s", warning)
    return serve(settings, grace=args.grace, workers=args.workers, max_peers=args.max_peers,
                 request_timeout=args.request_timeout, send_timeout=args.send_timeout,
                 sched=args.sched)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..config import SERVE_POLICIES
    p = sub.add_parser(
        "serve",
        help="run this node's data server (peers over INSTRIDE_TRANSPORT: TCP or UCX; "
             "thin clients over a Unix socket)",
        description="Serve this node's managed directory to peers (over the transport "
                    "INSTRIDE_TRANSPORT names: tcp, the default, or ucx) and to local thin "
                    "clients. Settings from INSTRIDE_* variables. Exit status: 0 when "
                    "stopped by SIGTERM, 130 when interrupted (Ctrl-C), 6 when it cannot "
                    "start (its address or Unix socket taken), 2 for a bad setting.",
    )
    p.add_argument("--listen", metavar="HOST:PORT",
                   help="address to listen on (default: INSTRIDE_ADDR); peers always reach the "
                        "node at INSTRIDE_ADDR, the address its producers record as the owner "
                        "of their keys, so --listen must lead there (e.g. 0.0.0.0 on "
                        "INSTRIDE_ADDR's port)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket (default: INSTRIDE_SOCKET)")
    p.add_argument("--grace", type=non_negative_seconds, default=10.0,
                   help="seconds in-flight transfers may take after SIGTERM, 0 to 2147483 "
                        "(default 10)")
    p.add_argument("--workers", type=positive_int, default=64,
                   help="threads for waiting CONSUME requests, one per pending wait (default 64)")
    p.add_argument("--max-peers", type=positive_int, default=512,
                   help="peer connections served at once; more get a 'busy' error (default 512)")
    p.add_argument("--request-timeout", type=positive_seconds, default=10.0,
                   help="seconds a new TCP connection has to send its first request, above 0 "
                        "and at most 2147483 (default 10; "
                        "unused by ucx, whose requests arrive whole)")
    p.add_argument("--send-timeout", type=positive_seconds, default=60.0,
                   help="seconds a write to a peer may take, above 0 and at most 2147483; a "
                        "file body gets this plus size / 50 MB/s (default 60)")
    p.add_argument("--sched", choices=list(SERVE_POLICIES), default=None,
                   help="scheduling policy of the server's threads: auto (batch, but a fetch "
                        "that waited over 50 ms for its frame may preempt to send it at once), "
                        "batch (SCHED_BATCH: never preempt a busy core's thread), normal "
                        "(SCHED_OTHER: may preempt the simulation to serve at once) or inherit "
                        "(as started, e.g. by chrt) (default: INSTRIDE_SERVE_SCHED, else auto)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
