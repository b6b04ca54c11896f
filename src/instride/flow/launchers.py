"""Launchers: where and how the runner starts module instances.

A launcher is a small protocol (:class:`Launcher`): the nodes it offers, the environment of a
process on a node, starting an argv there, and removing a run's streams afterwards. The runner
knows nothing else about the machines, so a batch-system launcher (Slurm ``srun``) plugs in by
implementing these four methods. Two attributes are optional: ``name`` (the kind recorded with a
run; default: the class name) and ``state_root`` (where the run's state goes, when every node
must read it; default: :func:`instride.flow.runner.state_root`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

from ..client import Client
from ..config import Settings
from ..orphans import dies_with_me


@runtime_checkable
class Launcher(Protocol):
    """What the runner needs from a launcher: four methods.

    A ``name`` attribute (the kind recorded with a run, shown in reports; the class name when
    absent) and a ``state_root`` path are optional.
    """

    def nodes(self) -> list[str]:
        """Names of the nodes modules can be placed on (the first is the default)."""

    def env(self, node: str) -> dict[str, str]:
        """The environment of a process on ``node`` (its ``INSTRIDE_*`` settings included)."""

    def start(self, node: str, argv: Sequence[str], env: Mapping[str, str],
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``node`` in a new session (process group = its PID)."""

    def cleanup(self, prefix: str) -> None:
        """Remove every key under ``prefix`` on every node (and its metadata)."""


def _remove_tree(root: Path, prefix: str) -> None:
    """Remove ``root/prefix`` and the parents it leaves empty (up to ``root``)."""
    shutil.rmtree(root / prefix, ignore_errors=True)
    # drop the now empty parents ("flow/") but nothing that still holds another run
    parent = (root / prefix).parent
    while parent != root and parent.is_dir():
        try:
            parent.rmdir()
        except OSError:
            break
        parent = parent.parent


def _remove_stream_state(root: Path, prefix: str) -> None:
    """Remove the streams' state on this node: heads, consumer groups, recycled storage."""
    _remove_tree(root / ".instride" / "streams", prefix)


def _remove_prefix(client: Client, prefix: str) -> None:
    for key in client.list(f"{prefix}/"):
        client.delete(key)
    root = Path(client.root)
    _remove_tree(root, prefix)
    _remove_stream_state(root, prefix)
    redis = getattr(getattr(client.engine, "metadata", None), "redis", None)
    if redis is not None:  # cluster mode: the streams' heads and groups live in Redis
        keys = list(redis.scan_iter(match=f"instride:stream:{client.key(prefix)}/*", count=1000))
        if keys:
            redis.delete(*keys)


class LocalLauncher:
    """Every instance is a process on this machine, in the caller's instride settings.

    Parameters
    ----------
    env
        Extra environment variables for every instance.
    """

    name = "local"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.extra = dict(env or {})
        self.node_name = os.environ.get("INSTRIDE_NODE") or "local"

    def nodes(self) -> list[str]:
        return [self.node_name]

    def env(self, node: str) -> dict[str, str]:
        return {**os.environ, **self.extra}

    def start(self, node: str, argv: Sequence[str], env: Mapping[str, str],
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(list(argv), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=dies_with_me())

    def cleanup(self, prefix: str) -> None:
        client = Client(Settings.from_env(dict(self.env(self.node_name))))
        try:
            _remove_prefix(client, prefix)
        finally:
            client.close()


class EmulatedLauncher:
    """Instances run on emulated nodes (network namespaces) of an :class:`EmulatedCluster`.

    Parameters
    ----------
    cluster
        A started :class:`instride.emulate.EmulatedCluster` (cluster mode: Redis and a data
        server per node), or its name (attached).
    """

    name = "emulated"

    def __init__(self, cluster: Any) -> None:
        if isinstance(cluster, str):
            from ..emulate import EmulatedCluster

            cluster = EmulatedCluster.attach(cluster)
        self.cluster = cluster
        self._names = [self.cluster.node(i).name for i in range(1, self.cluster._nodes_count + 1)]

    def nodes(self) -> list[str]:
        return list(self._names)

    def env(self, node: str) -> dict[str, str]:
        return dict(self.cluster.node(node).env)

    def start(self, node: str, argv: Sequence[str], env: Mapping[str, str],
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.cluster.command(node, argv), env=dict(env), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=dies_with_me())

    def cleanup(self, prefix: str) -> None:
        # Records live in Redis, files on every node: delete through node 1's client (it sees
        # every record), then remove what is left in each node's directory.
        code = (
            "import sys; from instride.flow.launchers import _remove_prefix; "
            "from instride.client import get_client; _remove_prefix(get_client(), sys.argv[1])"
        )
        self.cluster.run(self._names[0], [sys.executable, "-c", code, prefix], check=False,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        for name in self._names:
            root = Path(self.cluster.node(name).dir)
            _remove_tree(root, prefix)
            _remove_stream_state(root, prefix)


def slurm_state_root(env: Mapping[str, str]) -> Path:
    """Where the Slurm launcher records runs: ``$INSTRIDE_FLOW_STATE``, else
    ``.instride-flow`` in the job's submission directory (shared by every node)."""
    submit = env.get("SLURM_SUBMIT_DIR") or os.getcwd()
    return Path(env.get("INSTRIDE_FLOW_STATE") or Path(submit) / ".instride-flow")


#: Per-node settings the Slurm task prolog sets on each node (never taken from the runner's node).
_NODE_VARS = ("INSTRIDE_DIR", "INSTRIDE_ADDR", "INSTRIDE_NODE")


def _step_name(prefix: str) -> str:
    """The Slurm step name of the instances of the run ``prefix`` (``flow/g-id`` -> ``flow-g-id``)."""
    return prefix.replace("/", "-")


class SlurmLauncher:
    """Instances run as job steps of the current Slurm allocation (``srun --overlap``).

    Run it inside ``instride job -- instride flow run GRAPH.py``: ``instride job`` has started
    Redis, one data server per node and the job token, and its task prolog gives every step its
    node's ``INSTRIDE_DIR``/``INSTRIDE_ADDR``/``INSTRIDE_NODE``. Each instance is
    ``srun --overlap -N1 -n1 --nodelist=<node> --job-name=<run>`` with the runner's environment
    (its ports included); steps still alive when the run ends are cancelled (``scancel
    <job>.<step>``).

    Parameters
    ----------
    env
        The environment to start from (default ``os.environ``).

    Raises
    ------
    FlowError
        Not inside a Slurm allocation, or outside ``instride job`` (no cluster-mode services).
    """

    name = "slurm"

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        from .errors import FlowError

        self.base = dict(os.environ if env is None else env)
        self.job_id = self.base.get("SLURM_JOB_ID", "")
        if not self.job_id:
            raise FlowError("the slurm launcher needs a Slurm allocation: SLURM_JOB_ID is not set "
                            "(run `instride job -- instride flow run ...` in an sbatch script)")
        if not (self.base.get("INSTRIDE_JOB_ID") and self.base.get("INSTRIDE_REDIS_URL")
                and self.base.get("SLURM_TASK_PROLOG")):
            raise FlowError("the slurm launcher runs inside `instride job` (which starts Redis, a "
                            "data server per node and the token): `instride job -- instride flow "
                            "run GRAPH.py` (or `--launcher local` for this node only)")
        self.srun = shutil.which("srun", path=self.base.get("PATH")) or "srun"
        nodelist = self.base.get("SLURM_JOB_NODELIST") or self.base.get("SLURM_NODELIST", "")
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, env=self.base, timeout=60)
        self._names = proc.stdout.split()
        if proc.returncode != 0 or not self._names:
            raise FlowError(f"cannot list the nodes of Slurm job {self.job_id} "
                            f"({nodelist!r}): {proc.stderr.strip()}")
        #: Run state (spec, counters, logs) every node reads and writes: on a shared file system.
        self.state_root = slurm_state_root(self.base)

    def nodes(self) -> list[str]:
        return list(self._names)

    def env(self, node: str) -> dict[str, str]:
        return {k: v for k, v in self.base.items() if k not in _NODE_VARS}

    def _srun(self, *args: str) -> list[str]:
        return [self.srun, "--overlap", "--quiet", f"--jobid={self.job_id}", *args]

    def start(self, node: str, argv: Sequence[str], env: Mapping[str, str],
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        step = _step_name(env.get("INSTRIDE_FLOW_PREFIX", "instride-flow"))
        cmd = self._srun("-N1", "-n1", f"--nodelist={node}", f"--job-name={step}",
                         "--kill-on-bad-exit=1", *argv)
        # srun forwards SIGTERM/SIGKILL-on-exit to the step; a killed srun's step is cancelled
        # by cleanup() (by its name), so no instance outlives the run.
        return subprocess.Popen(cmd, env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=dies_with_me())

    def steps(self, prefix: str) -> list[str]:
        """The ids (``job.step``) of the run's steps Slurm still lists."""
        proc = subprocess.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"],
                              capture_output=True, text=True, env=self.base, timeout=60)
        name = _step_name(prefix)
        return [line.split()[0] for line in proc.stdout.splitlines()
                if len(line.split()) == 2 and line.split()[1] == name]

    def cleanup(self, prefix: str) -> None:
        import time

        steps = self.steps(prefix)
        if steps:
            subprocess.run(["scancel", "--signal=KILL", *steps], env=self.base, timeout=60,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            deadline = time.monotonic() + 30
            while self.steps(prefix) and time.monotonic() < deadline:
                time.sleep(0.2)
        # Records live in Redis (this node's client sees them all); files on every node: one
        # task per node removes what is left in its managed directory.
        client = Client(Settings.from_env(self.base))
        try:
            _remove_prefix(client, prefix)
        finally:
            client.close()
        code = ("import os, sys; from pathlib import Path; "
                "from instride.flow.launchers import _remove_tree, _remove_stream_state; "
                "root = Path(os.environ['INSTRIDE_DIR']); "
                "_remove_tree(root, sys.argv[1]); _remove_stream_state(root, sys.argv[1])")
        subprocess.run(self._srun(f"-N{len(self._names)}", f"-n{len(self._names)}",
                                  "--ntasks-per-node=1", sys.executable, "-c", code, prefix),
                       env=self.env(self._names[0]), timeout=120, check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
