"""The ``instride`` command.

Each command parses its arguments, calls one library function and prints. Heavy imports
(numpy-based benchmarks, OpenMM, MDAnalysis) happen inside the command that needs them, so
``instride --help`` stays fast.

Exit status (the same for every command; :data:`EXIT_CODES`, mapped from the typed errors by
:func:`exit_code`):

====  ======================================================================================
0     success
1     any other error (including errors of the command run by ``instride run`` /
      ``cluster exec``, which pass their own status through)
2     usage: a bad command line or a bad ``INSTRIDE_*`` setting (``ConfigError``),
      ``instride job`` outside an allocation without a host file (``NoAllocationError``)
3     timeout: a key was not published in time (``ConsumeTimeout``), a flow ran past its
      ``--timeout`` (``FlowTimeout``)
4     invalid input: a bad or unsafe key, a directory or special file under a key, a
      write-once key already published, a missing key or input file, an unsupported mode,
      a dataflow graph that does not validate (``GraphError``), a run ``instride top`` does
      not know (``UnknownRunError``)
5     integrity or transfer failure: bytes that do not verify, a transfer cut short
6     unavailable: a peer's data server or the metadata service (Redis) cannot be reached
      (also a wait that ran out while Redis could not be reached); a node's services did
      not start under ``instride job`` (``ServerStartError``, ``StaleServiceError``) or
      ended while its command ran (``ServiceLostError``), or ``instride serve`` could not
      (``ServeError``: its address taken, its Unix socket answered by another server,
      ...); an MD engine's IMD port does not answer ``instride imd-bridge``
      (``EngineUnavailable``)
7     refused: authentication with the job token failed
130   interrupted (Ctrl-C); ``instride serve``, ``imd-serve`` and ``archive`` stopped by
      SIGTERM exit 0
143   terminated (SIGTERM) — any other command: its cleanup runs first, as for Ctrl-C (the
      files it was writing removed, the processes it started stopped)
====  ======================================================================================
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Sequence

from .. import __version__
from ..errors import (
    AuthenticationError,
    ConfigError,
    ConsumeTimeout,
    FileTypeError,
    InstrideError,
    IntegrityError,
    KeyExistsError,
    KeyNotFoundError,
    KeyValidationError,
    MetadataUnavailable,
    PeerUnavailable,
    ServeError,
    TransferError,
    UnsafePathError,
    UnsupportedModeError,
)
from ..launch.base import NoAllocationError, ServerStartError, ServiceLostError

Handler = Callable[[argparse.Namespace], int]
#: Extra command groups: module path of a function ``add_parser(subparsers)``.
_PLUGINS = [
    "instride.cli.keys",  # info, ls, wait, cat, gc
    "instride.cli.serve",  # serve
    "instride.cli.cluster",  # cluster up/down/exec/status
    "instride.cli.run",  # run, preload-path
    "instride.cli.md",  # demo, imd-bridge
    "instride.cli.bench",  # bench run/study
    "instride.cli.analyze",  # analyze, export
    "instride.cli.archive",  # archive
    "instride.cli.flow",  # flow run/check/draw, top
    "instride.cli.job",  # job (Slurm / mpiexec services)
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_INVALID = 4
EXIT_INTEGRITY = 5
EXIT_UNAVAILABLE = 6
EXIT_REFUSED = 7
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_HUNG_UP = 129


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where the command is, so that its cleanup runs as
    for Ctrl-C (a command with its own SIGTERM handling installs it over this one)."""


class HungUp(Terminated):
    """SIGHUP (the terminal or the ssh session closed under the command): as SIGTERM, its
    cleanup runs (the default action killed it at once, leaving its servers, namespaces and
    mounts)."""


def _terminate(signum: int, frame: object) -> None:
    # (the cleanup that follows is not cut short by another SIGTERM or SIGHUP: later ones are
    # taken in and dropped — not ignored, which the programs the cleanup starts would inherit)
    for sig in _HANDLED:
        if signal.getsignal(sig) is _terminate:
            signal.signal(sig, _dropped)
    raise HungUp if signum == signal.SIGHUP else Terminated


def _dropped(signum: int, frame: object) -> None:
    """A SIGTERM after the first: the command is stopping already."""


#: the signals that stop a command with its cleanup (where their action is the default one:
#: a SIGHUP that nohup ignores stays ignored)
_HANDLED = (signal.SIGTERM, signal.SIGHUP)

#: Typed error -> exit status, first match wins (so the more specific classes come first).
#: Other errors of instride that refine ValueError, LookupError or FileNotFoundError (bad
#: input of a command: an unknown model, a missing trajectory) are invalid input too.
EXIT_CODES: list[tuple[type[BaseException] | tuple[type[BaseException], ...], int]] = [
    ((ConfigError, NoAllocationError), EXIT_USAGE),
    ((ServerStartError, ServiceLostError, ServeError), EXIT_UNAVAILABLE),
    ((ConsumeTimeout, TimeoutError), EXIT_TIMEOUT),  # also a flow run's FlowTimeout
    ((IntegrityError, TransferError), EXIT_INTEGRITY),
    ((PeerUnavailable, MetadataUnavailable, ConnectionError), EXIT_UNAVAILABLE),  # (an engine too)
    (AuthenticationError, EXIT_REFUSED),
    ((KeyValidationError, UnsafePathError, FileTypeError, UnsupportedModeError, KeyExistsError,
      KeyNotFoundError), EXIT_INVALID),
    ((ValueError, LookupError, FileNotFoundError), EXIT_INVALID),
]


def exit_code(exc: BaseException) -> int:
    """The exit status of the ``instride`` command for an error (see :data:`EXIT_CODES`)."""
    if isinstance(exc, KeyboardInterrupt):
        return _interrupted(exc)
    if isinstance(exc, ConsumeTimeout) and _unreachable(exc):
        return EXIT_UNAVAILABLE  # the wait ran out while Redis could not be reached
    if isinstance(exc, InstrideError):
        for kinds, code in EXIT_CODES:
            if isinstance(exc, kinds):
                return code
    return EXIT_ERROR


def _unreachable(exc: BaseException) -> BaseException | None:
    """The connection error behind a timeout (Redis down during the wait), if any."""
    cause = exc.__cause__
    if isinstance(cause, (MetadataUnavailable, PeerUnavailable, ConnectionError)):
        return cause
    if cause is not None and type(cause).__module__.startswith("redis"):  # redis-py's own
        return cause  # ConnectionError / TimeoutError (not the builtin classes)
    return None


def timeout_arg(text: str) -> float:
    """``--timeout`` values: seconds; ``0`` does not wait; ``inf`` waits forever (argparse type).

    An explicit no limit (``inf``, ``forever``, ...) is ``math.inf``, never ``None``: an
    option's default ``None`` means "not given" (``INSTRIDE_TIMEOUT`` then decides), which
    ``inf`` must override.
    """
    from ..config import parse_timeout

    try:
        value = parse_timeout(text, "--timeout")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return math.inf if value is None else value


def _seconds_arg(text: str, *, zero: bool, unit: str = "seconds") -> float:
    """:func:`~instride.config.parse_seconds` as an argparse type (``unit``: what the error
    calls the number)."""
    from ..config import MAX_SECONDS, parse_seconds

    try:
        return parse_seconds(text, unit, zero=zero)
    except ConfigError:
        low = "at least 0" if zero else "above 0"
        raise argparse.ArgumentTypeError(
            f"must be a finite number of {unit} {low} and at most {MAX_SECONDS}: {text!r}"
        ) from None


def positive_seconds(text: str) -> float:
    """Seconds, a finite number above 0 (an interval, a wait that must end) (argparse type)."""
    return _seconds_arg(text, zero=False)


def non_negative_seconds(text: str) -> float:
    """Seconds, a finite number, 0 or more (a grace) (argparse type)."""
    return _seconds_arg(text, zero=True)


def md_step_ps(text: str) -> float:
    """An MD step's length in ps, a finite number, 0 or more (argparse type)."""
    return _seconds_arg(text, zero=True, unit="ps")


def positive_number(text: str) -> float:
    """A finite number above 0 (a factor) (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number above 0")
    return value


def positive_int(text: str) -> int:
    """A whole number, 1 or more (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 or more")
    return value


def no_limit_as_none(timeout: float | None) -> float | None:
    """A ``--timeout`` for the APIs whose ``None`` means no limit (not a setting's default)."""
    return None if timeout is None or math.isinf(timeout) else timeout


#: Help text of every ``--timeout`` option that waits for keys.
TIMEOUT_HELP = ("seconds to wait; 0: do not wait (fail at once unless published); inf: forever "
                "(default: INSTRIDE_TIMEOUT, else forever)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``instride`` command."""
    parser = argparse.ArgumentParser(
        prog="instride",
        description="Producer/consumer data movement for in situ MD workflows.",
        epilog="Settings come from INSTRIDE_* environment variables; see `instride info`. "
        "Exit status: 0 ok, 1 other error, 2 usage or bad setting, 3 timeout, 4 invalid "
        "input (key, path, file), 5 integrity/transfer failure, 6 peer or Redis unavailable, "
        "7 authentication refused, 130 interrupted, 143 terminated (SIGTERM, after cleanup).",
    )
    parser.add_argument("--version", action="version", version=f"instride {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    for name in _PLUGINS:
        importlib.import_module(name).add_parser(sub)
    return parser


def _interrupted(exc: KeyboardInterrupt) -> int:
    """The exit status of Ctrl-C, SIGTERM or SIGHUP."""
    if isinstance(exc, HungUp):
        return EXIT_HUNG_UP
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``instride`` command; return its exit status (see :data:`EXIT_CODES`)."""
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse exits with 2
    handler: Handler = args.func
    main_thread = threading.current_thread() is threading.main_thread()
    ours = [sig for sig in _HANDLED
            if main_thread and signal.getsignal(sig) is signal.SIG_DFL]
    for sig in ours:
        signal.signal(sig, _terminate)  # (else the process just dies: no cleanup)
    try:
        return _run(handler, args)
    finally:
        for sig in ours:  # (a caller in the same process gets the default back)
            signal.signal(sig, signal.SIG_DFL)


def _run(handler: Handler, args: argparse.Namespace) -> int:
    try:
        code = handler(args)
        sys.stdout.flush()  # (an output error here, not at exit)
        return code
    except InstrideError as exc:
        cause = _unreachable(exc) if isinstance(exc, ConsumeTimeout) else None
        extra = f" (unreachable meanwhile: {cause})" if cause is not None else ""
        print(f"instride: error: {exc}{extra}", file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt as exc:
        return _interrupted(exc)
    except BrokenPipeError as exc:
        if not _stdout_broken():
            print(f"instride: error: {exc}", file=sys.stderr)
            return EXIT_ERROR
        # The reader of our output went away (`instride ls | head -1`): stop quietly, as
        # CPython recommends; what is still buffered goes to /dev/null, not to a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_ERROR
    except OSError as exc:  # writing the output (`instride cat K > /dev/full`), ...
        print(f"instride: error: {exc}", file=sys.stderr)
        return EXIT_ERROR


def _stdout_broken() -> bool:
    """Whether stdout is a pipe or socket whose reader has gone (poll reports an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
