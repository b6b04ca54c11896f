"""What every launcher shares: the job's services, their start, their teardown.

A job's instride services are

- one Redis server on the first node (the node where ``instride job`` runs), bound to that
  node's address and protected by a fresh password — or an existing ``INSTRIDE_REDIS_URL``;
- one *node agent* per node (:mod:`instride.launch.agent`), started by the launcher's own
  parallel command (``srun --ntasks-per-node=1``, ``mpiexec -ppn 1``): it creates the node's
  managed directory, runs ``instride serve`` there, registers the node's address in Redis, and
  removes the directory when it is stopped;
- a fresh job token (``INSTRIDE_TOKEN``).

:class:`JobServices` starts them (:meth:`~JobServices.up`), hands back the environment of the
job's commands, and stops them (:meth:`~JobServices.down`); :meth:`~JobServices.run` does all
three around one command, also when the command fails or the job is cancelled (SIGTERM).
A launcher subclass says only how to find the nodes and how to run one process per node.

Per-node settings (``INSTRIDE_DIR``, ``INSTRIDE_ADDR``, ``INSTRIDE_NODE``) reach job steps
through a small shell script shipped with the package (:func:`node_env_script`): Slurm runs it
as the task prolog of every ``srun`` step; under ``mpiexec`` it prefixes a rank's command.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import math
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config import DEFAULT_PORT, parse_redis_url
from ..errors import ConfigError, InstrideError, MetadataUnavailable, redact_url
from ..orphans import Watchdog, become_subreaper, children, dies_with_me, stop_adopted

#: Redis hash of the nodes whose service is up: node name -> ``host:port``.
REGISTRY = "instride:job:{job}:nodes"
#: Redis hash of the nodes whose service failed to start: node name -> message.
ERRORS = "instride:job:{job}:errors"
#: Variables that describe one node; never inherited by a job's services or steps.
NODE_VARS = ("INSTRIDE_DIR", "INSTRIDE_ADDR", "INSTRIDE_NODE", "INSTRIDE_SOCKET")
#: Variables of a job that `instride job` sets (and so never inherits from an earlier job).
JOB_VARS = ("INSTRIDE_REDIS_URL", "INSTRIDE_TOKEN", "INSTRIDE_JOB_ID", "INSTRIDE_JOB_DIR",
            "INSTRIDE_JOB_PORT", "INSTRIDE_JOB_IFACE", "INSTRIDE_NODE_ENV", "INSTRIDE_JOB_COOKIE")


class LaunchError(InstrideError, RuntimeError):
    """The services of a job cannot be started or stopped."""


class NoAllocationError(LaunchError):
    """``instride job`` runs outside any allocation (no Slurm job, no host file)."""


class ServerStartError(LaunchError):
    """A node's service (managed directory, data server) did not start."""

    def __init__(self, node: str, detail: str) -> None:
        self.node = node
        self.detail = detail
        super().__init__(f"the instride service of node {node} did not start: {detail}")


class ServiceLostError(LaunchError):
    """A node's service ended while the job's command ran (its data server died, its agent
    was killed, the job's Redis ended): the command is stopped, since it cannot go on
    without it."""

    def __init__(self, node: str, detail: str) -> None:
        self.node = node
        self.detail = detail
        super().__init__(f"the instride service of node {node} ended while the command ran: "
                         f"{detail}")


class StaleServiceError(ServerStartError):
    """A node still runs the instride service of an earlier job."""

    def __init__(self, node: str, job: str, pid: int) -> None:
        self.job = job
        self.pid = pid
        super().__init__(
            node, f"it still runs the service of job {job} (pid {pid}); end that job, or run "
            f"`instride job --cleanup` on {node} to stop it")


# ---------------------------------------------------------------------- small helpers
def node_env_script() -> Path:
    """The shell script that sets a node's ``INSTRIDE_*`` variables (task prolog / wrapper)."""
    return Path(__file__).with_name("node_env.sh")


def node_name(env: Mapping[str, str] | None = None) -> str:
    """This node's name: Slurm's ``SLURMD_NODENAME``, else the short host name."""
    env = os.environ if env is None else env
    return env.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def default_dir_pattern() -> str:
    """Default managed directory of a job's nodes: node-local tmpfs, one per job."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return str(base / f"instride-{os.getuid()}-job%j")


def check_dir_pattern(pattern: str) -> str:
    """Return ``pattern`` if usable as a job's managed-directory pattern, else raise."""
    if not pattern or not os.path.isabs(pattern):
        raise ConfigError("--dir", pattern, "expected an absolute path (%n: node, %j: job id)")
    if "%j" not in pattern:
        raise ConfigError("--dir", pattern, "must contain %j (the job id), so that every job "
                          "gets a fresh directory that is removed when it ends")
    if any(c in pattern for c in "\n|'\"\\$`"):
        raise ConfigError("--dir", pattern, "contains a quote, newline, '|', '$', '`' or '\\'")
    return pattern


def expand_dir(pattern: str, node: str, job: str) -> Path:
    """The managed directory of ``node`` in ``job``: ``%n`` and ``%j`` replaced."""
    return Path(pattern.replace("%n", node).replace("%j", job))


def resolve_ipv4(host: str) -> str:
    """The IPv4 address of ``host`` (an address is returned as is).

    Raises
    ------
    LaunchError
        When the name does not resolve.
    """
    with contextlib.suppress(ValueError):
        return str(ipaddress.IPv4Address(host))
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise LaunchError(f"cannot resolve host {host!r}: {exc}") from None
    return str(infos[0][4][0])


def iface_address(iface: str) -> str:
    """The IPv4 address of network interface ``iface`` on this node.

    Raises
    ------
    LaunchError
        When the interface does not exist or has no IPv4 address.
    """
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr,
                                 struct.pack("256s", iface.encode()[:15]))
        except OSError as exc:
            raise LaunchError(
                f"network interface {iface!r} has no IPv4 address on {node_name()}: "
                f"{exc.strerror}") from None
    return socket.inet_ntoa(packed[20:24])


def route_address(host: str, port: int) -> str:
    """This node's address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((resolve_ipv4(host), port))
        except OSError as exc:
            raise LaunchError(f"no route from {node_name()} to {host}: {exc.strerror}") from None
        return str(s.getsockname()[0])


#: ``url`` without its password (:func:`instride.errors.redact_url`)
redact = redact_url


def check_redis_url(url: str, name: str = "INSTRIDE_REDIS_URL") -> str:
    """:func:`instride.config.parse_redis_url` for a Redis every node reaches over TCP
    (``unix://`` refused): ``url`` unchanged, else :class:`ConfigError`."""
    return parse_redis_url(url, name, tcp=True)


def redis_client(url: str, timeout: float = 5.0) -> Any:
    """A redis-py client for ``url`` with connect and socket timeouts."""
    import redis

    return redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout,
                                decode_responses=True)


def ping_redis(url: str, timeout: float = 5.0) -> None:
    """Check that Redis at ``url`` answers; raise :class:`MetadataUnavailable` if not."""
    import redis

    client = redis_client(url, timeout)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise MetadataUnavailable(redact(url), f"{type(exc).__name__}: {exc}") from None
    finally:
        client.close()


def tail(path: Path, lines: int = 15) -> str:
    """The last lines of a log file (or a note that there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _stop(proc: subprocess.Popen[bytes] | None, grace: float) -> bool:
    """SIGTERM ``proc`` (by PID), SIGKILL it after ``grace`` s; return whether it ended."""
    if proc is None:
        return True
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            return False
    return True


#: Seconds between two checks of the services while the job's command runs.
AGENT_POLL = 0.25
#: Seconds the command has to end after a signal passed on to it, or after SIGTERM when the
#: services ended under it (then SIGKILL); and what it left running, after SIGTERM.
STOP_GRACE = 30.0
#: The environment variable that marks the processes of the job's command on this node (a
#: cookie, new for each job): what the command started is found by it if ``instride job`` is
#: killed outright (see :class:`~instride.orphans.Watchdog`).
JOB_COOKIE = "INSTRIDE_JOB_COOKIE"
#: Seconds those processes get between SIGTERM and SIGKILL then.
ORPHAN_GRACE = 5.0
#: ``si_code`` of a signal sent by the kernel, not by a process (Linux): a SIGINT so sent is
#: a terminal's Ctrl-C, sent to the terminal's whole foreground process group.
_SI_KERNEL = 0x80
#: What a SIGINT is taken in with while the command runs (see :meth:`JobServices.run`).
_INTERRUPT = {signal.SIGINT}


def _command_setup(mask: set[signal.Signals]) -> Callable[[], None]:
    """The ``preexec_fn`` of the job's command: the signal mask ``mask`` back (SIGINT is held
    in this process while the command runs), SIGTERM when this process dies."""
    parent_death = dies_with_me(signal.SIGTERM)

    def setup() -> None:
        # (SIGINT as after the exec — default — before it is let in: a Ctrl-C typed now is
        # the command's, and is not lost in a copy of this process's handler)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        parent_death()

    return setup


def _start_watchdog() -> Watchdog | None:
    """The watchdog of a job's command (see :meth:`JobServices.run`); ``None``, said on
    stderr, where it cannot start: the job runs without it."""
    try:
        return Watchdog(ORPHAN_GRACE)
    except OSError as exc:
        print(f"instride job: no watchdog ({exc}): if this process is killed outright, what "
              "its command started runs on", file=sys.stderr, flush=True)
        return None


class _Interrupted(BaseException):
    """A signal arrived while the services were starting."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"signal {signum}")


# ---------------------------------------------------------------------- the services
class JobServices:
    """The instride services of one job: Redis, a data server per node, a job token.

    Subclasses implement :meth:`detect` (the job id, the nodes, this node and its address)
    and :meth:`per_node` (the command that runs one process on every node).

    Parameters
    ----------
    dir_pattern
        Managed directory of every node: ``%n`` is the node name and ``%j`` the job id (it must
        appear, so the directory is fresh). Default: ``/dev/shm/instride-<uid>-job%j``.
    port
        TCP port of every node's data server.
    iface
        Network interface whose address the data servers listen on (e.g. ``ib0``); default:
        the address on the route to Redis.
    redis_url
        An existing Redis (``redis://[:password@]host:port/db``) instead of starting one
        (default: ``INSTRIDE_REDIS_URL``).
    ready_timeout
        Seconds the services have to come up (finite, > 0).
    state_dir
        Node-local directory where each node records its running service (stale-service
        check); default ``/tmp/instride-<uid>-services``.
    env
        The environment to start from (default: this process's).

    Raises
    ------
    ConfigError
        A bad ``dir_pattern``, ``port``, ``ready_timeout`` or Redis URL.
    """

    #: Name of the launcher (``--launcher``).
    name = "base"
    #: Variables of the caller that must not reach the per-node command (placement settings
    #: meant for the job's own steps).
    agent_env_drop: tuple[str, ...] = ()

    def __init__(
        self,
        *,
        dir_pattern: str | None = None,
        port: int = DEFAULT_PORT,
        iface: str | None = None,
        redis_url: str | None = None,
        ready_timeout: float = 60.0,
        state_dir: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.base_env = dict(os.environ if env is None else env)
        self.dir_pattern = check_dir_pattern(
            dir_pattern or self.base_env.get("INSTRIDE_JOB_DIR") or default_dir_pattern())
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError("--port", port, "expected a TCP port (1-65535)")
        self.port = port
        self.iface = iface
        given = redis_url if redis_url is not None else self.base_env.get("INSTRIDE_REDIS_URL")
        given = (given or "").strip()
        self.external_redis = check_redis_url(given) if given else None
        if (isinstance(ready_timeout, bool) or not isinstance(ready_timeout, (int, float))
                or not math.isfinite(ready_timeout) or ready_timeout <= 0):
            raise ConfigError("--ready-timeout", ready_timeout,
                              "expected a finite number of seconds > 0")
        self.ready_timeout = float(ready_timeout)
        self.state_dir = state_dir or self.base_env.get("INSTRIDE_JOB_STATE_DIR")
        # filled by detect()
        self.job_id = ""
        self.nodes: list[str] = []
        self.this_node = ""
        self.this_addr = ""
        # filled by up()
        self.token = ""
        self.redis_url = ""
        self.addrs: dict[str, str] = {}
        self.workdir: Path | None = None
        self._redis: subprocess.Popen[bytes] | None = None
        self._agents: subprocess.Popen[bytes] | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._watchdog: Watchdog | None = None  # (while run() runs: see _start_watchdog)
        #: the first of SIGTERM/SIGINT/SIGHUP received during :meth:`run`
        self._signalled: int | None = None
        self._forwarded = False
        self._forwarded_at = 0.0

    # ------------------------------------------------------------------ subclass API
    def detect(self) -> None:
        """Fill :attr:`job_id`, :attr:`nodes`, :attr:`this_node`, :attr:`this_addr`.

        Raises
        ------
        NoAllocationError
            When there is no allocation to run in.
        """
        raise NotImplementedError

    def per_node(self, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` once on every node of the job."""
        raise NotImplementedError

    def step_env(self) -> dict[str, str]:
        """Launcher-specific variables for the job's commands."""
        return {}

    def registered(self) -> bool:
        """Whether every node's agent has registered (in :attr:`addrs`)."""
        return set(self.nodes) <= set(self.addrs)

    def signal_agents(self) -> None:
        """Ask every node agent to stop (default: SIGTERM to the per-node command)."""
        if self._agents is not None and self._agents.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._agents.send_signal(signal.SIGTERM)

    def force_stop_agents(self) -> None:
        """Last resort when the agents do not stop (default: nothing more)."""

    # ------------------------------------------------------------------ environment
    def _clean_env(self) -> dict[str, str]:
        return {k: v for k, v in self.base_env.items() if k not in NODE_VARS + JOB_VARS}

    def job_env(self) -> dict[str, str]:
        """Variables every process of the job shares (token, Redis, directory pattern)."""
        env = {
            "INSTRIDE_REDIS_URL": self.redis_url,
            "INSTRIDE_TOKEN": self.token,
            "INSTRIDE_JOB_ID": self.job_id,
            "INSTRIDE_JOB_DIR": self.dir_pattern,
            "INSTRIDE_JOB_PORT": str(self.port),
            "INSTRIDE_NODE_ENV": str(node_env_script()),
        }
        if self.iface:
            env["INSTRIDE_JOB_IFACE"] = self.iface
        if self.state_dir:
            env["INSTRIDE_JOB_STATE_DIR"] = self.state_dir
        return env

    def command_env(self) -> dict[str, str]:
        """The environment of the job's command on this node (after :meth:`up`)."""
        env = self._clean_env()
        env.update(self.job_env())
        env.update(self.step_env())
        if self.this_node in self.addrs:
            env.update(
                INSTRIDE_DIR=str(expand_dir(self.dir_pattern, self.this_node, self.job_id)),
                INSTRIDE_ADDR=self.addrs[self.this_node], INSTRIDE_NODE=self.this_node,
            )
        return env

    def describe(self) -> str:
        """What :meth:`up` would start (or started), for ``--dry-run`` and logs."""
        agent = [sys.executable, "-m", "instride.launch.agent"]
        redis = (f"use {redact(self.external_redis)}" if self.external_redis else
                 f"redis-server --bind {self.this_addr} --port <free> --requirepass <fresh>")
        lines = [
            f"launcher:  {self.name}",
            f"job:       {self.job_id}",
            f"nodes:     {' '.join(self.nodes)}",
            f"redis:     {redis}",
            f"servers:   {' '.join(self.per_node(agent))}",
            f"directory: {self.dir_pattern}  (%n: node, %j: job)",
            f"port:      {self.port}" + (f" on {self.iface}" if self.iface else ""),
            f"steps:     {node_env_script()} sets INSTRIDE_DIR/ADDR/NODE per node",
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ life cycle
    def up(self) -> dict[str, str]:
        """Start Redis and every node's service; return the environment of job commands.

        On any failure everything started so far is stopped before the error is raised.

        Raises
        ------
        NoAllocationError
            Outside an allocation.
        MetadataUnavailable
            ``INSTRIDE_REDIS_URL`` is given but does not answer.
        ServerStartError
            A node's service did not start (:class:`StaleServiceError`: an earlier job's
            service still runs there); the message names the node.
        LaunchError
            Redis did not start, or this node is not part of the job.
        """
        self.detect()
        script = node_env_script()
        if not os.access(script, os.X_OK):
            try:
                script.chmod(script.stat().st_mode | 0o111)
            except OSError as exc:
                raise LaunchError(f"{script} (the task prolog) is not executable and cannot be "
                                  f"made so: {exc.strerror}; reinstall instride") from None
        try:
            self._check_signal()
            self.workdir = Path(tempfile.mkdtemp(prefix=f"instride-job{self.job_id}-"))
            if self._watchdog is not None:  # (removed if this process is killed outright)
                self._watchdog.remove_after(self.workdir)
            self.token = secrets.token_hex(16)
            if self.external_redis:
                ping_redis(self.external_redis)
                self.redis_url = self.external_redis
                self._clear_registry()
            else:
                self._start_redis()
            self._check_signal()
            self._start_agents()
        except BaseException as exc:
            self.down()
            if self._signalled is not None and not isinstance(exc, _Interrupted):
                # (a cancelled job's signal reached Redis or an agent too, which ended before
                # the start looked at it: the job was cancelled — 128 + N — not unavailable)
                raise _Interrupted(self._signalled) from exc
            raise
        return self.command_env()

    def _start_redis(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise LaunchError("redis-server is not installed on the first node; install it "
                              "(apt-get install redis-server) or set INSTRIDE_REDIS_URL")
        assert self.workdir is not None
        with socket.socket() as s:
            try:
                s.bind((self.this_addr, 0))
            except OSError as exc:
                raise LaunchError(
                    f"cannot listen on {self.this_addr} (the address of {self.this_node}): "
                    f"{exc.strerror}; run `instride job` on the job's first node") from None
            port = s.getsockname()[1]
        password = secrets.token_hex(16)
        log = self.workdir / "redis.log"
        with open(log, "ab") as out:
            self._redis = subprocess.Popen(  # (SIGTERM if this process dies outright)
                [exe, "-"], stdin=subprocess.PIPE, stdout=out, stderr=out,
                env=self._clean_env(), cwd=self.workdir,
                preexec_fn=dies_with_me(signal.SIGTERM),
                # (a terminal's Ctrl-C goes to its whole foreground group: Redis stopped at
                # once, while the command still handled its interrupt and needed it)
                start_new_session=True)
        # The configuration goes through stdin: the password never shows in `ps`.
        quoted = str(self.workdir).replace("\\", "\\\\").replace('"', '\\"')
        conf = (f"bind {self.this_addr}\nport {port}\nrequirepass {password}\nsave \"\"\n"
                f"appendonly no\nprotected-mode no\ndaemonize no\nloglevel warning\n"
                f'dir "{quoted}"\n')  # (quoted: a TMPDIR with a space made Redis refuse it)
        assert self._redis.stdin is not None
        self._redis.stdin.write(conf.encode())
        self._redis.stdin.close()
        self.redis_url = f"redis://:{password}@{self.this_addr}:{port}/0"
        deadline = time.monotonic() + 10.0
        while True:
            if self._redis.poll() is not None:
                raise LaunchError(f"redis-server exited with status {self._redis.returncode}:"
                                  f"\n{tail(log)}")
            try:
                ping_redis(self.redis_url, timeout=0.5)
                return
            except MetadataUnavailable:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"redis-server did not answer within 10 s:\n{tail(log)}") from None
                self._check_signal()
                time.sleep(0.05)

    def _clear_registry(self) -> None:
        client = redis_client(self.redis_url)
        try:
            client.delete(REGISTRY.format(job=self.job_id), ERRORS.format(job=self.job_id))
        finally:
            client.close()

    def agent_env(self) -> dict[str, str]:
        """The environment of the per-node command: the job's, without :attr:`agent_env_drop`."""
        env = {k: v for k, v in self._clean_env().items() if k not in self.agent_env_drop}
        env.update(self.job_env())
        env["INSTRIDE_JOB_READY_TIMEOUT"] = repr(self.ready_timeout)  # (its server's start too)
        return env

    def _check_signal(self) -> None:
        """Give up starting when :meth:`run` received a signal (raises :class:`_Interrupted`)."""
        if self._signalled is not None:
            raise _Interrupted(self._signalled)

    def _start_agents(self) -> None:
        assert self.workdir is not None
        env = self.agent_env()
        argv = self.per_node([sys.executable, "-m", "instride.launch.agent"])
        log = self.workdir / "services.log"
        with open(log, "ab") as out:
            try:
                self._agents = subprocess.Popen(  # (mpiexec, srun: they pass SIGTERM on)
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                    preexec_fn=dies_with_me(signal.SIGTERM),
                    start_new_session=True)  # (as Redis: stopped by this process, in order)
            except OSError as exc:  # (no srun on PATH, ...)
                raise LaunchError(f"cannot start the services: {argv[0]}: {exc.strerror}") \
                    from None
        import redis

        client = redis_client(self.redis_url)
        registry, errors = REGISTRY.format(job=self.job_id), ERRORS.format(job=self.job_id)
        deadline = time.monotonic() + self.ready_timeout
        try:
            while True:
                failed = client.hgetall(errors)
                if failed:
                    node = sorted(failed)[0]
                    raise _node_error(node, failed[node])
                self.addrs = client.hgetall(registry)
                if self.registered():
                    return
                missing = sorted(set(self.nodes) - set(self.addrs)) or ["?"]
                if self._agents.poll() is not None:
                    raise ServerStartError(
                        ",".join(missing), f"`{argv[0]}` exited with status "
                        f"{self._agents.returncode} before they started:\n{tail(log)}")
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        ",".join(missing), f"not up within {self.ready_timeout:g} s:\n"
                        f"{tail(log)}")
                self._check_signal()
                time.sleep(0.05)
        except redis.RedisError as exc:
            raise MetadataUnavailable(redact(self.redis_url),
                                      f"while the services started: {exc}") from None
        finally:
            client.close()

    def down(self) -> None:
        """Stop every node's service, then Redis; remove the launcher's files.

        Safe to call more than once and after a failed :meth:`up`. Each step runs also when
        one before it failed (a services step that does not end even after SIGKILL: a
        ``srun`` stuck on a hung file system); the first failure is raised after them.
        """
        try:
            if self._agents is not None:
                self.signal_agents()
                try:
                    self._agents.wait(20.0)
                except subprocess.TimeoutExpired:
                    self.force_stop_agents()
                    if not _stop(self._agents, 10.0):
                        _killed(self._agents, "the services step (a launcher stuck on a hung "
                                              "file system?)")
                self._agents = None
        finally:
            try:
                if self._redis is not None:
                    if not _stop(self._redis, 5.0):
                        _killed(self._redis, "the job's Redis")
                    self._redis = None
                elif self.external_redis and self.redis_url:
                    with contextlib.suppress(Exception):
                        self._clear_registry()
            finally:
                if self.workdir is not None:
                    if self.base_env.get("INSTRIDE_JOB_DEBUG"):
                        for log in sorted(self.workdir.glob("*.log")):
                            print(f"--- {log.name}\n{tail(log, 50)}", file=sys.stderr)
                    shutil.rmtree(self.workdir, ignore_errors=True)
                    self.workdir = None

    def run(self, argv: Sequence[str]) -> int:
        """Start the services, run ``argv`` on this node, stop the services; return its status.

        SIGTERM, SIGINT and SIGHUP (what ``scancel`` and a time limit send) are passed on to
        the command (a signal while the services start stops the start) — but not a
        terminal's Ctrl-C, which the terminal sends to its whole foreground process group:
        the command has it already (and decides what follows), and ``mpiexec`` or ``srun``
        take a second one within a second as "abort now", skipping their cleanup. The
        services are stopped in every case. A command killed by signal N gives 128 + N.

        Raises
        ------
        ServiceLostError
            The services' per-node command ended while ``argv`` ran (a node's data server
            died, an agent was killed): ``argv`` was sent SIGTERM (SIGKILL after
            :data:`STOP_GRACE` s) and the services stopped.
        """
        if not argv:
            raise ConfigError("command", list(argv), "expected a command after --")
        handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        self._signalled, self._forwarded, self._forwarded_at = None, False, 0.0

        # The handler never raises: an exception raised at an arbitrary point (in a `finally`
        # before the teardown) could skip the teardown. The start polls for the signal instead.
        def on_signal(signum: int, _frame: object) -> None:
            self._on_signal(signum)

        previous = {s: signal.signal(s, on_signal) for s in handled}
        # What the command leaves running when it ends (a script's background programs) is
        # adopted here and stopped before the services it uses go
        adopting = become_subreaper(True)
        ours: set[int] = set()
        # If this process is killed outright (no teardown of its own), a watchdog stops what
        # the command started — found by a cookie in its environment, also what left its
        # process group — and removes the job's working directory
        try:
            try:
                self._watchdog = _start_watchdog()
                env = self.up()
                if self._watchdog is not None:
                    cookie = f"{self.job_id}-{secrets.token_hex(8)}"
                    env[JOB_COOKIE] = cookie
                    self._watchdog.watch_env(f"{JOB_COOKIE}={cookie}")
                print(f"instride job {self.job_id}: services up on {len(self.nodes)} node(s) "
                      f"({', '.join(f'{n}={a}' for n, a in sorted(self.addrs.items()))}), "
                      f"Redis {redact(self.redis_url)}", file=sys.stderr, flush=True)
                self._check_signal()
                ours = children()  # (Redis, the services' launcher, and whatever else is ours)
                # While the command runs, SIGINT is held and taken in with its sender
                # (sigtimedwait): a terminal's is not passed on to a command that had it too
                mask = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPT)
                try:
                    try:  # (SIGTERM to it if this process dies outright)
                        self._child = subprocess.Popen(list(argv), env=env,
                                                       preexec_fn=_command_setup(mask))
                    except OSError as exc:
                        raise LaunchError(f"cannot run {argv[0]!r}: {exc.strerror}") from None
                    if self._signalled is not None and not self._forwarded:
                        # arrived between the check and the start: the command gets it now
                        self._forwarded, self._forwarded_at = True, time.monotonic()
                        with contextlib.suppress(ProcessLookupError):
                            self._child.send_signal(self._signalled)
                    return self._wait_child(self._child)
                finally:
                    self._take_interrupts()  # (those that came as it ended)
                    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            except _Interrupted as exc:
                return 128 + exc.signum
            finally:
                try:
                    if adopting and self._child is not None:
                        # (a job being cancelled has Slurm's KillWait, 30 s by default, for
                        # all of its teardown: what the command left gets 5 s then)
                        left = stop_adopted(ours, 5.0 if self._signalled else STOP_GRACE)
                        if left:
                            print(f"instride job: stopped {len(left)} process(es) the command "
                                  f"left running (pids {', '.join(map(str, left))})",
                                  file=sys.stderr, flush=True)
                finally:
                    try:
                        self.down()
                    finally:
                        if self._watchdog is not None:  # (torn down: it exits, signalling
                            self._watchdog.done()  # nothing)
                            self._watchdog = None
        finally:
            self._child = None
            if adopting:
                become_subreaper(False)
            for s, h in previous.items():
                signal.signal(s, h)

    def _on_signal(self, signum: int) -> None:
        """A signal that stops the job (see :meth:`run`): remembered; passed on to the command
        if it runs."""
        if self._signalled is None:
            self._signalled = signum
        child = self._child
        if child is not None and child.poll() is None:
            if not self._forwarded:
                self._forwarded_at = time.monotonic()
            self._forwarded = True
            with contextlib.suppress(ProcessLookupError):
                child.send_signal(signum)

    def _take_interrupts(self) -> None:
        """Take in the SIGINTs held while the command runs (see :meth:`run`).

        One the kernel sent is a terminal's Ctrl-C: the terminal sent it to its foreground
        process group, this process's — so the command, in that group too, had it already
        (what ``sudo`` does: it passes on only the signals a process sent). What follows is
        the command's to decide, as under a shell: one Ctrl-C makes ``srun`` print its
        tasks' status and go on, two within a second abort it; the job ends when the command
        does. One a process sent (``kill``) stops the job as SIGTERM does (:meth:`_on_signal`):
        it cannot be told apart from one sent to this process alone.
        """
        child = self._child
        while (info := signal.sigtimedwait(_INTERRUPT, 0)) is not None:
            if info.si_code == _SI_KERNEL and child is not None:
                with contextlib.suppress(ProcessLookupError):
                    if os.getpgid(child.pid) == os.getpgrp():
                        continue  # (the command had it from the terminal)
            self._on_signal(info.si_signo)

    def _wait_child(self, child: subprocess.Popen[bytes]) -> int:
        """Wait for the command; stop it if the services end under it, SIGKILL it if it is
        still there :data:`STOP_GRACE` s after a signal was passed on (see :meth:`run`)."""
        killed = False
        reported = _Reports(self.redis_url, self.job_id)
        try:
            return self._wait_child_reported(child, reported, killed)
        finally:
            reported.close()

    def _wait_child_reported(self, child: subprocess.Popen[bytes], reported: _Reports,
                             killed: bool) -> int:
        """:meth:`_wait_child`; ``reported``: the nodes' reports of a service lost, looked at
        once a second (a node's data server that died under ``mpiexec`` ends its agent, and
        MPICH's ``mpiexec`` lets the other agents run on: the services step does not end)."""
        while True:
            try:
                rc = child.wait(AGENT_POLL)
                return 128 - rc if rc < 0 else rc
            except subprocess.TimeoutExpired:
                pass
            self._take_interrupts()
            if (self._forwarded and not killed
                    and time.monotonic() - self._forwarded_at > STOP_GRACE):
                print(f"instride job: the command did not end within {STOP_GRACE:g} s of the "
                      f"signal; SIGKILL to pid {child.pid}", file=sys.stderr, flush=True)
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                killed = True
            agents_gone = self._agents is not None and self._agents.poll() is not None
            redis_gone = self._redis is not None and self._redis.poll() is not None
            failed = {} if agents_gone or redis_gone or self._signalled is not None \
                else reported.failed()
            if not (agents_gone or redis_gone or failed):
                continue
            if self._signalled is not None:
                continue  # the job is cancelled: the services end with it
            if failed:
                node = sorted(failed)[0]
                lost = ServiceLostError(",".join(sorted(failed)), failed[node].partition("|")[2]
                                        or failed[node])
            elif agents_gone:
                assert self._agents is not None
                lost = self._lost_service(self._agents.returncode)
            else:  # (the OOM killer, an operator: no record of any frame can be read or made)
                assert self._redis is not None and self.workdir is not None
                lost = ServiceLostError(
                    self.this_node, f"the job's Redis (redis-server) exited with status "
                    f"{self._redis.returncode}:\n{tail(self.workdir / 'redis.log')}".rstrip())
            print(f"instride job: the services ended under the command (node {lost.node}); "
                  f"stopping it (SIGTERM to pid {child.pid})", file=sys.stderr, flush=True)
            if not _stop(child, STOP_GRACE):
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                child.wait()
            raise lost

    def _lost_service(self, status: int) -> ServiceLostError:
        """The error of a per-node command that ended while the job's command ran."""
        nodes: list[str] = []
        with contextlib.suppress(Exception):  # Redis may be unreachable: the log says more
            client = redis_client(self.redis_url, timeout=2.0)
            try:
                nodes = sorted(client.hgetall(ERRORS.format(job=self.job_id)))
            finally:
                client.close()
        log = tail(self.workdir / "services.log") if self.workdir else "(no log)"
        cmd = self.per_node(["..."])[0]
        return ServiceLostError(",".join(nodes) or "?",
                                f"`{cmd}` of the services exited with status {status}:\n{log}")


def _killed(proc: Any, what: str) -> None:
    """SIGKILL ``proc`` and wait 5 s for it; :class:`LaunchError` naming ``what`` where even
    that does not end it (a bare ``TimeoutExpired`` before: a traceback)."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{what} (pid {proc.pid}) did not end even after SIGKILL") from None


class _Reports:
    """The nodes' reports of a service that ended (the job's ``ERRORS`` hash), looked at once
    a second at most; nothing where Redis cannot be reached (its own loss is seen apart)."""

    def __init__(self, redis_url: str | None, job: str) -> None:
        self.url, self.key = redis_url, ERRORS.format(job=job)
        self.client: Any = None
        self.next = 0.0

    def failed(self) -> dict[str, str]:
        now = time.monotonic()
        if self.url is None or now < self.next:
            return {}
        self.next = now + 1.0
        try:
            if self.client is None:
                self.client = redis_client(self.url, timeout=2.0)
            return {str(k): str(v) for k, v in self.client.hgetall(self.key).items()}
        except Exception:  # noqa: BLE001 - (looked at again a second later)
            self.close()
            return {}

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.close()
            self.client = None


def _node_error(node: str, message: str) -> ServerStartError:
    """Rebuild a node agent's error from its ``kind|...`` message."""
    kind, _, rest = message.partition("|")
    if kind == "stale":
        job, _, pid = rest.partition("|")
        return StaleServiceError(node, job, int(pid) if pid.isdigit() else -1)
    return ServerStartError(node, rest or message)


__all__ = [
    "ERRORS", "REGISTRY", "JobServices", "LaunchError", "NoAllocationError",
    "ServerStartError", "ServiceLostError", "StaleServiceError", "check_dir_pattern",
    "check_redis_url", "default_dir_pattern",
    "expand_dir", "iface_address", "node_env_script", "node_name", "ping_redis", "redact",
    "resolve_ipv4", "route_address",
]
