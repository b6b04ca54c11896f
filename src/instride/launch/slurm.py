"""Slurm: the services of a job inside an allocation (``sbatch``/``salloc``).

Inside a batch script, ``instride job -- CMD`` (:class:`SlurmServices`)

- reads the allocation from ``SLURM_JOB_ID`` / ``SLURM_JOB_NODELIST`` (``scontrol show
  hostnames``) and this node's address from ``scontrol show node`` (``NodeAddr``);
- starts Redis on this node (the batch host, the first node), or uses ``INSTRIDE_REDIS_URL``;
- starts one node agent per node with one step::

      srun --overlap --nodes=N --ntasks=N --ntasks-per-node=1 --kill-on-bad-exit=1 \\
           --export=ALL --job-name=instride-services python -m instride.launch.agent

  (``--overlap``: the services share the CPUs and memory of the job's own steps instead of
  holding one CPU per node; ``--export=ALL``: the agents get the job's variables also where
  ``SLURM_EXPORT_ENV`` says otherwise; placement and GPU settings of the batch environment,
  meant for the job's own steps, are dropped);
- exports ``SLURM_TASK_PROLOG`` so that every later ``srun`` step of CMD gets its node's
  ``INSTRIDE_DIR``, ``INSTRIDE_ADDR`` and ``INSTRIDE_NODE`` (plus the job's token and Redis URL,
  inherited like any variable);
- stops CMD (SIGTERM) when the services step ends under it (a node's data server died), and
  fails with :class:`~instride.launch.base.ServiceLostError`;
- stops the services when CMD ends, fails, or the job is cancelled (``scancel`` sends SIGTERM
  to the batch step and every job step; Slurm's ``KillWait`` later sends SIGKILL: keep it
  longer than a few seconds).

Examples
--------
.. code-block:: bash

    #SBATCH -N 4
    instride job -- sh -c 'srun -N 2 producer & srun -N 2 consumer; wait'
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence

from .base import JobServices, LaunchError, NoAllocationError, node_env_script, resolve_ipv4

#: Seconds a Slurm client command (``squeue``, ``scancel``) may take while the services stop.
CLIENT_TIMEOUT = 30.0


def _scontrol(*args: str) -> str:
    exe = shutil.which("scontrol")
    if exe is None:
        raise LaunchError("scontrol is not on PATH: load the Slurm module or add its bin dir")
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise LaunchError(f"`scontrol {' '.join(args)}` did not answer within 60 s") from None
    except OSError as exc:
        raise LaunchError(f"cannot run {exe}: {exc.strerror}") from None
    if proc.returncode != 0:
        raise LaunchError(f"`scontrol {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def expand_nodelist(nodelist: str) -> list[str]:
    """Host names of a Slurm node list (``node[1-3,7]``), via ``scontrol show hostnames``."""
    return [h for h in _scontrol("show", "hostnames", nodelist).split() if h]


def node_addr(node: str) -> str:
    """The IPv4 address of a Slurm node (its ``NodeAddr``, resolved)."""
    for token in _scontrol("-o", "show", "node", node).split():
        key, _, value = token.partition("=")
        if key == "NodeAddr" and value:
            return resolve_ipv4(value)
    return resolve_ipv4(node)


class SlurmServices(JobServices):
    """The services of a Slurm job (see the module docstring); parameters of
    :class:`~instride.launch.base.JobServices`, plus ``srun`` (the program, default on PATH).
    """

    name = "slurm"
    # A host file or distribution exported for the job's steps would place several agents on
    # one node, GPU and TRES settings conflict with --ntasks-per-node=1 (srun reads them all
    # from the environment).
    agent_env_drop = ("SLURM_HOSTFILE", "SLURM_DISTRIBUTION", "SLURM_ARBITRARY_NODELIST",
                      "SLURM_NTASKS_PER_NODE", "SLURM_CPUS_PER_TASK", "SLURM_NTASKS",
                      "SLURM_NPROCS", "SLURM_NTASKS_PER_GPU", "SLURM_GPUS",
                      "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_SOCKET", "SLURM_GPUS_PER_TASK",
                      "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_GPU", "SLURM_TRES_PER_TASK")

    def __init__(self, *, srun: str | None = None, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.srun = srun or shutil.which("srun") or "srun"

    def detect(self) -> None:
        env = self.base_env
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            raise NoAllocationError(
                "no Slurm allocation: SLURM_JOB_ID is not set; run `instride job` inside an "
                "sbatch script or an salloc shell (or use --launcher mpiexec --hostfile FILE)")
        if env.get("SLURM_HET_SIZE"):
            raise LaunchError(
                f"Slurm job {job} is a heterogeneous job ({env['SLURM_HET_SIZE']} components): "
                "not supported; run `instride job` in a job of one component")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise NoAllocationError(f"Slurm job {job} has no SLURM_JOB_NODELIST")
        self.job_id = job
        self.nodes = expand_nodelist(nodelist)
        here = env.get("SLURMD_NODENAME")
        if not here or here not in self.nodes:
            raise LaunchError(
                f"`instride job` runs outside the nodes of job {job} ({nodelist}); run it in the "
                "batch script, or as `srun -N1 -n1 --overlap instride job ...` from salloc")
        self.this_node = here
        self.this_addr = node_addr(here)

    def per_node(self, argv: Sequence[str]) -> list[str]:
        n = str(len(self.nodes)) if self.nodes else "$SLURM_JOB_NUM_NODES"
        return [self.srun, "--overlap", f"--nodes={n}", f"--ntasks={n}",
                "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL",
                "--job-name=instride-services", *argv]

    def step_env(self) -> dict[str, str]:
        return {"SLURM_TASK_PROLOG": str(node_env_script())}

    def _client(self, argv: list[str]) -> subprocess.CompletedProcess[str] | None:
        """Run a Slurm client command while the services stop; None (and a warning on
        stderr) when it cannot run, does not answer within :data:`CLIENT_TIMEOUT` s, or
        fails (a status other than 0: permission denied, no such step)."""
        try:
            proc = subprocess.run(argv, capture_output=True, text=True,
                                  timeout=CLIENT_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            why = f"did not answer within {CLIENT_TIMEOUT:g} s"
        except OSError as exc:
            why = f"cannot run: {exc.strerror}"
        else:
            if proc.returncode == 0:
                return proc
            said = proc.stderr.strip().splitlines()[-1:] or [""]
            why = f"exited with status {proc.returncode} {said[0]}".rstrip()
        print(f"instride job: warning: `{' '.join(argv)}` {why}; signalling the services "
              "step's srun instead", file=sys.stderr, flush=True)
        return None

    def _services_steps(self) -> list[str] | None:
        """The services step(s) of the job; None when ``squeue`` failed."""
        squeue = shutil.which("squeue")
        if not (squeue and self.job_id):
            return []
        proc = self._client([squeue, "-h", "-s", "-j", self.job_id, "-o", "%i %j"])
        if proc is None:
            return None
        steps = []
        for line in proc.stdout.splitlines():
            step, _, name = line.strip().partition(" ")
            if name == "instride-services":
                steps.append(step)
        return steps

    def _scancel(self, sig: str) -> bool:
        """``scancel --signal=SIG`` the services step; whether it was done."""
        scancel = shutil.which("scancel")
        steps = self._services_steps() if scancel else []
        if not steps or scancel is None:
            return False
        return all(self._client([scancel, f"--signal={sig}", step]) is not None
                   for step in steps)

    def signal_agents(self) -> None:
        """SIGTERM the tasks of the services step (``scancel --signal``): ``srun`` itself
        would cancel the step on SIGTERM, killing the agents before they clean up. When
        ``squeue`` or ``scancel`` fail or hang, SIGTERM goes to ``srun`` (the default)."""
        if not self._scancel("TERM"):
            super().signal_agents()

    def force_stop_agents(self) -> None:
        """SIGKILL the services step when its agents do not stop."""
        self._scancel("KILL")


__all__ = ["SlurmServices", "expand_nodelist", "node_addr"]
