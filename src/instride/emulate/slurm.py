"""A real Slurm over emulated nodes: ``slurmctld`` plus one ``slurmd`` per network namespace.

:class:`EmulatedSlurm` builds, on one machine and as root,

- a *hub* network namespace ``isl<k>h`` holding a bridge at ``10.77.<k>.1/24``, where
  ``slurmctld`` runs; ``k`` is chosen free at start-up, so several instances never collide;
- one namespace ``isl<k>n<i>`` per node, joined to the bridge at ``10.77.<k>.(10+i)``, where
  ``slurmd -N node<i>`` runs under its own host name ``node<i>`` (``nsenter --net`` plus
  ``unshare --uts``: unlike ``ip netns exec`` this keeps the host's ``/sys``, whose cgroup tree
  slurmd 22.05 needs);
- one private ``munged`` (its own key and socket, ``AuthInfo=socket=...``), so nothing of the
  machine's own munge or Slurm is used or changed.

Every file (configuration, state, spool, logs) lives under one base directory. Client commands
(``sbatch``, ``squeue``, ``scontrol``, ``scancel``) run in the hub namespace with ``SLURM_CONF``
pointing at the private configuration (:meth:`EmulatedSlurm.command`). :meth:`down` stops every
daemon by PID, kills whatever is left in the namespaces, deletes them and the base directory.

Needs Debian's ``slurm-wlm`` and ``munge`` (``make test`` installs them) and iproute2.
``sacct`` needs a database daemon that is not set up: read job states with
:meth:`EmulatedSlurm.job` (``scontrol show job``) or :meth:`EmulatedSlurm.squeue`.

Examples
--------
>>> from instride.emulate.slurm import EmulatedSlurm                  # doctest: +SKIP
>>> with EmulatedSlurm(nodes=2) as slurm:
...     job = slurm.sbatch("#!/bin/sh\\nsrun -N 2 hostname\\n", "-N", "2")
...     slurm.wait(job)
'COMPLETED'
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import netns as nn
from .netns import ClusterError
from .teardown import TornDownOnSigterm, signals_held

#: Daemons and commands this module needs, and where they come from.
_REQUIRED = {
    "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client",
    "scontrol": "slurm-client", "munged": "munge", "nsenter": "util-linux",
    "unshare": "util-linux",
}
_INSTALL_HINT = "`make test` installs it (apt-get install slurm-wlm munge)"
#: Final job states (``scontrol show job``'s JobState).
FINAL_STATES = frozenset({
    "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})
#: Seconds to wait for the daemons to come up.
READY_TIMEOUT = 30.0


def _which(name: str) -> str:
    exe = shutil.which(name) or next(
        (p for d in ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
         if os.access(p := f"{d}/{name}", os.X_OK)), None)
    if exe is None:
        raise ClusterError(
            f"`{name}` ({_REQUIRED.get(name, name)}) is not installed; {_INSTALL_HINT}")
    return exe


def require_slurm() -> dict[str, str]:
    """Paths of the Slurm and munge programs, or raise :class:`ClusterError` naming the missing."""
    return {name: _which(name) for name in _REQUIRED}


@dataclass(frozen=True)
class SlurmNode:
    """One emulated Slurm node: its Slurm name (also its host name), namespace and address."""

    index: int
    name: str
    netns: str
    ip: str


class EmulatedSlurm(TornDownOnSigterm):
    """A Slurm cluster of ``nodes`` emulated nodes on this machine.

    Parameters
    ----------
    nodes
        Number of compute nodes (1 ... 200).
    cpus
        CPUs Slurm believes each node has.
    base_dir
        Directory for configuration, state, logs and the nodes' scratch space; default: a new
        temporary directory. Removed by :meth:`down` when created here.
    kill_wait
        Slurm's ``KillWait``: seconds between SIGTERM and SIGKILL when a job is cancelled.
    env
        Extra environment variables for the client commands (and so for submitted jobs).
    """

    def __init__(self, nodes: int = 3, *, cpus: int = 1, base_dir: str | os.PathLike[str] | None
                 = None, kill_wait: int = 5, env: Mapping[str, str] | None = None) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 1 <= nodes <= 200:
            raise ClusterError(f"nodes={nodes!r}: expected an integer from 1 to 200")
        self.n_nodes = nodes
        self.cpus = int(cpus)
        self.kill_wait = int(kill_wait)
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        self._base_arg = Path(base_dir).absolute() if base_dir is not None else None
        self.base_dir = self._base_arg or Path("/nonexistent")
        self.k: int | None = None
        self.nodes: list[SlurmNode] = []
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._namespaces: list[str] = []
        self._own_base = False
        self.up_done = False

    # ------------------------------------------------------------------ names
    @property
    def hub(self) -> str:
        """Name of the hub namespace (bridge and ``slurmctld``)."""
        return f"isl{self.k}h"

    @property
    def hub_ip(self) -> str:
        """Address of the hub on the bridge (``slurmctld`` listens there)."""
        return f"10.77.{self.k}.1"

    @property
    def conf(self) -> Path:
        """Path of the private ``slurm.conf``."""
        return self.base_dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        """Path of the private munged's socket."""
        return self.base_dir / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """Environment of client commands (and so of jobs): the caller's without ``SLURM_*``,
        ``INSTRIDE_JOB_STATE_DIR`` private to this cluster, the extras, ``SLURM_CONF``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        # Node-local state of `instride job` (service records) kept per cluster: emulated
        # nodes share one /tmp, and every cluster names its nodes node1, node2...
        env["INSTRIDE_JOB_STATE_DIR"] = str(self.base_dir / "scratch" / "instride-services")
        env.update(self.extra_env)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def node(self, index: int | str) -> SlurmNode:
        """Node ``index`` (1-based, or its name ``node<i>``)."""
        if isinstance(index, str):
            for n in self.nodes:
                if index in (n.name, n.ip):
                    return n
            raise ClusterError(f"no node {index!r} (nodes: {[n.name for n in self.nodes]})")
        if not 1 <= index <= len(self.nodes):
            raise ClusterError(f"no node {index} (1..{len(self.nodes)})")
        return self.nodes[index - 1]

    # ------------------------------------------------------------------ life cycle
    def up(self) -> EmulatedSlurm:
        """Start munged, the network, slurmctld and every slurmd; wait until all nodes are idle.

        Raises
        ------
        ClusterError
            Not root, a program missing, or a daemon that did not come up (the message holds
            the tail of its log). Everything started so far is removed first.
        """
        progs = require_slurm()
        nn.require_ip()
        self.up_done = True
        try:
            self._claim_subnet()
            self._make_dirs()
            self._start_munge(progs)
            self._write_conf()
            self._start_ctld(progs)
            for node in self.nodes:
                self._start_slurmd(progs, node)
            self._wait_idle()
        except BaseException:
            self.down()
            raise
        return self

    def _claim_subnet(self) -> None:
        """Pick a free ``k`` by creating the hub namespace (creation is exclusive)."""
        existing = set(nn.list_netns())
        start = secrets.randbelow(250)
        for step in range(250):
            k = (start + step) % 250 + 1
            if f"isl{k}h" in existing:
                continue
            # The claim (`ip netns add`, exclusive) and its record as one step: a signal
            # between them left a namespace down() never deleted. Only the claim may fail
            # because another instance took k: a namespace made is ours (recorded) from then.
            with signals_held():
                if nn.ip("netns", "add", f"isl{k}h", check=False).returncode != 0:
                    continue  # taken between the listing and now
                self.k = k
                self._namespaces.append(self.hub)
            nn.ip("-n", self.hub, "link", "set", "lo", "up")
            nn.add_bridge(self.hub, "br0", f"{self.hub_ip}/24")
            break
        else:
            raise ClusterError("no free emulated Slurm subnet 10.77.k.0/24 (k = 1..250)")
        self.nodes = [SlurmNode(i, f"node{i}", f"isl{self.k}n{i}", f"10.77.{self.k}.{10 + i}")
                      for i in range(1, self.n_nodes + 1)]
        for node in self.nodes:
            # (recorded before it is made: an interrupt meanwhile leaves a name down() deletes;
            # deleting one that was never made does nothing. Ours: k is claimed.)
            self._namespaces.append(node.netns)
            nn.add_netns(node.netns)
            nn.add_veth(self.hub, f"v{node.index}", "br0", node.netns, "eth0", f"{node.ip}/24")

    def _make_dirs(self) -> None:
        if self._base_arg is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix=f"instride-slurm{self.k}-"))
            self._own_base = True
        else:
            self._own_base = not self.base_dir.exists()
            self.base_dir.mkdir(parents=True, exist_ok=True)
        for sub in ("etc", "munge", "ctld", "spool", "log", "scratch"):
            (self.base_dir / sub).mkdir(exist_ok=True)
        os.chmod(self.base_dir / "munge", 0o700)

    def _spawn(self, role: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        log = open(self.base_dir / "log" / f"{role}.out", "ab")  # noqa: SIM115 - child owns it
        # (a Ctrl-C while Popen waits for the exec left the child running, never recorded:
        # munged runs in the host's namespace, where no kill_all of down() finds it)
        try:
            with signals_held():
                proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=log, env=self.env, start_new_session=True)
                self._procs[role] = proc
        finally:
            log.close()
        return proc

    def _start_munge(self, progs: dict[str, str]) -> None:
        d = self.base_dir / "munge"
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self._spawn("munged", [
            progs["munged"], "--foreground", "--force", f"--socket={self.munge_socket}",
            f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
            f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'munged.log'}",
        ])
        self._wait(lambda: self.munge_socket.exists(), "munged", d / "munged.log")

    def _write_conf(self) -> None:
        b = self.base_dir
        host = socket.gethostname().split(".")[0]
        lines = [
            f"ClusterName=isl{self.k}",
            f"SlurmctldHost={host}({self.hub_ip})",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={b}/ctld",
            f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/ctld/slurmctld.pid",
            f"SlurmdPidFile={b}/spool/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log",
            f"SlurmdLogFile={b}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={b}/log/jobcomp.txt",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "MpiDefault=none", "ReturnToService=2", f"KillWait={self.kill_wait}",
            "MinJobAge=600", "InactiveLimit=0", "SlurmctldTimeout=30", "SlurmdTimeout=60",
            "SchedulerType=sched/builtin",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeAddr={n.ip} NodeHostname={n.name} "
                         f"CPUs={self.cpus} State=UNKNOWN")
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")

    def _nsenter(self, netns: str) -> list[str]:
        return [_which("nsenter"), f"--net={nn.NETNS_RUN_DIR / netns}"]

    def node_command(self, index: int | str, argv: Sequence[str]) -> list[str]:
        """The argv that runs ``argv`` on node ``index``: in its namespace, with its host name.

        Like ``ssh node<i> ARGV``: the process sees the node's network and host name and the
        machine's file systems. Use it as an ``ssh`` stand-in (e.g. for MPICH's
        ``HYDRA_LAUNCHER_EXEC``).
        """
        node = self.node(index)
        return [*self._nsenter(node.netns), _which("unshare"), "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', node.name, *argv]

    def ssh_script(self) -> Path:
        """An ``ssh`` stand-in: ``SCRIPT [-x] HOST COMMAND...`` runs COMMAND on that node.

        HOST is a node's name or address. For MPICH's Hydra: ``HYDRA_LAUNCHER=ssh``,
        ``HYDRA_LAUNCHER_EXEC=<this script>`` (and ``HYDRA_IFACE=eth0``, since node names do
        not resolve) start ranks on the emulated nodes, as ``ssh`` would on real hosts.
        """
        path = self.base_dir / "bin" / "ssh"
        path.parent.mkdir(exist_ok=True)
        cases = "\n".join(f"    {n.name}|{n.ip}) ns={n.netns} name={n.name} ;;"
                          for n in self.nodes)
        path.write_text(f"""#!/bin/sh
# ssh stand-in for the emulated Slurm nodes of {self.base_dir}
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case "$host" in
{cases}
    *) echo "ssh stand-in: unknown host $host" >&2; exit 255 ;;
esac
exec {_which("nsenter")} --net=/run/netns/$ns {_which("unshare")} --uts \\
    sh -c 'hostname "$1" && exec sh -c "$0"' "$*" "$name"
""")
        path.chmod(0o755)
        return path

    def _start_ctld(self, progs: dict[str, str]) -> None:
        self._spawn("slurmctld", [*self._nsenter(self.hub), progs["slurmctld"], "-D", "-c",
                                  "-f", str(self.conf)])
        self._wait(lambda: nn.can_connect(self.hub, self.hub_ip, 6817, 0.3), "slurmctld",
                   self.base_dir / "log" / "slurmctld.log")

    def _start_slurmd(self, progs: dict[str, str], node: SlurmNode) -> None:
        self._spawn(f"slurmd-{node.name}", self.node_command(
            node.index, [progs["slurmd"], "-D", "-N", node.name, "-f", str(self.conf)]))

    def _wait(self, ready: Any, role: str, log: Path, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self._procs.get(role)
            if proc is not None and proc.poll() is not None:
                raise ClusterError(f"{role} exited with status {proc.returncode} while starting;"
                                   f" {log}:\n{_tail(log)}\n{_tail(self._out(role))}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{role} did not come up within {timeout:.0f} s; {log}:\n"
                                   f"{_tail(log)}")
            time.sleep(0.05)

    def _out(self, role: str) -> Path:
        return self.base_dir / "log" / f"{role}.out"

    def _wait_idle(self) -> None:
        def idle() -> bool:
            for node in self.nodes:
                proc = self._procs[f"slurmd-{node.name}"]
                if proc.poll() is not None:
                    raise ClusterError(
                        f"slurmd of {node.name} exited with status {proc.returncode}; "
                        f"{self.base_dir}/log/slurmd-{node.name}.log:\n"
                        f"{_tail(self.base_dir / 'log' / f'slurmd-{node.name}.log')}\n"
                        f"{_tail(self._out(f'slurmd-{node.name}'))}")
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            return len(states) == len(self.nodes) and all(
                s == "idle" for s in states.values())

        self._wait(idle, "slurmd", self.base_dir / "log" / "slurmctld.log")

    def down(self) -> None:
        """Stop every daemon (by PID), remove the namespaces and the base directory.

        Safe to call any number of times, and after a failed :meth:`up`.
        """
        if not self.up_done:
            return
        with signals_held():  # (a second signal must not leave it half-way)
            self._down()

    def _down(self) -> None:
        self._cancel_jobs()
        order = [r for r in self._procs if r.startswith("slurmd-")] + ["slurmctld", "munged"]
        for role in order:
            proc = self._procs.get(role)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for role in order:
            proc = self._procs.pop(role, None)
            if proc is None:
                continue
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(5)
        for ns in reversed(self._namespaces):  # nodes first, hub last
            nn.kill_all(ns)
            nn.del_netns(ns)
        self._namespaces = []
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        self.up_done = False

    def _cancel_jobs(self) -> None:
        """Cancel every job still queued or running and wait (bounded) until they are gone, so
        their steps get SIGTERM and can clean up before the daemons stop."""
        ctld = self._procs.get("slurmctld")
        if ctld is None or ctld.poll() is not None:
            return
        with contextlib.suppress(Exception):
            if not self.squeue():
                return
            self.run(["scancel", "--user=root"], capture_output=True, timeout=30)
            deadline = time.monotonic() + self.kill_wait + 15
            while self.squeue() and time.monotonic() < deadline:
                time.sleep(0.2)

    # ------------------------------------------------------------------ client commands
    def command(self, argv: Sequence[str]) -> list[str]:
        """The argv that runs a Slurm client command (``sbatch ...``) against this cluster."""
        return [*self._nsenter(self.hub), *argv]

    def run(self, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """Run a client command to completion (like :func:`subprocess.run`).

        ``env=`` adds to :attr:`env`.
        """
        env = self.env
        env.update(kwargs.pop("env", None) or {})
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(argv), env=env, **kwargs)

    def sbatch(self, script: str, *args: str, cwd: str | os.PathLike[str] | None = None,
               env: Mapping[str, str] | None = None) -> int:
        """Submit a batch script (its text); return the job id.

        ``args`` are ``sbatch`` options (``"-N", "2"``); the job runs in ``cwd`` (default: the
        base directory's ``scratch``).

        Raises
        ------
        ClusterError
            When ``sbatch`` refuses the job.
        """
        workdir = Path(cwd) if cwd is not None else self.base_dir / "scratch"
        proc = self.run(["sbatch", "--parsable", f"--chdir={workdir}", *args], input=script,
                        capture_output=True, text=True, env=dict(env or {}))
        if proc.returncode != 0:
            raise ClusterError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields of a job (``JobState``, ``ExitCode``, ``NodeList``...)."""
        proc = self.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True,
                        text=True)
        if proc.returncode != 0:
            raise ClusterError(f"scontrol show job {job_id}: {proc.stderr.strip()}")
        fields: dict[str, str] = {}
        for token in proc.stdout.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def state(self, job_id: int) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``CANCELLED``...)."""
        return self.job(job_id).get("JobState", "UNKNOWN")

    def squeue(self) -> list[dict[str, str]]:
        """Jobs in the queue: id, name, state, nodes (``squeue``)."""
        proc = self.run(["squeue", "-h", "-o", "%i|%j|%T|%N"], capture_output=True, text=True)
        rows = []
        for line in proc.stdout.splitlines():
            if line.strip():
                jid, name, state, nodes = line.split("|")
                rows.append({"id": jid, "name": name, "state": state, "nodes": nodes})
        return rows

    def wait(self, job_id: int, timeout: float = 120.0) -> str:
        """Wait for the job to end; return its final state.

        Raises
        ------
        ClusterError
            When it has not ended within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            state = self.state(job_id)
            if state in FINAL_STATES:
                return state
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} still {state} after {timeout:.0f} s")
            time.sleep(0.1)

    def scancel(self, job_id: int, *args: str) -> None:
        """Cancel a job (``scancel``)."""
        proc = self.run(["scancel", *args, str(job_id)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ClusterError(f"scancel {job_id}: {proc.stderr.strip()}")

    def node_pids(self, index: int | str) -> list[int]:
        """PIDs of every process in node ``index``'s namespace except its ``slurmd``."""
        node = self.node(index)
        slurmd = self._procs.get(f"slurmd-{node.name}")
        return [p for p in nn.netns_pids(node.netns) if slurmd is None or p != slurmd.pid]

    def __repr__(self) -> str:
        return f"EmulatedSlurm(nodes={self.n_nodes}, k={self.k}, base_dir={str(self.base_dir)!r})"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


__all__ = ["FINAL_STATES", "EmulatedSlurm", "SlurmNode", "require_slurm"]
