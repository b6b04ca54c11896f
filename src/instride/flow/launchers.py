"""Launchers: where and how the runner starts module instances.

A launcher is a small protocol (:class:`Launcher`): the nodes it offers, the environment of a
process on a node, starting an argv there, and removing a run's streams afterwards. The runner
knows nothing else about the machines, so a batch-system launcher (Slurm ``srun``) plugs in by
implementing these four methods.
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


@runtime_checkable
class Launcher(Protocol):
    """What the runner needs from a launcher."""

    #: Short name shown in reports.
    name: str

    def nodes(self) -> list[str]:
        """Names of the nodes modules can be placed on (the first is the default)."""

    def env(self, node: str) -> dict[str, str]:
        """The environment of a process on ``node`` (its ``INSTRIDE_*`` settings included)."""

    def start(self, node: str, argv: Sequence[str], env: Mapping[str, str],
              log: IO[bytes]) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``node`` in a new session (process group = its PID)."""

    def cleanup(self, prefix: str) -> None:
        """Remove every key under ``prefix`` on every node (and its metadata)."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGKILL when the runner dies (Linux ``PR_SET_PDEATHSIG``),
    so a killed runner leaves no orphan instance."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


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
                                preexec_fn=_die_with_parent)

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
                                start_new_session=True, preexec_fn=_die_with_parent)

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
