"""Starting a job's instride services on real machines: Slurm, or ``mpiexec`` with a host file.

``instride job -- CMD`` (:func:`services` picks the launcher) starts Redis on the first node,
one data server per node, a fresh job token; runs CMD with the settings every job step
needs; and stops everything when CMD ends, fails or the job is cancelled. See
``docs/slurm.md``.

Examples
--------
>>> from instride.launch import services                              # doctest: +SKIP
>>> raise SystemExit(services().run(["sh", "-c", "srun -N2 my_workflow"]))
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import (
    JobServices,
    LaunchError,
    NoAllocationError,
    ServerStartError,
    ServiceLostError,
    StaleServiceError,
    node_env_script,
)

LAUNCHERS = ("auto", "slurm", "mpiexec")


def services(launcher: str = "auto", *, hostfile: str | None = None,
             mpiexec: str | None = None, env: Mapping[str, str] | None = None,
             **kwargs: object) -> JobServices:
    """The :class:`JobServices` of this job.

    Parameters
    ----------
    launcher
        ``"slurm"``, ``"mpiexec"`` or ``"auto"``: Slurm inside a Slurm job
        (``SLURM_JOB_ID`` set), else ``mpiexec`` when a host file is given.
    hostfile
        The host file of ``mpiexec`` (one host per line, first host first).
    mpiexec
        The ``mpiexec`` that starts the node agents (``mpiexec`` launcher only).
    env
        The environment to read (default: this process's).
    **kwargs
        Parameters of :class:`~instride.launch.base.JobServices`.

    Raises
    ------
    NoAllocationError
        ``auto`` outside a Slurm job and without a host file.
    """
    env = dict(os.environ if env is None else env)
    if launcher not in LAUNCHERS:
        raise LaunchError(f"unknown launcher {launcher!r}; expected one of {LAUNCHERS}")
    if launcher == "auto":
        if env.get("SLURM_JOB_ID") and not hostfile:
            launcher = "slurm"
        elif hostfile:
            launcher = "mpiexec"
        else:
            raise NoAllocationError(
                "no allocation: not inside a Slurm job (SLURM_JOB_ID unset) and no --hostfile "
                "for mpiexec; run `instride job` in an sbatch script or give a host file")
    if launcher == "slurm":
        from .slurm import SlurmServices

        return SlurmServices(env=env, **kwargs)  # type: ignore[arg-type]
    from .mpiexec import MpiexecServices

    return MpiexecServices(hostfile=hostfile, mpiexec=mpiexec, env=env,
                           **kwargs)  # type: ignore[arg-type]


__all__ = ["LAUNCHERS", "JobServices", "LaunchError", "NoAllocationError", "ServerStartError",
           "ServiceLostError", "StaleServiceError", "node_env_script", "services"]
