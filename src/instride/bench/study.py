"""The paper's five experiments, as presets: ``instride bench study``.

=====================  =============================================  ==========================
experiment             what varies                                    compares
=====================  =============================================  ==========================
``single_node``        pairs 1, 2, 4 on one node (JAC)                instride vs localfs
``two_node``           pairs 1, 2, 4, 8 on two nodes (JAC)            instride vs sharedfs
``multi_node``         emulated nodes 2, 4, 8... (pairs grow with)    instride vs sharedfs
``model_scaling``      JAC, ApoA1, F1-ATPase, STMV on two nodes       instride vs sharedfs
``stride_scaling``     strides 1, 5, 10, 50 for JAC and STMV          instride vs sharedfs
=====================  =============================================  ==========================

The ``paper`` preset is the paper's scale (128 frames, a frame every 0.82 s, 10 repetitions,
up to 64 nodes and 256 pairs): it is defined for completeness and for machines that can hold it,
not for 2 cores. The ``small`` preset keeps every experiment's shape and fits in about 7 minutes
on 2 cores (docs/reproduction.md records a measured run): fewer frames, sleeps scaled by 0.05 (a
frame every 41 ms), fewer pairs.

The file-system baselines synchronize as the paper describes (``sync="serialized"``: producer
and consumer never overlap); ``sync="pipelined"`` runs the one-barrier variant instead.

Every preset runs ``sharedfs`` on emulated nodes as a real network file system: one sshfs
storage server per emulated cluster (:mod:`instride.bench.sshfs`), mounted on every node. One
emulated cluster (with its storage server) is up at a time: it is started for the first
configuration of its node count and kept while the following configurations use the same node
count, then torn down when the node count changes (a later configuration with that count starts
a fresh one). ``sharedfs_kind="dir"`` gives back the plain shared directory (synchronization
only, no network data movement).

The study is built in a hidden staging directory inside ``out`` and moved into place when it is
complete: a study that fails leaves ``out`` as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .molecules import BenchConfigError, model_names, paper_data
from .results import staged_output
from .sync import SYNC_MODES
from .workflow_run import RunConfig, run

EXPERIMENTS = ("single_node", "two_node", "multi_node", "model_scaling", "stride_scaling")

#: What a study writes into its directory, the report (the mark of a complete study) last.
STUDY_OUTPUTS = ("runs", "tables", "figures", "study.json", "report.md")


@dataclass(frozen=True)
class Preset:
    """The sizes of one study preset (see the module docstring)."""

    name: str
    frames: int
    repetitions: int
    time_scale: float
    single_node_pairs: tuple[int, ...]
    two_node_pairs: tuple[int, ...]
    multi_node_nodes: tuple[int, ...]
    pairs_per_producer_node: int
    model_pairs: int
    stride_pairs: int
    strides: tuple[int, ...]
    stride_models: tuple[str, ...] = ("JAC", "STMV")
    sharedfs_kind: str = "sshfs"
    sync: str = "serialized"


def _paper_preset() -> Preset:
    study = paper_data()["study"]
    return Preset(
        name="paper", frames=study["frames_per_pair"], repetitions=study["repetitions"],
        time_scale=1.0, single_node_pairs=(1, 2, 4), two_node_pairs=(1, 2, 4, 8),
        multi_node_nodes=(2, 4, 8, 16, 32, 64), pairs_per_producer_node=8, model_pairs=16,
        stride_pairs=16, strides=tuple(study["stride_scaling"]),
    )


PRESETS: dict[str, Preset] = {
    "paper": _paper_preset(),
    "small": Preset(
        name="small", frames=16, repetitions=2, time_scale=0.05,
        single_node_pairs=(1, 2, 4), two_node_pairs=(1, 2, 4, 8), multi_node_nodes=(2, 4, 8),
        pairs_per_producer_node=2, model_pairs=4, stride_pairs=4,
        strides=tuple(paper_data()["study"]["stride_scaling"]),
    ),
    # A seconds-long smoke version of the whole study (used by the tests).
    "tiny": Preset(
        name="tiny", frames=3, repetitions=1, time_scale=0.01,
        single_node_pairs=(1,), two_node_pairs=(1,), multi_node_nodes=(2,),
        pairs_per_producer_node=1, model_pairs=1, stride_pairs=1, strides=(1, 50),
    ),
}


@dataclass(frozen=True)
class Planned:
    """One configuration of one experiment."""

    experiment: str
    x: str  # the value on the figure's x axis (pairs, model, stride...)
    group: str  # sub-figure ("" or the model of the stride experiment)
    config: RunConfig


def plan(preset: Preset, experiments: tuple[str, ...] = EXPERIMENTS) -> list[Planned]:
    """Every configuration of the chosen experiments, in run order."""
    for name in experiments:
        if name not in EXPERIMENTS:
            raise BenchConfigError("experiment", f"unknown {name!r}; expected one of {EXPERIMENTS}")
    base = RunConfig(frames=preset.frames, repetitions=preset.repetitions,
                     time_scale=preset.time_scale, sharedfs_kind=preset.sharedfs_kind,
                     sync=preset.sync)
    out: list[Planned] = []
    if "single_node" in experiments:
        for pairs in preset.single_node_pairs:
            for backend in ("instride", "localfs"):
                cfg = replace(base, backend=backend, pairs=pairs, nodes=1)
                out.append(Planned("single_node", str(pairs), "", cfg))
    if "two_node" in experiments:
        for pairs in preset.two_node_pairs:
            for backend in ("instride", "sharedfs"):
                cfg = replace(base, backend=backend, pairs=pairs, nodes=2)
                out.append(Planned("two_node", str(pairs), "", cfg))
    if "multi_node" in experiments:
        for nodes in preset.multi_node_nodes:
            pairs = nodes // 2 * preset.pairs_per_producer_node
            for backend in ("instride", "sharedfs"):
                cfg = replace(base, backend=backend, pairs=pairs, nodes=nodes)
                out.append(Planned("multi_node", f"{pairs}p/{nodes}n", "", cfg))
    if "model_scaling" in experiments:
        for model in model_names():
            for backend in ("instride", "sharedfs"):
                cfg = replace(base, backend=backend, model=model, pairs=preset.model_pairs, nodes=2)
                out.append(Planned("model_scaling", model, "", cfg))
    if "stride_scaling" in experiments:
        for model in preset.stride_models:
            for stride in preset.strides:
                for backend in ("instride", "sharedfs"):
                    cfg = replace(base, backend=backend, model=model, stride=stride,
                                  pairs=preset.stride_pairs, nodes=2)
                    out.append(Planned("stride_scaling", str(stride), model, cfg))
    return [replace(p, config=replace(p.config, label=f"{p.experiment}:{p.config.name}"))
            for p in out]


class _Clusters:
    """Emulated clusters by node count, started on first use and kept until :meth:`release`.

    A cluster's sshfs storage server (for ``sharedfs``) is likewise set up on first use,
    mounted on every node, and torn down before the cluster. :func:`run_study` releases
    everything whenever the node count changes, so one cluster is up at a time.
    """

    def __init__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.by_nodes: dict[int, Any] = {}
        self.storage_by_nodes: dict[int, Any] = {}

    def get(self, nodes: int) -> Any:
        if nodes == 1:
            return None
        if nodes not in self.by_nodes:
            from ..emulate import EmulatedCluster

            self.by_nodes[nodes] = self.stack.enter_context(EmulatedCluster(nodes=nodes))
        return self.by_nodes[nodes]

    def storage(self, cfg: RunConfig) -> Any:
        """The sshfs storage server of ``cfg``'s cluster when ``cfg`` needs one, else None."""
        if cfg.sharedfs_mount() != "sshfs":
            return None
        if cfg.nodes not in self.storage_by_nodes:
            from .sshfs import SshfsStorage

            self.storage_by_nodes[cfg.nodes] = self.stack.enter_context(
                SshfsStorage(self.get(cfg.nodes)))
        return self.storage_by_nodes[cfg.nodes]

    def release(self) -> None:
        """Tear everything down, in reverse order of creation (storage before its cluster)."""
        self.stack.close()
        self.by_nodes.clear()
        self.storage_by_nodes.clear()


@contextlib.contextmanager
def _clusters() -> Iterator[_Clusters]:
    c = _Clusters()
    try:
        yield c
    finally:
        c.release()


def run_study(
    preset: str | Preset,
    out: str | Path,
    *,
    experiments: tuple[str, ...] = EXPERIMENTS,
    repetitions: int | None = None,
    workdir: str | None = None,
    progress: bool = True,
    command: str = "",
    sharedfs_kind: str | None = None,
    launcher: str = "emulated",
    sync: str | None = None,
) -> dict[str, Any]:
    """Run a study preset and write its report directory.

    Parameters
    ----------
    preset
        ``"small"``, ``"paper"``, ``"tiny"`` or a :class:`Preset`.
    out
        Report directory: ``runs/`` (every run's tables), ``tables/``, ``figures/``,
        ``study.json`` and ``report.md``.
    experiments
        A subset of :data:`EXPERIMENTS`.
    repetitions
        Override the preset's repetitions.
    workdir
        Directory for node-local data of one-node runs (default: ``/dev/shm``; emulated nodes
        have their own). Not with the slurm launcher.
    progress
        Show a progress bar over configurations.
    command
        The command line to record in the report.
    sharedfs_kind
        Override the preset's ``sharedfs`` (``"sshfs"``: a network file system, or ``"dir"``:
        a plain shared directory); see :class:`~instride.bench.workflow_run.RunConfig`.
    launcher
        ``"emulated"`` (ranks started by ``mpiexec`` inside emulated nodes) or ``"slurm"``
        (every repetition a batch job on an emulated Slurm cluster, ranks placed by ``srun``;
        ``sharedfs`` is then the cluster's shared directory); see
        :mod:`instride.bench.slurm`.
    sync
        Override the preset's synchronization of the file-system baselines
        (``"serialized"``, the paper's, or ``"pipelined"``).

    Returns
    -------
    dict
        The study results (also in ``study.json``), with the load averages of this machine
        at the start and the end (``load_average``).

    Raises
    ------
    BenchConfigError
        An unknown preset, experiment, launcher or synchronization; ``sharedfs_kind="sshfs"``
        or a ``workdir`` with the slurm launcher.
    BenchRunError
        A configuration failed; ``out`` is left as it was.
    """
    from ..progress import progress as tqdm
    from .report import write_report

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise BenchConfigError("preset", f"unknown {preset!r}; expected one of {list(PRESETS)}")
        preset = PRESETS[preset]
    if repetitions is not None:
        preset = replace(preset, repetitions=repetitions)
    if launcher not in ("emulated", "slurm"):
        raise BenchConfigError("launcher", f"unknown {launcher!r}; expected emulated or slurm")
    if launcher == "slurm":
        if sharedfs_kind == "sshfs":  # (it used to be switched to "dir" without a word)
            raise BenchConfigError("sharedfs_kind", "sshfs does not run under the slurm "
                                   "launcher: sharedfs is the Slurm cluster's shared directory")
        if workdir is not None:  # (and this one ignored)
            raise BenchConfigError("workdir", "the slurm launcher keeps node-local data in "
                                   "each node's /dev/shm")
        sharedfs_kind = "dir"  # the Slurm cluster's shared directory
    if sharedfs_kind is not None:
        preset = replace(preset, sharedfs_kind=sharedfs_kind)
    if sync is not None:
        if sync not in SYNC_MODES:
            raise BenchConfigError("sync", f"unknown {sync!r}; expected one of {SYNC_MODES}")
        preset = replace(preset, sync=sync)
    if preset.sharedfs_kind == "sshfs" and any(
        p.config.sharedfs_mount() == "sshfs" for p in plan(preset, tuple(experiments))
    ):
        from .sshfs import require

        require()  # fail before the first configuration, not half-way through the study
    planned = plan(preset, tuple(experiments))
    results: list[dict[str, Any]] = []
    started = time.time()
    load_start = os.getloadavg()
    on_slurm: Any = contextlib.nullcontext()
    if launcher == "slurm":
        from .slurm import emulated_slurm_runner

        on_slurm = emulated_slurm_runner(max(p.config.nodes for p in planned))
    with staged_output(out, STUDY_OUTPUTS) as stage:
        with _clusters() as clusters, on_slurm as slurm_run:
            bar = tqdm(planned, desc="study", unit="config", disable=not progress)
            current_nodes = 0
            for item in bar:
                cfg = item.config if workdir is None else replace(item.config, workdir=workdir)
                bar.set_postfix_str(item.config.label, refresh=True)
                if cfg.nodes != current_nodes:  # free the previous node count's cluster
                    clusters.release()
                    current_nodes = cfg.nodes
                run_dir = stage / "runs" / item.experiment / cfg.name
                if slurm_run is not None:
                    summary = slurm_run(cfg, run_dir)
                else:
                    summary = run(cfg, run_dir, cluster=clusters.get(cfg.nodes),
                                  storage=clusters.storage(cfg), progress=False)
                results.append({"experiment": item.experiment, "x": item.x, "group": item.group,
                                "summary": summary})
        study = {
            "preset": asdict(preset),
            "experiments": list(experiments),
            "elapsed_s": time.time() - started,
            "load_average": {"start": list(load_start), "end": list(os.getloadavg())},
            "command": command,
            "launcher": launcher,
            "results": results,
        }
        (stage / "study.json").write_text(json.dumps(study, indent=1))
        write_report(study, stage)
    return study


__all__ = ["EXPERIMENTS", "PRESETS", "STUDY_OUTPUTS", "Planned", "Preset", "plan", "run_study"]
