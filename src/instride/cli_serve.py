"""``instride serve``: the per-node data server."""

from __future__ import annotations

import argparse
import logging
import sys


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import Settings, parse_addr
    from .server import serve

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
    serve(settings, grace=args.grace)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run this node's data server (peers over TCP, thin clients over a Unix socket)",
        description="Serve this node's managed directory. Settings from INSTRIDE_* variables.",
    )
    p.add_argument("--listen", metavar="HOST:PORT", help="TCP address (default: INSTRIDE_ADDR)")
    p.add_argument("--socket", metavar="PATH", help="Unix socket (default: INSTRIDE_SOCKET)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds in-flight transfers may take after SIGTERM (default 10)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)
