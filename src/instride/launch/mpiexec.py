"""``mpiexec`` with a host file: the services of a job without a resource manager.

``instride job --hostfile HOSTS -- CMD``, run on the first host of ``HOSTS``
(:class:`MpiexecServices`), starts Redis there (or uses ``INSTRIDE_REDIS_URL``) and one node
agent per host with one command::

    mpiexec -f HOSTS -ppn 1 -n N python -m instride.launch.agent                 # MPICH
    mpiexec --hostfile HOSTS --map-by ppr:1:node -n N -x INSTRIDE_... python ...  # Open MPI

then runs CMD with the job's settings. ``mpiexec`` forwards the environment of CMD to every rank,
including this host's ``INSTRIDE_DIR``/``INSTRIDE_ADDR``: prefix the ranks' command with
``$INSTRIDE_NODE_ENV`` (a script that sets the variables of the node the rank runs on)::

    instride job --hostfile hosts -- sh -c 'mpiexec -f hosts -n 8 "$INSTRIDE_NODE_ENV" python analysis.py'

The host file is MPICH's (``host`` or ``host:slots`` per line) or Open MPI's (``host slots=N``);
``#`` starts a comment. Its hosts are names or addresses; the first is where Redis runs.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .base import JobServices, LaunchError, NoAllocationError, node_name, resolve_ipv4


def read_hostfile(path: str | os.PathLike[str]) -> list[str]:
    """The distinct hosts of a host file, in order.

    Raises
    ------
    NoAllocationError
        When the file does not exist or lists no host.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise NoAllocationError(f"cannot read host file {path}: {exc.strerror}") from None
    hosts: list[str] = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host = line.split()[0].split(":")[0]
        if host not in hosts:
            hosts.append(host)
    if not hosts:
        raise NoAllocationError(f"host file {path} lists no host")
    return hosts


def mpiexec_flavor(mpiexec: str) -> str:
    """``"mpich"`` (Hydra) or ``"openmpi"``, from ``mpiexec --version``."""
    try:
        proc = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise LaunchError(f"cannot run {mpiexec}: {exc.strerror}") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{mpiexec} --version did not answer within 30 s") from None
    text = proc.stdout + proc.stderr
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text.upper():
        return "mpich"
    raise LaunchError(f"{mpiexec} is neither MPICH's (Hydra) nor Open MPI's mpiexec")


def default_mpiexec() -> str:
    """The ``mpiexec`` next to this Python (a venv's MPICH), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise LaunchError("no mpiexec found: load your MPI, or pip install mpich")
    return found


def _one_name_per_machine(hosts: list[str], hostfile: str) -> None:
    """Refuse two names of one machine (``localhost`` and ``127.0.0.1``): it would get two
    services, which collide on its managed directory. Names that do not resolve here are
    left to ``mpiexec``.

    Raises
    ------
    LaunchError
        Two hosts resolve to the same address; names both.
    """
    seen: dict[str, str] = {}
    for host in hosts:
        try:
            addr = resolve_ipv4(host)
        except LaunchError:
            continue
        if addr in seen:
            raise LaunchError(f"hosts {seen[addr]!r} and {host!r} of {hostfile} are one machine "
                              f"({addr}): list each node once")
        seen[addr] = host


class MpiexecServices(JobServices):
    """The services of a job on the hosts of a host file (see the module docstring).

    Parameters
    ----------
    hostfile
        The host file; run on its first host.
    mpiexec
        The ``mpiexec`` to start the agents with (default: :func:`default_mpiexec`).
    **kwargs
        Parameters of :class:`~instride.launch.base.JobServices`.
    """

    name = "mpiexec"
    # mpiexec forwards its environment to every rank: a SLURMD_NODENAME of this node (inside
    # a Slurm job) would give every agent this node's name.
    agent_env_drop = ("SLURMD_NODENAME",)

    def __init__(self, *, hostfile: str | os.PathLike[str] | None = None,
                 mpiexec: str | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.hostfile = hostfile
        self.mpiexec = mpiexec
        self.hosts: list[str] = []
        self.flavor = ""

    def detect(self) -> None:
        if not self.hostfile:
            raise NoAllocationError("mpiexec needs a host file (--hostfile FILE)")
        self.hosts = read_hostfile(self.hostfile)
        _one_name_per_machine(self.hosts, str(self.hostfile))
        self.hostfile = str(Path(self.hostfile).absolute())
        self.mpiexec = self.mpiexec or default_mpiexec()
        self.flavor = mpiexec_flavor(self.mpiexec)
        self.job_id = "m" + secrets.token_hex(4)
        self.nodes = list(self.hosts)
        self.this_node = node_name(self.base_env)
        self.this_addr = resolve_ipv4(self.hosts[0])

    def per_node(self, argv: Sequence[str]) -> list[str]:
        n = str(len(self.hosts))
        exe = self.mpiexec or "mpiexec"
        if self.flavor == "openmpi":
            extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
            forward = [a for v in self.job_env() for a in ("-x", v)]
            return [exe, *extra, "--hostfile", str(self.hostfile), "--map-by", "ppr:1:node",
                    "-n", n, *forward, *argv]
        return [exe, "-f", str(self.hostfile), "-ppn", "1", "-n", n, *argv]

    def registered(self) -> bool:
        """Agents register under their host names, which the host file may not use."""
        return len(self.addrs) >= len(self.hosts)


__all__ = ["MpiexecServices", "default_mpiexec", "mpiexec_flavor", "read_hostfile"]
