"""The workflow benchmark as Slurm batch jobs: ``instride bench study --launcher slurm``.

Each repetition of a configuration is one ``sbatch -N <nodes>`` job. Its ranks are one Slurm
job step placed rank by rank (producers on the first half of the nodes, consumers on the
second, as :func:`~instride.bench.workflow_run.placement` says), with MPI wired up by Slurm itself::

    env SLURM_HOSTFILE=hosts srun --mpi=pmi2 --distribution=arbitrary --overcommit -n 2P \\
        python -m mpi4py -m instride.bench.workflow spec.json REP

For the ``instride`` backend the step runs inside ``instride job`` (Redis on the first node, a
data server per node, settings per node through the task prolog); the file-system backends use
a directory every node sees (``sharedfs``: the cluster's shared file system; in the emulated
cluster a plain shared directory) or node-local tmpfs (``localfs``, one node). Results land in
the same files as :func:`instride.bench.workflow_run.run` writes (``timings.csv``, ``ranks.csv``,
``summary.json``), so the study's report is unchanged.

:class:`SlurmBench` works with an :class:`~instride.emulate.slurm.EmulatedSlurm` (what the study
starts) or with any object offering its ``sbatch``/``wait``/``job`` methods.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import InstrideError
from .molecules import BenchConfigError
from .results import RUN_OUTPUTS, merge_repetition, staged_output, summarize, write_tables
from .workflow_run import (
    BenchRunError,
    RunConfig,
    mpich_segments,
    placement,
    remove_orphan_segments,
)

#: What slurmstepd logs when it cannot parse an MPI rank's PMI-2 request during MPI start-up.
PMI_FLAKE = "mpi/pmi2: invalid client request"


def slurm_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` as it runs on Slurm: ``sharedfs`` is the cluster's shared directory."""
    return replace(cfg, sharedfs_kind="dir") if cfg.backend == "sharedfs" else cfg


class SlurmBench:
    """Runs workflow configurations as batch jobs on a Slurm cluster.

    Parameters
    ----------
    slurm
        The cluster (:class:`~instride.emulate.slurm.EmulatedSlurm` or alike).
    shared_dir
        A directory every node sees (job files, ``sharedfs`` data).
    local_dir
        Node-local directory pattern for managed directories and ``localfs`` (``%n``: node).
    """

    def __init__(self, slurm: Any, shared_dir: str | Path, local_dir: str = "/dev/shm") -> None:
        self.slurm = slurm
        self.shared_dir = Path(shared_dir)
        self.local_dir = local_dir.rstrip("/")

    def script(self, cfg: RunConfig, spec_path: Path, rep: int, hosts: Path,
               nodes_of: list[int]) -> str:
        """The batch script of one repetition (``nodes_of``: 1-based node index of each rank).

        The script writes the ranks' host file from the job's own node list, so it runs on
        whatever nodes Slurm allocates.
        """
        py = sys.executable
        ranks = 2 * cfg.pairs
        step = (f"env SLURM_HOSTFILE={hosts} "
                f"srun --mpi=pmi2 --distribution=arbitrary --overcommit -n {ranks} "
                f"--kill-on-bad-exit=1 --job-name=workflow "
                f"{py} -m mpi4py -m instride.bench.workflow {spec_path} {rep}")
        order = " ".join(str(n) for n in nodes_of)
        # MPI start-up uses the PMI-1 wire protocol of Slurm's pmi2 plugin: under load its
        # PMI-2 parser failed on MPICH's requests (see PMI_FLAKE). The ranks use MPICH's OFI
        # netmod over TCP: its address is a 16-byte sockaddr, where UCX's (every transport,
        # hex-encoded) made long PMI requests that slurmstepd now and then read in pieces and
        # rejected ("request not begin with 'cmd='", then "UCX failed to unpack address").
        lines = ["#!/bin/sh", "set -e", "export MPIR_CVAR_PMI_VERSION=1",
                 "export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp",
                 'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                 f': > {hosts}',
                 f'for i in {order}; do echo "$nodes" | sed -n "${{i}}p" >> {hosts}; done',
                 f"export INSTRIDE_FSYNC={'1' if cfg.fsync else '0'}"]
        if cfg.backend == "instride":
            token = secrets.token_hex(3)
            lines.append(f"exec {py} -m instride job --dir {self.local_dir}/isb{token}-%n-%j -- "
                         f"{step}")
        else:
            lines.append(f"exec {step}")
        return "\n".join(lines) + "\n"

    def run_once(self, cfg: RunConfig, out: Path, rep: int) -> None:
        """Submit repetition ``rep`` of ``cfg`` and wait for it; raw rows in ``out/raw/rep<rep>``."""
        run_id = f"run{rep}-{secrets.token_hex(4)}"
        raw = (out / "raw" / f"rep{rep}").absolute()
        if raw.exists():
            shutil.rmtree(raw)
        raw.mkdir(parents=True)
        nodes_of = placement(cfg.pairs, cfg.nodes)
        root: Path | None = None
        if cfg.backend == "sharedfs":
            root = self.shared_dir / "sharedfs"
        elif cfg.backend == "localfs":
            root = Path(self.local_dir) / f"isb-localfs-{secrets.token_hex(3)}"
        spec = cfg.spec(run_id, raw, str(root) if root else None, nodes_of)
        spec_path = raw / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        hosts = raw / "hosts"
        script = self.script(cfg, spec_path, rep, hosts, nodes_of)
        (raw / "job.sh").write_text(script)
        log = raw / "slurm.out"
        budget = cfg.time_budget(slack=90.0)  # None: no limit (--timeout inf)
        limit = "UNLIMITED" if budget is None else str(int(budget // 60) + 2)
        segments = mpich_segments()
        try:
            for attempt in range(2):
                job = self.slurm.sbatch(script, "-N", str(cfg.nodes), f"--output={log}",
                                        f"--job-name={cfg.name}",
                                        f"--time={limit}")
                try:
                    state = self.slurm.wait(job, timeout=math.inf if budget is None else budget)
                except InstrideError:  # still running after the budget: cancel, report
                    self.slurm.scancel(job)
                    self.slurm.wait(job, timeout=120)
                    raise BenchRunError(cfg.name, f"repetition {rep}: Slurm job {job} exceeded "
                                        f"{budget:.0f} s and was cancelled") from None
                except BaseException:  # Ctrl-C, SIGTERM raised, any other failure of the wait:
                    # the job must not run on (on a real Slurm nothing else stops it) while
                    # its files are removed under it
                    with contextlib.suppress(Exception):
                        self.slurm.scancel(job)
                    raise
                text = log.read_text(errors="replace") if log.exists() else ""
                if state == "COMPLETED" or attempt or PMI_FLAKE not in text:
                    break
                # MPI never started (a PMI-2 message Slurm could not parse, seen under load):
                # no frame was timed. Keep that output and submit the repetition once more.
                log.rename(raw / "slurm.attempt0.out")
                remove_orphan_segments(segments)
                for stale in [*raw.glob("rank*.csv"), *raw.glob("rank*.json")]:
                    stale.unlink()
        finally:
            if root is not None:
                shutil.rmtree(root / run_id, ignore_errors=True)
                if cfg.backend == "localfs":
                    shutil.rmtree(root, ignore_errors=True)
        info = self.slurm.job(job)
        (raw / "job.json").write_text(json.dumps(info, indent=1))
        if state != "COMPLETED":
            # MPI_Abort skips MPICH's unlink of its shared-memory segments (emulated nodes
            # share one /dev/shm): remove the new ones no live process uses.
            remove_orphan_segments(segments)
            tail = log.read_text(errors="replace").splitlines()[-15:] if log.exists() else []
            raise BenchRunError(cfg.name, f"repetition {rep}: Slurm job {job} ended {state} "
                                f"(exit {info.get('ExitCode')}):\n" + "\n".join(tail))

    def run(self, cfg: RunConfig, out: str | Path) -> dict[str, Any]:
        """Every repetition of ``cfg`` as Slurm jobs; the summary (as :func:`runner.run`'s)."""
        cfg = slurm_config(cfg).validate()
        if cfg.nodes > len(getattr(self.slurm, "nodes", [])) > 0:
            raise BenchConfigError("nodes", f"{cfg.nodes} nodes asked, the Slurm cluster has "
                                   f"{len(self.slurm.nodes)}")
        timings: list[dict[str, Any]] = []
        ranks: list[dict[str, Any]] = []
        started = time.time()
        # built in out/.partial-*, moved into out only once every repetition succeeded
        with staged_output(out, RUN_OUTPUTS) as stage:
            for rep in range(cfg.repetitions):
                self.run_once(cfg, stage, rep)
                t, r = merge_repetition(stage / "raw" / f"rep{rep}")
                timings += t
                ranks += r
            summary = summarize(timings, ranks, cfg.summary_config() | {"launcher": "slurm"})
            summary["elapsed_s"] = time.time() - started
            write_tables(stage, timings, ranks, summary)
        return summary


@contextlib.contextmanager
def emulated_slurm_runner(nodes: int) -> Iterator[Callable[[RunConfig, Path], dict[str, Any]]]:
    """An emulated Slurm of ``nodes`` nodes for a study; yields ``run(cfg, out) -> summary``."""
    from ..emulate.slurm import EmulatedSlurm

    with EmulatedSlurm(nodes=max(1, nodes), cpus=2, kill_wait=10) as cluster:
        shared = cluster.base_dir / "shared"
        shared.mkdir(exist_ok=True)
        bench = SlurmBench(cluster, shared)
        yield lambda cfg, out: bench.run(cfg, out)


__all__ = ["SlurmBench", "emulated_slurm_runner", "slurm_config"]
