"""``instride serve``: the per-node data server."""

from __future__ import annotations

import argparse
import logging
import sys


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds: {text}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from ..config import Settings, parse_addr
    from ..server import serve

    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
    )
    settings = Settings.from_env()
    if args.listen:
        parse_addr(args.listen, "--listen")
        settings = settings.with_(addr=args.listen)
    if args.socket:
        from pathlib import Path

        settings = settings.with_(socket_path=Path(args.socket))
    if settings.mode == "cluster" and not settings.token:
        print("instride serve: error: INSTRIDE_TOKEN must be set in cluster mode", file=sys.stderr)
        return 2
    host, _port = parse_addr(settings.addr)
    if settings.mode == "cluster" and host in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("instride.server").warning(
            "INSTRIDE_ADDR is %s, a loopback address: peers on other nodes cannot reach it, and "
            "every node left at this default believes it owns every key; set INSTRIDE_ADDR to "
            "this node's address", settings.addr)
    serve(settings, grace=args.grace, workers=args.workers, max_peers=args.max_peers,
          request_timeout=args.request_timeout, send_timeout=args.send_timeout, sched=args.sched)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run this node's data server (peers over INSTRIDE_TRANSPORT: TCP or UCX; "
             "thin clients over a Unix socket)",
        description="Serve this node's managed directory to peers (over the transport "
                    "INSTRIDE_TRANSPORT names: tcp, the default, or ucx) and to local thin "
                    "clients. Settings from INSTRIDE_* variables.",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="address peers reach (default: INSTRIDE_ADDR)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket (default: INSTRIDE_SOCKET)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight transfers may take after SIGTERM (default 10)")
    p.add_argument("--workers", type=_positive_int, default=64,
                   help="threads for waiting CONSUME requests, one per pending wait (default 64)")
    p.add_argument("--max-peers", type=_positive_int, default=512,
                   help="peer connections served at once; more get a 'busy' error (default 512)")
    p.add_argument("--request-timeout", type=_positive_float, default=10.0,
                   help="seconds a new TCP connection has to send its first request (default 10; "
                        "unused by ucx, whose requests arrive whole)")
    p.add_argument("--send-timeout", type=_positive_float, default=60.0,
                   help="seconds a write to a peer may take; a file body gets this plus "
                        "size / 50 MB/s (default 60)")
    p.add_argument("--sched", choices=["batch", "normal", "inherit"], default=None,
                   help="scheduling policy of the server's threads: batch (SCHED_BATCH: run at "
                        "once on an idle core, never preempt a busy one's thread), normal "
                        "(SCHED_OTHER: may preempt the simulation to serve at once) or inherit "
                        "(as started, e.g. by chrt) (default: INSTRIDE_SERVE_SCHED, else batch)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
