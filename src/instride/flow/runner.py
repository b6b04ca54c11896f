"""The runner: validate a graph, start every module instance through a launcher, watch them.

:func:`run` validates the graph against the launcher's nodes (nothing starts if it is bad),
gives the run a unique stream prefix ``flow/<graph>-<id>``, starts one process per module
instance with its ports in the environment, and waits. When every instance has returned, the
run's streams are removed and its counters, ``trace.json`` and ``timeline.png`` are written to
the output directory. When one instance fails, every other one is stopped (its process group:
SIGTERM, then SIGKILL), the streams are removed and :class:`ModuleFailed` names the module.
A program (``command=``) that exits with status 0 has finished, whether or not it called
``ports.close()``: what it left open (output streams, its inputs' consumer groups) is closed
for it by ``python -m instride.flow.worker --end``, started on its node, so that its consumers
end (they waited for ever) and its producers no longer wait for it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import parse_timeout
from ..errors import ConfigError
from ..orphans import Watchdog
from .errors import FlowError, FlowTimeout, ModuleFailed
from .graph import Graph
from .launchers import Launcher, LocalLauncher, slurm_state_root
from .ports import group_name, stream_name
from .resolve import graph_dirs

#: Seconds an instance gets between SIGTERM and SIGKILL when the graph is stopped.
STOP_GRACE = 3.0
#: Seconds between the runner's signs of life: it touches its run's ``alive`` file (its
#: modification time) while the graph runs, so that ``instride top`` on another host, which
#: cannot check the runner's pid, can tell a live run from one killed there.
HEARTBEAT = 5.0
HEARTBEAT_FILE = "alive"


def mpiexec() -> str:
    """The MPI launcher: ``$INSTRIDE_MPIEXEC``, the one next to Python, or ``mpiexec`` on PATH.

    Raises
    ------
    FlowError
        None is found.
    """
    found = os.environ.get("INSTRIDE_MPIEXEC") or (
        str(Path(sys.executable).with_name("mpiexec"))
        if Path(sys.executable).with_name("mpiexec").exists() else shutil.which("mpiexec"))
    if not found:
        raise FlowError("no mpiexec found for an mpi module: `pip install mpich` or set "
                        "INSTRIDE_MPIEXEC")
    return found


def default_state_root() -> Path:
    """The per-user temp dir runs are recorded in by default (this host's own)."""
    return Path("/tmp") / f"instride-flow-{os.getuid()}"


def private_state_root(root: Path) -> None:
    """Make the runs' state directory ``root`` (mode 0700) and check that it is this user's:
    not a symbolic link, not writable by others. The instances import what its runs'
    ``spec.json`` names: another user who made it first (the default is a predictable name
    in ``/tmp``) would have their code run in every module.

    Raises
    ------
    ConfigError
        A symbolic link, not a directory, another user's, or writable by group or others.
    """
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(root)
    except OSError as exc:
        raise ConfigError("INSTRIDE_FLOW_STATE", str(root),
                          f"cannot make it: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError("INSTRIDE_FLOW_STATE", str(root), "not a directory (or a symbolic link)")
    if st.st_uid != os.getuid():
        raise ConfigError("INSTRIDE_FLOW_STATE", str(root),
                          f"owned by uid {st.st_uid}, not {os.getuid()}: its runs' programs "
                          "would be theirs to choose")
    if st.st_mode & 0o022:
        raise ConfigError("INSTRIDE_FLOW_STATE", str(root),
                          f"writable by others (mode {stat.S_IMODE(st.st_mode):o}): its runs' "
                          "programs would be theirs to choose; chmod go-w it")


def state_root() -> Path:
    """Directory of the runs in progress (``INSTRIDE_FLOW_STATE``, else a per-user temp dir)."""
    raw = os.environ.get("INSTRIDE_FLOW_STATE")
    return Path(raw) if raw else default_state_root()


def state_roots() -> list[Path]:
    """Every directory runs started from here are recorded in: :func:`state_root`, and inside
    a Slurm allocation the Slurm launcher's (``$SLURM_SUBMIT_DIR/.instride-flow``)."""
    roots = [state_root()]
    if os.environ.get("SLURM_JOB_ID"):
        slurm = slurm_state_root(os.environ)
        if slurm != roots[0]:
            roots.append(slurm)
    return roots


def host() -> str:
    """This host's name, as recorded in a run's ``run.json``."""
    return socket.gethostname()


def launcher_kind(launcher: Launcher) -> str:
    """A launcher's short name (its ``name``, else its class name)."""
    return str(getattr(launcher, "name", type(launcher).__name__))


@dataclass
class RunResult:
    """What a finished run leaves.

    Attributes
    ----------
    graph
        The graph's name.
    prefix
        The stream prefix the run used (removed when it ended).
    seconds
        Wall time from the first start to the last exit.
    stats
        The final counters of every instance (see :meth:`Ports.stats`).
    out
        The output directory, with ``trace.json``, ``timeline.png``, ``stats.json``, ``logs/``.
    """

    graph: str
    prefix: str
    seconds: float
    stats: list[dict[str, Any]] = field(default_factory=list)
    out: Path | None = None

    def instance(self, module: str, instance: int = 0) -> dict[str, Any]:
        """Counters of one instance."""
        for s in self.stats:
            if s["module"] == module and s["instance"] == instance:
                return s
        raise KeyError(f"{module}[{instance}]")


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _terminated(signum: int, frame: Any) -> None:
    raise FlowError(f"the flow runner received signal {signum}; the graph was stopped")


def _held_off(signum: int, frame: Any) -> None:
    """A signal during the teardown: dropped (see :func:`run`)."""


def _stop(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    # Signals go to an instance's process group (its session, pgid = its PID) only while the
    # leader is not yet reaped, so the group id cannot belong to anyone else.
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)  # the instance's own session
    deadline = time.monotonic() + STOP_GRACE
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run(
    graph: Graph,
    *,
    out: str | os.PathLike[str] | None = None,
    launcher: Launcher | None = None,
    timeout: float | None = None,
    trace: bool = True,
    keep_streams: bool = False,
    on_event: Callable[[str], None] | None = None,
) -> RunResult:
    """Run a graph to completion.

    Parameters
    ----------
    graph
        The graph; validated first.
    out
        Output directory: ``trace.json`` (Chrome trace), ``timeline.png``, ``stats.json``,
        the instances' logs (``logs/``); modules find it as ``ports.out_dir``.
    launcher
        Where instances run (default :class:`LocalLauncher`: processes on this machine).
    timeout
        Stop the graph and raise :class:`FlowTimeout` after this many seconds.
    trace
        Record wait/get/compute/put regions (needed for ``trace.json``).
    keep_streams
        Leave the run's streams in place (default: removed at the end).
    on_event
        Called with a line of text when an instance starts, ends or fails.

    Returns
    -------
    RunResult

    Raises
    ------
    GraphError
        The graph is not valid (nothing was started).
    ModuleFailed
        An instance failed; every other one was stopped and the streams removed.
    FlowTimeout
        ``timeout`` passed; the graph was stopped.
    FlowError
        An instance's program could not be started (not found), or what a program that
        exited with status 0 left open could not be ended; the ones started were stopped.
    ConfigError
        ``out`` cannot be made a directory (a file is there).
    """
    # the writers' default put timeout: the run's, as given (inf: none, not INSTRIDE_TIMEOUT's)
    put_default = timeout
    if timeout is not None:
        timeout = parse_timeout(timeout, "timeout")  # (NaN never timed out; -5 at once)
    launcher = launcher or LocalLauncher()
    say = on_event or (lambda line: None)
    nodes = launcher.nodes()
    graph.validate(nodes)  # imports every module function too
    for m in graph.modules.values():
        if m.mpi:
            mpiexec()
    out_dir = Path(out).resolve() if out is not None else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file there, no permission
            raise ConfigError("out", str(out), f"cannot make the output directory: "
                                               f"{exc.strerror or exc}") from None
    root = getattr(launcher, "state_root", None) or state_root()  # shared for batch launchers
    private_state_root(root)  # (before anything in it is read: gc_stale acts on its records)
    gc_stale(launcher)
    run_id = secrets.token_hex(4)
    prefix = f"flow/{graph.name}-{run_id}"
    state = root / f"{graph.name}-{run_id}"
    try:
        state.mkdir(mode=0o700)
        for sub in ("stats", "trace", "logs"):
            (state / sub).mkdir(parents=True)
        spec = {"graph": graph.to_dict(), "prefix": prefix, "state": str(state),
                "out": str(out_dir) if out_dir else None, "trace": trace, "timeout": put_default}
        (state / "spec.json").write_text(json.dumps(spec))
        (state / HEARTBEAT_FILE).touch()
        placement = graph.placement(nodes)
        # the host (and job) tell a runner on another node sharing this root that it cannot
        # judge whether this run is alive by its pid
        (state / "run.json").write_text(json.dumps({
            "graph": graph.name, "prefix": prefix, "pid": os.getpid(), "host": host(),
            "slurm_job": os.environ.get("SLURM_JOB_ID"), "started": time.time(),
            "launcher": launcher_kind(launcher),
            "instances": [[m, i, placement[(m, i)]] for m, i in graph.instances()],
        }))
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)  # no run.json yet: gc_stale would never see it
        raise
    # (the instances import what validate() imported: from here, beside the graph files
    # loaded, whose sibling modules a graph file may import, and from wherever this process
    # imports — a graph file's own sys.path.insert too: a function found only there passed
    # validate() and failed in every instance)
    pythonpath = os.pathsep.join(dict.fromkeys(
        p for p in [os.getcwd(), *graph_dirs, os.environ.get("PYTHONPATH", ""),
                    *(e for e in sys.path if e and os.path.isdir(e))] if p))

    # SIGTERM (a batch system cancelling the job) and SIGHUP (the terminal or ssh session
    # closed) unwind like Ctrl-C: instances are stopped and streams removed by the finally
    # block below (a SIGHUP that nohup ignores stays ignored).
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _terminated)
        if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
            previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, _terminated)
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
    logs: dict[tuple[str, int], Path] = {}
    #: where and in which environment each process was started (what it left open is ended
    #: there: the streams' heads and groups live on its node in local mode)
    started: dict[tuple[str, int], tuple[str, dict[str, str]]] = {}
    #: ``python -m instride.flow.worker --end`` of the programs that exited with status 0
    enders: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
    t0 = time.monotonic()
    failed: FlowError | None = None
    primary: BaseException | None = None  # (what the run raised: a teardown error does not hide it)
    watchdog: Watchdog | None = None
    try:
        # stops the instances' process groups (not only their first processes) if we are
        # killed outright
        watchdog = Watchdog(STOP_GRACE)
        # ... and what they started that left their groups, or outlived them: every process
        # of this machine whose environment names this run (its instances' descendants)
        watchdog.watch_env(f"INSTRIDE_FLOW_PREFIX={prefix}")
        for name, i in graph.instances():
            m = graph.modules[name]
            if m.mpi and i > 0:
                continue  # one mpiexec starts every rank
            node = placement[(name, i)]
            env = launcher.env(node)
            env.update({
                "INSTRIDE_FLOW_SPEC": str(state / "spec.json"),
                "INSTRIDE_FLOW_MODULE": name,
                "INSTRIDE_FLOW_PREFIX": prefix,
                "PYTHONPATH": pythonpath,
            })
            if out_dir:
                env["INSTRIDE_FLOW_OUT_DIR"] = str(out_dir)
            argv = m.command or [sys.executable, "-m", "instride.flow.worker"]
            if m.mpi and m.command:
                # one mpiexec, one MPMD segment per rank (rank = instance): `env` gives each
                # rank its own port variables, as a separate process would get them
                segments: list[str] = []
                for rank in range(m.instances):
                    segments += [":"] if segments else []
                    segments += ["-n", "1", "env", *(f"{k}={v}" for k, v in
                                                     _port_env(graph, prefix, name, rank).items()),
                                 *argv]
                argv = [mpiexec(), *segments]
                env.pop("INSTRIDE_FLOW_INSTANCE", None)
            elif m.mpi:  # a Python module: each rank finds its instance in PMI_RANK
                argv = [mpiexec(), "-n", str(m.instances), *argv]
                env.pop("INSTRIDE_FLOW_INSTANCE", None)
            else:
                env.update(_port_env(graph, prefix, name, i))
            logs[(name, i)] = state / "logs" / f"{name}.{i}.log"
            with open(logs[(name, i)], "wb") as log:
                try:
                    procs[(name, i)] = launcher.start(node, argv, env, log)
                    watchdog.watch(procs[(name, i)].pid)  # (its session: pgid = its PID)
                    started[(name, i)] = (node, env)
                except OSError as exc:  # no such program: stop what started (finally below)
                    raise FlowError(f"module {name!r} instance {i} could not be started on "
                                    f"{node}: {argv[0]}: {exc.strerror or exc}; the graph was "
                                    "stopped") from None
            what = f"{name}[0..{m.instances - 1}] (mpiexec)" if m.mpi else f"{name}[{i}]"
            say(f"started {what} on {node} (pid {procs[(name, i)].pid})")
            _beat(state)  # (starts through a batch system can take a while)
        pending = set(procs)
        beat = 0.0
        while pending or enders:
            if time.monotonic() - beat >= HEARTBEAT:  # (a sign of life for `top` elsewhere)
                beat = time.monotonic()
                _beat(state)
            for key in sorted(pending):
                rc = procs[key].poll()
                if rc is None:
                    continue
                pending.discard(key)
                watchdog.forget(procs[key].pid)
                if rc != 0:  # (its outputs stay open: its consumers are stopped, below)
                    failed = ModuleFailed(key[0], key[1], rc, _tail(logs[key]))
                    say(f"FAILED {key[0]}[{key[1]}] (exit status {rc})")
                    break
                m = graph.modules[key[0]]
                ranks = list(range(m.instances)) if m.mpi else [key[1]]
                if _has_ports(graph, key[0], ranks) \
                        and (m.command or not _closed(state, key[0], ranks)):
                    # A program may exit without ports.close() (a Python module too, by
                    # os._exit): what it left open is closed for it now that no message can
                    # follow (its consumers waited for ever).
                    node, env = started[key]
                    argv = [sys.executable, "-m", "instride.flow.worker", "--end",
                            *map(str, ranks)]
                    with open(logs[key], "ab") as log:
                        try:
                            enders[key] = launcher.start(node, argv, env, log)
                        except OSError as exc:
                            raise FlowError(f"module {key[0]!r} instance {key[1]} exited; its "
                                            f"output streams could not be ended on {node}: "
                                            f"{exc.strerror or exc}; the graph was "
                                            "stopped") from None
                    watchdog.watch(enders[key].pid)
                    continue
                say(f"finished {key[0]}[{key[1]}]")
            if failed:
                break
            for key in sorted(enders):
                rc = enders[key].poll()
                if rc is None:
                    continue
                watchdog.forget(enders.pop(key).pid)
                if rc != 0:
                    failed = FlowError(
                        f"module {key[0]!r} instance {key[1]} exited with status 0, but the "
                        f"output streams it left open could not be ended (exit status {rc}); "
                        f"the graph was stopped\n{_tail(logs[key])}".rstrip())
                    say(f"FAILED {key[0]}[{key[1]}] (its outputs could not be ended)")
                    break
                say(f"finished {key[0]}[{key[1]}]")
            if failed:
                break
            if timeout is not None and time.monotonic() - t0 > timeout:
                running = sorted(f"{m}[{i}]" for m, i in pending | set(enders))
                raise FlowTimeout(f"graph {graph.name!r} ran past its {timeout} s timeout; "
                                  f"still running: {running}")
            time.sleep(0.05)
        seconds = time.monotonic() - t0
    except BaseException as exc:
        primary = exc
        raise
    finally:
        # a second SIGTERM or Ctrl-C must not cut the teardown short (instances left running,
        # streams and state left behind): ignored until it is done
        held = {}
        if threading.current_thread() is threading.main_thread():
            # (held off by a handler that drops them, not ignored: the programs the teardown
            # starts — scancel, srun, the cleanup — would inherit SIG_IGN, and not stop)
            held = {s: signal.signal(s, _held_off) for s in (signal.SIGTERM, signal.SIGINT,
                                                             *previous)}
        try:
            _stop([*procs.values(), *enders.values()])
            if watchdog is not None:
                for p in [*procs.values(), *enders.values()]:
                    watchdog.forget(p.pid)  # (reaped: their group numbers may be reused)
                # what they left running on this machine (a program's background child, a
                # daemon it started): stopped as the instances were
                watchdog.stop_now()
            try:
                if not keep_streams:
                    launcher.cleanup(prefix)
            finally:
                try:
                    stats = _collect(state)
                    if out_dir:
                        _write_outputs(graph, state, out_dir, stats)
                finally:
                    shutil.rmtree(state, ignore_errors=True)
        except Exception as exc:
            main = primary if primary is not None else failed
            if main is None:
                raise
            main.add_note(f"(then the teardown failed too: {type(exc).__name__}: {exc})")
        finally:
            if held:
                signal.signal(signal.SIGINT, held[signal.SIGINT])
                for sig, before in previous.items():
                    signal.signal(sig, signal.SIG_DFL if before is None else before)
    if failed:
        raise failed
    return RunResult(graph.name, prefix, seconds, stats, out_dir)


def _beat(state: Path) -> None:
    """The runner's sign of life (see :data:`HEARTBEAT`)."""
    with contextlib.suppress(OSError):
        os.utime(state / HEARTBEAT_FILE)


def _port_env(graph: Graph, prefix: str, name: str, i: int) -> dict[str, str]:
    """The environment of instance ``i`` of module ``name`` that names its ports."""
    env = {"INSTRIDE_FLOW_INSTANCE": str(i)}

    def put(kind: str, port: str, value: str) -> None:
        env[f"INSTRIDE_FLOW_{kind}_{port.upper()}"] = value
        if "-" in port:  # (and as a shell can read it: `${INSTRIDE_FLOW_IN_MY-PORT}` is not
            # that variable but a default value)
            env[f"INSTRIDE_FLOW_{kind}_{port.upper().replace('-', '_')}"] = value

    for e in graph.edges_into(name, i):
        put("IN", e.dst_port, stream_name(prefix, e.src, e.src_instance, e.src_port))
        if e.sampling != "newest":  # the consumer group its producer waits for
            put("GROUP", e.dst_port, group_name(e))
    for port in graph.modules[name].outputs:
        put("OUT", port, stream_name(prefix, name, i, port))
    return env


def _closed(state: Path, name: str, instances: Sequence[int]) -> bool:
    """Whether each of ``instances`` of Python module ``name`` closed its ports (its counters
    say done: written by ``ports.close()``, which its worker calls when it returns)."""
    for i in instances:
        try:
            done = json.loads((state / "stats" / f"{name}.{i}.json").read_text()).get("done")
        except (OSError, ValueError, AttributeError):
            return False
        if done is not True:
            return False
    return True


def _has_ports(graph: Graph, name: str, instances: Sequence[int]) -> bool:
    """Whether one of ``instances`` of module ``name`` has what ``ports.close()`` closes: a
    connected output, or an input read as a consumer group."""
    return any(graph.edges_from(name, i)
               or any(e.sampling != "newest" for e in graph.edges_into(name, i))
               for i in instances)


def gc_stale(launcher: Launcher, root: Path | None = None) -> list[str]:
    """Remove what runs killed outright (SIGKILL: no chance to clean up) left behind: their
    streams and state directories.

    Only runs of the same launcher kind recorded by this host are collected: a pid says
    nothing about a process of another host sharing ``root`` (a Slurm job's state on a
    shared file system), and another launcher kind's streams are that kind's to remove (its
    state is kept for it). A record of an older version (no host) is collected only from the
    per-user temp dir, which no other host writes.

    Returns
    -------
    list of str
        The stream prefixes removed.
    """
    root = root or getattr(launcher, "state_root", None) or state_root()
    local_only = root == default_state_root()
    removed = []
    try:  # (a directory others could write: its records name what to remove — not trusted)
        private_state_root(root)
    except ConfigError:
        return removed
    for info_path in root.glob("*/run.json") if root.is_dir() else []:
        try:
            info = json.loads(info_path.read_text())
            if info.get("host", host() if local_only else None) != host():
                continue  # another host's run: its pid cannot be checked here
            os.kill(int(info["pid"]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        if info.get("launcher") != launcher_kind(launcher):
            continue  # left for a run of its kind, which can remove its streams
        if not str(info.get("prefix", "")).startswith("flow/"):
            continue  # (a run's streams are under flow/: nothing else is a run's to remove)
        try:
            launcher.cleanup(info["prefix"])
        except Exception:  # keep the record: a later run tries again
            continue
        removed.append(info["prefix"])
        shutil.rmtree(info_path.parent, ignore_errors=True)
    return removed


def _collect(state: Path) -> list[dict[str, Any]]:
    stats = []
    for path in sorted((state / "stats").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            stats.append(json.loads(path.read_text()))
    return stats


def _write_outputs(graph: Graph, state: Path, out: Path, stats: list[dict[str, Any]]) -> None:
    from .trace import merge, timeline

    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    shutil.copytree(state / "logs", out / "logs", dirs_exist_ok=True)
    parts = []
    for path in sorted((state / "trace").glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            parts.append(json.loads(path.read_text()))
    if parts:
        trace = merge(parts, list(graph.modules))
        (out / "trace.json").write_text(json.dumps(trace))
        timeline(trace, out / "timeline.png", title=f"graph {graph.name}")
