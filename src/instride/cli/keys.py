"""Key commands: ``instride info``, ``ls``, ``wait``, ``cat`` and ``gc``."""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from ..errors import redact_url
from . import TIMEOUT_HELP, non_negative_seconds, timeout_arg


def _client():  # type: ignore[no-untyped-def]
    from ..client import get_client

    return get_client()


def cmd_info(args: argparse.Namespace) -> int:
    client = _client()
    s = client.settings
    info = {
        "version": __version__,
        "mode": s.mode,
        "dir": str(s.dir),
        "node": s.node,
        "addr": s.addr,
        "redis_url": redact_url(s.redis_url) if s.redis_url else s.redis_url,
        "socket": str(s.socket),
        "timeout": s.timeout,
        "fsync": s.fsync,
        "cache_bytes": s.cache_bytes,
        "token": "set" if s.token else "unset",
        **native_status(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:12} {v}")
    return 0


def native_status() -> dict[str, str]:
    """Which compiled paths this installation runs (an HPC engineer's first question when a
    node is slower than another): the local library, the transports' engines, and whether the
    idle helper may prefault a producer's next frame file (:mod:`instride.store.spare`)."""
    from ..errors import ConfigError
    from ..native import library
    from ..store.ring import prefault_works
    from ..store.spare import SpareMaker
    from ..transport import ucx
    from ..transport.tcp import engine

    out = {"native": "loaded" if library() is not None else
           "missing or stale: the Python paths run (reinstall: pip install -e .)"}
    for name, load in (("tcp_engine", engine.load_library), ("ucx_engine", ucx.load_library)):
        try:
            load()
            out[name] = "loaded"
        except (ConfigError, AttributeError, OSError) as exc:  # (stale: a symbol missing)
            out[name] = f"unavailable: {exc}"
    if library() is None:
        out["prefault"] = "off: the native library is missing (the producer fills each mapping" \
            " itself)"
    elif not prefault_works():
        out["prefault"] = "off: the kernel has no MADV_POPULATE_WRITE (the producer fills" \
            " each mapping itself)"
    elif not SpareMaker().prefault_safe:
        import resource

        out["prefault"] = "off: this process may not raise the idle helper (no CAP_SYS_NICE in" \
            f" the initial user namespace, RLIMIT_NICE {resource.getrlimit(resource.RLIMIT_NICE)[0]});" \
            " the producer fills each mapping itself"
    else:
        out["prefault"] = "on (the idle helper fills the next frame file's mapping)"
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    client = _client()
    for key in client.list(args.prefix):
        if args.long:
            rec = client.metadata.lookup(key)
            if rec is not None:
                print(f"{rec.size:>12}  v{rec.version:<3} {rec.node or rec.owner:<16} {key}")
                continue
        print(key)
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    path = _client().consume(args.key, timeout=args.timeout)
    print(path)
    return 0


def cmd_cat(args: argparse.Namespace) -> int:
    data = _client().consume_bytes(args.key, timeout=args.timeout)
    out = sys.stdout.buffer
    out.write(data)
    out.flush()
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    removed = _client().gc(min_age=args.min_age)
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} temporary file(s) removed", file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the key commands to the ``instride`` parser."""
    p = sub.add_parser("info", help="show mode, managed directory, version and settings, and"
                       " which native paths run")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("ls", help="list published keys")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with PREFIX")
    p.add_argument("-l", "--long", action="store_true", help="show size, version and owner")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("wait", help="wait until KEY is published and local; print its path")
    p.add_argument("key")
    p.add_argument("--timeout", type=timeout_arg, default=None, help=TIMEOUT_HELP)
    p.set_defaults(func=cmd_wait)

    p = sub.add_parser("cat", help="wait for KEY and write its content to stdout")
    p.add_argument("key")
    p.add_argument("--timeout", type=timeout_arg, default=None, help=TIMEOUT_HELP)
    p.set_defaults(func=cmd_cat)

    p = sub.add_parser(
        "gc", help="remove temporary files left by dead producers and the receive pool's recycled copies",
    )
    p.add_argument(
        "--min-age", type=non_negative_seconds, default=0.0,
        help="also remove temporary files older than this many seconds (PID reuse)",
    )
    p.set_defaults(func=cmd_gc)

