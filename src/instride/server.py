"""The per-node data server (``instride serve``): a transport server plus the node agent.

It composes two faces and owns nothing else:

* **peers**: the server half of the configured transport, started by name on
  ``INSTRIDE_ADDR`` (``INSTRIDE_TRANSPORT``: ``tcp``, the default,
  :class:`~instride.transport.tcp.TcpServer`; ``ucx``,
  :class:`~instride.transport.ucx.UcxServer`) lets other nodes fetch files of this node's
  managed directory — authenticated with the job token, regular files only, every send with
  a deadline (see :mod:`instride.transport.tcp.server`, :mod:`instride.transport.ucx`);
* **thin clients**: the node agent (:class:`~instride.agent.LocalAgent`) on the Unix socket
  ``$INSTRIDE_DIR/.instride/node.sock`` answers the C preload library's ``CONSUME``,
  ``PUBLISH``, ``OVERWRITE``, ``PING`` and ``STATS`` lines (see :mod:`instride.agent`).

SIGTERM and SIGINT stop accepting, cancel pending waits, let in-flight requests finish for a
grace period, then exit: with status 0 after SIGTERM (how a server is stopped), 130 after
SIGINT (Ctrl-C, an interruption, as for every ``instride`` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import resource
import signal
import time
from typing import Any

from .agent import LocalAgent
from .client import Client
from .config import SERVE_POLICIES, Settings, parse_seconds
from .errors import InstrideError, ServeError
from .transport import TransportServer, get_server
from .transport.tcp.server import MAX_PEERS, REQUEST_TIMEOUT, SEND_TIMEOUT

log = logging.getLogger("instride.server")

#: Open files a peer's connection may take at once (its socket; a fetch held open: a
#: directory handle and an eventfd; the file it sends), and those kept for everything else
#: (the agent's clients, Redis, the managed files it opens)
FILES_PER_PEER, FILES_KEPT = 4, 256


def fit_peers(max_peers: int) -> int:
    """Raise this process's soft limit of open files to its hard limit (often 1,024 against
    hundreds of thousands), and return ``max_peers`` cut to what that limit serves (said in
    a warning): past it, new connections would wait unaccepted, held fetches miss, and the
    agent's own requests fail."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    most = max(16, (soft - FILES_KEPT) // FILES_PER_PEER)
    if max_peers > most:
        log.warning("serving at most %d peers at once, not %d: the process may open %d files "
                    "(RLIMIT_NOFILE; raise its hard limit, ulimit -Hn, for more)",
                    most, max_peers, soft)
        return most
    return max_peers

#: Exit status of a server interrupted by SIGINT (Ctrl-C), as ``instride.cli.EXIT_INTERRUPTED``.
EXIT_INTERRUPTED = 130


class NodeServer:
    """Serve this node's managed directory to peers and local thin clients.

    Parameters
    ----------
    settings
        The node's settings (directory, address, token, Redis URL, transport).
    grace
        Seconds in-flight requests may take to finish after SIGTERM.
    workers
        Threads for waiting ``CONSUME`` requests (each pending wait holds one).
    max_peers
        Peer connections served at once; more get a "busy" error reply.
    request_timeout
        Seconds a new peer connection has to send its first request.
    send_timeout
        Seconds a write to a peer may take (a file body: plus size / 50 MB/s).

    Raises
    ------
    ConfigError
        A duration that is not a finite number of seconds (above 0; ``grace``: at least 0)
        up to :data:`~instride.config.MAX_SECONDS`, whose milliseconds the C engine takes as
        an ``int``.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        grace: float = 10.0,
        workers: int = 64,
        max_peers: int = MAX_PEERS,
        request_timeout: float = REQUEST_TIMEOUT,
        send_timeout: float = SEND_TIMEOUT,
    ) -> None:
        grace = parse_seconds(grace, "grace", zero=True)
        request_timeout = parse_seconds(request_timeout, "request_timeout")
        send_timeout = parse_seconds(send_timeout, "send_timeout")
        self.settings = settings
        self.grace = grace
        max_peers = fit_peers(max_peers)
        #: the signal that stopped the server (SIGTERM or SIGINT), once one did
        self.stopped_by: int | None = None
        self.client = Client(settings)
        self.transport: TransportServer = get_server(
            settings.transport, settings, max_peers=max_peers, request_timeout=request_timeout,
            send_timeout=send_timeout)
        self.agent = LocalAgent(settings, self.client, workers=workers, send_timeout=send_timeout,
                                stats=self.snapshot)
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Start the transport server and the agent's socket.

        Raises
        ------
        ServeError
            Either could not start (the address is taken, the socket cannot be made).
        """
        try:
            await self.transport.start()
            try:
                await self.agent.start()
            except BaseException:
                await self.transport.stop(0)
                raise
        except OSError as exc:
            if isinstance(exc, InstrideError):
                raise
            detail = exc.strerror or str(exc)
            if exc.filename is not None:
                detail = f"{detail}: {exc.filename}"
            raise ServeError(detail, exc.errno or errno.EIO) from exc
        log.info("serving %s on %s (%s) and %s (mode %s)", self.settings.dir, self.settings.addr,
                 self.settings.transport, self.settings.socket, self.settings.mode)

    @property
    def busy(self) -> int:
        """Jobs currently running in the agent's worker threads."""
        return self.agent.busy

    async def stop(self) -> None:
        """Stop both faces, giving in-flight requests up to ``grace`` seconds."""
        await asyncio.gather(self.transport.stop(self.grace), self.agent.stop(self.grace))
        if not self.agent.busy:
            self.client.close()
        log.info("stopped; stats %s", self.snapshot())

    async def run(self) -> None:
        """Serve until SIGTERM, SIGINT or SIGHUP (the terminal or ssh session closed; one that
        ``nohup`` ignores stays ignored): each stops the server in order — waiting clients
        told, the socket removed, transfers given their grace."""
        loop = asyncio.get_running_loop()
        # (before the start: a signal during it stops the server once it has started)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:
                loop.add_signal_handler(sig, self._stop_on, sig)
        await self.start()
        print("instride serve: ready", flush=True)
        await self._stopping.wait()
        log.info("signal received, shutting down")
        await self.stop()

    def _stop_on(self, sig: int) -> None:
        if self.stopped_by is None:
            self.stopped_by = sig
        self._stopping.set()

    def snapshot(self) -> dict[str, Any]:
        """Counters of both faces (summed where both count), plus current gauges."""
        out: dict[str, Any] = dict(self.transport.snapshot())
        for name, value in self.agent.snapshot().items():
            out[name] = out.get(name, 0) + value
        return out


#: Scheduling policies ``instride serve --sched`` accepts, by name.
POLICIES = SERVE_POLICIES


def set_policy(name: str) -> None:
    """Put this process's threads, and every thread they start from now on, under the
    scheduling policy ``name``.

    ``"batch"`` (``SCHED_BATCH``): woken by a publication or a peer's request, a server
    thread never preempts a busy core's thread (the simulation, an analysis) — it runs at
    that thread's next scheduling point, within the kernel's scheduling granularity (a few
    ms), or on a core the kernel finds idle. Where producers, readers and servers share few
    cores, a third fewer context switches per frame and 4–16 % more throughput for 8 streams
    on 2 cores; but a frame published while its producer keeps the core busy waits for it: a
    remote reader that busy-polls while every core is busy gets each frame ~230 µs later
    (``benchmarks/RESULTS.md``, round 18), and the kernel does not always place the woken
    thread on an idle core (round 28: 0.3 ms of a cross-node JAC frame's 2.0 ms).
    ``"auto"`` (the default): ``"batch"``, except that a fetch that has waited
    :data:`~instride.config.SERVE_AUTO_PREEMPT_MS` (50 ms) for its key — a reader idle
    between frames that come rarely, as an MD run's do — waits on under ``SCHED_OTHER``, so
    that the publication may preempt to send the frame at once; the thread is back under
    ``SCHED_BATCH`` once it answered (the ``tcp`` transport's server; frames that come close
    together are served under ``"batch"``). ``"normal"`` (``SCHED_OTHER``): woken threads
    may preempt at once, which bounds a remote read's latency on a node whose cores are all
    busy. ``"inherit"``: leave the policy the server was started with (e.g. by ``chrt``).

    A policy the system refuses (a sandbox, a process started under ``SCHED_IDLE`` without
    the right to leave it) is logged as a warning, and the server runs as it was started.

    Raises
    ------
    ValueError
        ``name`` is not one of :data:`POLICIES`.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == "inherit":
        return
    policy = os.SCHED_OTHER if name == "normal" else os.SCHED_BATCH
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError as exc:
        log.warning("scheduling policy %s refused (%s): the server runs as it was started",
                    name, exc.strerror or exc)
        return
    # and the threads already running (imports start some, e.g. a BLAS pool)
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):
                os.sched_setscheduler(int(tid), policy, os.sched_param(0))


def serve(
    settings: Settings | None = None,
    *,
    grace: float = 10.0,
    workers: int = 64,
    max_peers: int = MAX_PEERS,
    request_timeout: float = REQUEST_TIMEOUT,
    send_timeout: float = SEND_TIMEOUT,
    sched: str | None = None,
) -> int:
    """Run a :class:`NodeServer` in the foreground until SIGTERM/SIGINT.

    Parameters are those of :class:`NodeServer`; ``settings`` default to the environment;
    ``sched`` is the scheduling policy of the server's threads (see :func:`set_policy`;
    default: ``settings.serve_sched``, ``INSTRIDE_SERVE_SCHED``).

    Returns
    -------
    int
        The exit status of ``instride serve``: 0 when stopped by SIGTERM (how a server is
        stopped), 130 when interrupted by SIGINT (Ctrl-C), 129 after SIGHUP, as every
        ``instride`` command.
    """
    settings = settings or Settings.from_env()
    if sched is not None:  # (the transport's server reads it: "auto")
        settings = dataclasses.replace(settings, serve_sched=sched)
    set_policy(settings.serve_sched)  # (threads inherit it)
    started = time.monotonic()
    server = NodeServer(settings, grace=grace, workers=workers, max_peers=max_peers,
                        request_timeout=request_timeout, send_timeout=send_timeout)
    asyncio.run(server.run())
    log.info("ran %.1f s", time.monotonic() - started)
    status = EXIT_INTERRUPTED if server.stopped_by == signal.SIGINT \
        else 128 + signal.SIGHUP if server.stopped_by == signal.SIGHUP else 0
    if server.busy:
        # A worker stuck in a blocking call would keep the interpreter from exiting (it joins
        # pool threads at exit); the server was asked to stop, so leave without them.
        logging.shutdown()
        os._exit(status)
    return status
