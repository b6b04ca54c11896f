"""Run one configuration of the paper's workflow: ``instride bench run``.

:func:`run` launches ``2 x pairs`` ranks of :mod:`instride.bench.workflow` with the venv's
``mpiexec`` (MPICH), once per repetition, then merges the ranks' timing rows into a tidy table
and a JSON summary (:mod:`instride.bench.results`).

Placement follows the paper. On one node every rank runs here. On ``N >= 2`` emulated nodes
(:class:`instride.emulate.EmulatedCluster`), producers run on nodes ``1 .. N/2`` and consumers
on nodes ``N/2+1 .. N``, pair ``p`` on producer node ``1 + p % (N/2)`` and consumer node
``N/2 + 1 + p % (N/2)``. Each rank is started inside its node's network namespace with its
node's ``INSTRIDE_*`` environment by an MPMD command line::

    mpiexec -n 1 ip netns exec NS1 env INSTRIDE_DIR=... python -m instride.bench.workflow S 0 \\
          : -n 1 ip netns exec NS2 env INSTRIDE_DIR=... python -m instride.bench.workflow S 0

The MPI ranks still share the machine (MPICH sees one host name, so its pairwise barriers go
through shared memory): an emulated node isolates the network and the managed directory, not
MPI's own messages.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import InstrideError
from .backends import BACKENDS
from .molecules import BenchConfigError, Model, get_model
from .results import RUN_OUTPUTS, merge_repetition, staged_output, summarize, write_tables
from .sync import SYNC_MODES

#: What the ``sharedfs`` backend can be (see :class:`RunConfig`).
SHAREDFS_KINDS = ("auto", "sshfs", "dir")

#: Bytes per second the repetition's time budget assumes for all of a run's data movement
#: together: conservative for what every pair shares (one sshfs storage server over the
#: emulated network measured ~200 MB/s; the machine's cores and memory bus).
BUDGET_BYTES_PER_SECOND = 50e6

#: Lines of the ranks' output a failed repetition's error carries.
_TAIL_LINES = 15


class BenchRunError(InstrideError, RuntimeError):
    """A workflow run failed (a rank exited with an error or the run timed out)."""

    def __init__(self, what: str, detail: str) -> None:
        self.what = what
        self.detail = detail
        super().__init__(f"{what}: {detail}")


@dataclass(frozen=True)
class RunConfig:
    """One workflow configuration.

    Attributes
    ----------
    model
        Paper model name (``JAC``, ``ApoA1``, ``F1-ATPase``, ``STMV``); with ``atoms``, the model
        whose timing a custom atom count borrows.
    atoms
        Custom atom count (instead of a paper model).
    stride
        MD steps per frame; default: Table II for the model.
    steps_per_second
        MD performance; default: Table I for the model.
    frames
        Frames per pair (the paper: 128).
    pairs
        Producer/consumer pairs.
    nodes
        1 (everything on this node) or an even number of emulated nodes (half producers, half
        consumers).
    backend
        ``instride``, ``localfs`` (one node only) or ``sharedfs``.
    sync
        How the file-system backends synchronize a pair (:data:`~instride.bench.sync.
        SYNC_MODES`): ``"serialized"`` (the default, the paper's coarse-grained
        synchronization: a barrier after the write and one after the consumer's analytics, so
        MD and analytics never overlap) or ``"pipelined"`` (only the barrier after the write:
        the consumer's analytics overlaps the producer's next MD stride). Ignored by instride.
    sharedfs_kind
        What ``sharedfs`` is: ``"sshfs"`` (a storage server on the emulated network, mounted
        with sshfs on every node: real network data movement; needs ``nodes >= 2``), ``"dir"``
        (a plain directory every node sees: synchronization only) or ``"auto"`` (the default:
        sshfs on ``nodes >= 2``, a directory on one node). See
        :mod:`instride.bench.sshfs`.
    repetitions
        Runs of the configuration (the paper: 10).
    time_scale
        Multiplies the MD and analytics sleeps (1.0 = a frame every 0.82 s, as in the paper);
        finite, ``>= 0``. It does not shorten data movement: a small scale can make a run
        bound by data movement rather than by the frame period (the study report flags it).
    sleep
        ``"stride"`` (one MD sleep per frame) or ``"step"`` (one per MD step).
    fsync
        fsync every frame before it becomes visible (all backends alike).
    keep_frames
        Do not delete each frame after its analytics step. On one node with ``workdir``
        given, every repetition's frames stay there after the run (the summary's
        ``frames_kept`` lists their directories); otherwise (a temporary work directory,
        emulated nodes whose directories go with the cluster) they stay until the repetition
        ends.
    timeout
        Seconds any single wait (publication, barrier) may take before the run fails;
        ``inf`` or ``None``: no limit (nor on the run as a whole).
    workdir
        Directory for the node-local data (default: a new directory on ``/dev/shm``).
    label
        Free-form name of the configuration in tables and reports.
    """

    model: str | None = "JAC"
    atoms: int | None = None
    stride: int | None = None
    steps_per_second: float | None = None
    frames: int = 128
    pairs: int = 1
    nodes: int = 1
    backend: str = "instride"
    sync: str = "serialized"
    sharedfs_kind: str = "auto"
    repetitions: int = 1
    time_scale: float = 1.0
    sleep: str = "stride"
    fsync: bool = False
    keep_frames: bool = False
    timeout: float | None = 120.0
    workdir: str | None = None
    label: str = field(default="", compare=False)

    def resolved_model(self) -> Model:
        """The :class:`Model` with this configuration's stride and steps per second applied."""
        model = get_model(self.model, atoms=self.atoms)
        if self.stride is not None:
            model = replace(model, stride=self.stride)
        if self.steps_per_second is not None:
            model = replace(model, steps_per_second=self.steps_per_second)
        return model

    def sharedfs_mount(self) -> str | None:
        """``"sshfs"`` or ``"dir"`` for the ``sharedfs`` backend (``auto`` resolved), else None."""
        if self.backend != "sharedfs":
            return None
        if self.sharedfs_kind == "auto":
            return "sshfs" if self.nodes > 1 else "dir"
        return self.sharedfs_kind

    def validate(self) -> RunConfig:
        """Return self, or raise :class:`BenchConfigError` naming the first bad setting."""
        for name in ("frames", "pairs", "nodes", "repetitions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise BenchConfigError(name, f"expected a positive integer, got {value!r}")
        if self.backend not in BACKENDS:
            raise BenchConfigError(
                "backend", f"unknown {self.backend!r}; expected one of {BACKENDS}"
            )
        if self.nodes > 1 and self.nodes % 2:
            raise BenchConfigError(
                "nodes",
                f"{self.nodes}: expected 1 or an even number (half producers, half consumers)",
            )
        if self.backend == "localfs" and self.nodes > 1:
            raise BenchConfigError(
                "backend", "localfs is a node-local directory: it cannot move data between nodes "
                "(use sharedfs or instride with --nodes >= 2)"
            )
        if self.sharedfs_kind not in SHAREDFS_KINDS:
            raise BenchConfigError(
                "sharedfs_kind", f"unknown {self.sharedfs_kind!r}; expected one of {SHAREDFS_KINDS}"
            )
        if self.sharedfs_mount() == "sshfs" and self.nodes < 2:
            raise BenchConfigError(
                "sharedfs_kind", "sshfs mounts a storage server over the emulated network: it "
                "needs --nodes >= 2 (use --sharedfs-kind dir on one node)"
            )
        if self.stride is not None and (isinstance(self.stride, bool) or self.stride < 1):
            raise BenchConfigError("stride", f"expected a positive integer, got {self.stride!r}")
        if self.steps_per_second is not None and not (
            _is_number(self.steps_per_second) and math.isfinite(self.steps_per_second)
            and self.steps_per_second > 0
        ):
            raise BenchConfigError(
                "steps_per_second", f"must be a finite number > 0, got {self.steps_per_second!r}"
            )
        if not (_is_number(self.time_scale) and math.isfinite(self.time_scale)
                and self.time_scale >= 0):
            raise BenchConfigError(
                "time_scale", f"must be a finite number >= 0, got {self.time_scale!r}"
            )
        if self.sleep not in ("stride", "step"):
            raise BenchConfigError("sleep", f"expected 'stride' or 'step', got {self.sleep!r}")
        if self.sync not in SYNC_MODES:
            raise BenchConfigError("sync", f"unknown {self.sync!r}; expected one of {SYNC_MODES}")
        if self.timeout is not None and not (_is_number(self.timeout) and self.timeout > 0):
            # NaN fails "> 0"; inf passes: no limit
            raise BenchConfigError(
                "timeout", f"must be > 0 seconds (inf: no limit), got {self.timeout!r}"
            )
        self.resolved_model()
        return self

    @property
    def wait_limit(self) -> float | None:
        """Seconds a single wait may take, ``None`` for no limit (``timeout`` inf or None)."""
        if self.timeout is None or math.isinf(self.timeout):
            return None
        return float(self.timeout)

    @property
    def frame_period(self) -> float:
        """Seconds between two frames: stride / steps per second x time scale."""
        model = self.resolved_model()
        return model.stride / model.steps_per_second * self.time_scale

    def time_budget(self, slack: float = 60.0) -> float | None:
        """Seconds one repetition may run before it is stopped (``None``: no limit).

        ``slack`` covers start-up; each frame may take three frame periods (a serialized
        pair takes two), each rank three seconds to start, plus one wait's limit. Data
        movement is not paced by the frame period (the time scale does not shorten it): each
        frame of every pair is moved up to three times (write; transfer or network file
        system; read), and the budget allows for all of it, one pair after another, at
        :data:`BUDGET_BYTES_PER_SECOND` (a run of STMV frames over one sshfs server is
        bound by data movement, not by the frame period).
        """
        limit = self.wait_limit
        if limit is None:
            return None
        moved = 3 * self.frames * self.pairs * self.resolved_model().frame_bytes("paper")
        return (slack + 3 * self.frames * self.frame_period + moved / BUDGET_BYTES_PER_SECOND
                + 3.0 * 2 * self.pairs + limit)

    def spec(self, run_id: str, raw: Path, root: str | None, nodes_of: list[int]
             ) -> dict[str, Any]:
        """The spec the ranks of one repetition read (:mod:`instride.bench.workflow`).

        Parameters
        ----------
        run_id
            Unique name of the repetition (the frames' directory).
        raw
            Where the ranks write their timing rows.
        root
            The file-system backends' directory as the ranks see it, else ``None``.
        nodes_of
            The node (1-based) of every rank.

        Returns
        -------
        dict
            JSON-serializable; ``timeout`` is ``None`` when there is no limit.
        """
        model = self.resolved_model()
        return {
            "run_id": run_id, "backend": self.backend, "root": root,
            "sharedfs_kind": self.sharedfs_mount(), "sync": self.sync,
            "atoms": model.atoms, "stride": model.stride,
            "steps_per_second": model.steps_per_second, "frames": self.frames,
            "pairs": self.pairs, "time_scale": self.time_scale, "sleep": self.sleep,
            "fsync": self.fsync, "keep_frames": self.keep_frames, "timeout": self.wait_limit,
            "raw_dir": str(raw), "placement": [f"node{n}" for n in nodes_of],
        }

    def summary_config(self) -> dict[str, Any]:
        """The ``config`` entry of ``summary.json``: the settings and what they resolve to."""
        model = self.resolved_model()
        return asdict(self) | {
            "name": self.name, "sharedfs_mount": self.sharedfs_mount(),
            "model_name": model.name, "atoms": model.atoms, "stride": model.stride,
            "steps_per_second": model.steps_per_second,
            "frame_bytes": model.frame_bytes("paper"), "frame_period_s": self.frame_period,
        }

    @property
    def name(self) -> str:
        """A short unique-enough name: backend, model, stride, pairs, nodes.

        A plain-directory ``sharedfs`` across emulated nodes (not the default there) is
        ``sharedfs_dir``; a file system with ``sync="pipelined"`` (not the default) ends its
        backend part with ``_pipelined``.
        """
        m = self.resolved_model()
        backend = self.backend
        if self.nodes > 1 and self.sharedfs_mount() == "dir":
            backend = "sharedfs_dir"
        if self.backend != "instride" and self.sync != "serialized":
            backend += f"_{self.sync}"
        return f"{backend}-{m.name}-s{m.stride}-p{self.pairs}-n{self.nodes}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def mpiexec_path() -> str:
    """The ``mpiexec`` of this interpreter's environment (the mpich wheel), else on PATH.

    Raises
    ------
    BenchConfigError
        When no ``mpiexec`` exists (``pip install mpich mpi4py``).
    """
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        raise BenchConfigError("mpi", "no mpiexec found; install MPI: pip install mpich mpi4py")
    return found


def placement(pairs: int, nodes: int) -> list[int]:
    """Node number (1-based) of every rank: producers first, then consumers."""
    if nodes == 1:
        return [1] * (2 * pairs)
    half = nodes // 2
    producers = [1 + p % half for p in range(pairs)]
    consumers = [half + 1 + p % half for p in range(pairs)]
    return producers + consumers


def _default_workdir() -> Path:
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="instride-bench-", dir=base))


_NODE_VARS = ("INSTRIDE_DIR", "INSTRIDE_REDIS_URL", "INSTRIDE_TOKEN", "INSTRIDE_NODE",
              "INSTRIDE_ADDR", "INSTRIDE_SOCKET", "INSTRIDE_CACHE_BYTES", "INSTRIDE_TIMEOUT")


@contextlib.contextmanager
def _maybe_cluster(cfg: RunConfig, cluster: Any) -> Iterator[Any]:
    if cfg.nodes == 1:
        yield None
        return
    if cluster is not None:
        if len(cluster.nodes) < cfg.nodes:
            raise BenchConfigError(
                "nodes", f"{cfg.nodes} nodes asked, the cluster given has {len(cluster.nodes)}"
            )
        yield cluster
        return
    from ..emulate import EmulatedCluster

    need_servers = cfg.backend == "instride"
    with EmulatedCluster(nodes=cfg.nodes, serve=need_servers, redis=need_servers) as made:
        yield made


@contextlib.contextmanager
def _maybe_storage(cfg: RunConfig, cluster: Any, storage: Any) -> Iterator[Any]:
    """The sshfs storage server of a ``sharedfs``/``sshfs`` run (given or made here)."""
    if cfg.sharedfs_mount() != "sshfs":
        yield None
        return
    from .sshfs import SshfsStorage, covers

    nodes = sorted(set(placement(cfg.pairs, cfg.nodes)))
    if storage is not None:
        if storage.cluster is not cluster or not covers(storage, nodes):
            raise BenchConfigError(
                "storage", f"the sshfs storage given is not mounted on nodes {nodes} of this "
                "run's cluster"
            )
        yield storage
        return
    with SshfsStorage(cluster, nodes=nodes) as made:
        yield made


def _rank_argv(spec_path: Path, rep: int) -> list[str]:
    # `python -m mpi4py` calls MPI_Abort on an uncaught exception, so one failed rank ends the
    # whole job instead of leaving its partners blocked in MPI.
    return [sys.executable, "-m", "mpi4py", "-m", "instride.bench.workflow", str(spec_path),
            str(rep)]


def _common_env(cluster: Any, nodes_of: list[int]) -> dict[str, str]:
    """``INSTRIDE_*`` variables with the same value on every node used (token, Redis URL)."""
    envs = [cluster.node(n).env for n in sorted(set(nodes_of))]
    return {
        k: v for k, v in envs[0].items()
        if k.startswith("INSTRIDE_") and all(e.get(k) == v for e in envs[1:])
    }


def _command(cfg: RunConfig, spec_path: Path, rep: int, nodes_of: list[int], cluster: Any,
             fsync_env: str) -> list[str]:
    mpiexec = mpiexec_path()
    if cluster is None:
        return [mpiexec, "-n", str(len(nodes_of)), *_rank_argv(spec_path, rep)]
    argv = [mpiexec]
    common = _common_env(cluster, nodes_of)
    for rank, node in enumerate(nodes_of):
        if rank:
            argv.append(":")
        env = cluster.node(node).env
        # Only what differs between nodes goes on the command line (never the job token).
        assign = [f"{k}={v}" for k, v in env.items()
                  if k.startswith("INSTRIDE_") and k not in common]
        assign.append(f"INSTRIDE_FSYNC={fsync_env}")
        inner = ["env", *assign, *_rank_argv(spec_path, rep)]
        argv += ["-n", "1", *cluster.command(node, inner)]
    return argv


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started for this mpiexec
    with contextlib.suppress(Exception):
        proc.wait(5)


#: What an aborted MPICH job leaves behind (``MPI_Abort``, or a killed ``mpiexec``, skips the
#: clean-up): its ranks' shared-memory segments, and the topology file Hydra (``mpiexec``)
#: writes for its proxies — always under ``/tmp``, whatever ``TMPDIR`` says.
_LEFTOVERS = ((Path("/dev/shm"), "mpich_shm_*"), (Path("/tmp"), "hydra_hwloc_xmlfile_*"))


def mpich_segments() -> set[str]:
    """The paths of MPICH's shared-memory segments and Hydra's topology files now there."""
    found: set[str] = set()
    for where, pattern in _LEFTOVERS:
        with contextlib.suppress(OSError):
            found.update(str(p) for p in where.glob(pattern))
    return found


def segments_in_use(paths: set[str]) -> set[str]:
    """The files among ``paths`` (see :func:`mpich_segments`) that a live process has open or
    mapped.

    Parameters
    ----------
    paths
        Absolute paths of MPICH segments (``/dev/shm/mpich_shm_*``) or Hydra topology files
        (``/tmp/hydra_hwloc_xmlfile_*``).

    Returns
    -------
    set of str
        The subset still in use; the others are orphans an aborted job left behind.
    """
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target in paths:
                        used.add(target)
            maps = (proc / "maps").read_text()
            used.update(p for p in paths if p in maps)
    return used & paths


def remove_orphan_segments(before: set[str], settle: float = 5.0) -> None:
    """Remove the MPICH shared-memory segments and Hydra topology files an aborted job left
    behind.

    ``MPI_Abort`` skips the unlink MPICH does at finalize. Only files that appeared during our
    run (``before``: :func:`mpich_segments` then) and that no live process has open or mapped
    are removed. Ranks of the aborted job may still be exiting when ``mpiexec`` has returned:
    files still in use are looked at again for up to ``settle`` seconds (another job's live
    files stay, however long).
    """
    new = mpich_segments() - before
    deadline = time.monotonic() + settle
    while True:
        used = segments_in_use(new)
        for path in new - used:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        new = used
        if not new or time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def _tail(stdout: bytes, stderr: bytes) -> str:
    """The last lines of the ranks' output (stderr, else stdout), for an error message."""
    lines = stderr.decode(errors="replace").strip().splitlines()
    if not lines:
        lines = stdout.decode(errors="replace").strip().splitlines()
    return "\n".join(lines[-_TAIL_LINES:])


def run_once(cfg: RunConfig, out: Path, rep: int, cluster: Any, workdir: Path,
             storage: Any = None) -> Path | None:
    """Run repetition ``rep`` of ``cfg``; its raw rows land in ``out/raw/rep<rep>``.

    ``storage`` is the :class:`~instride.bench.sshfs.SshfsStorage` of a sshfs ``sharedfs`` run:
    the ranks then use their own node's mount (the spec's ``root`` holds ``{node}``), and the
    run's directory is created and removed on the storage server's side.

    With ``cfg.keep_frames`` and ``cfg.workdir`` given, a one-node run leaves its frames
    there and returns their directory; else every frame is removed and ``None`` returned.
    """
    run_id = f"run{rep}-{secrets.token_hex(4)}"
    raw = out / "raw" / f"rep{rep}"
    if raw.exists():
        shutil.rmtree(raw)
    raw.mkdir(parents=True)
    nodes_of = placement(cfg.pairs, cfg.nodes)
    cleanup: list[Path] = []
    env = {k: v for k, v in os.environ.items() if k not in _NODE_VARS}
    fsync_env = "1" if cfg.fsync else "0"
    env["INSTRIDE_FSYNC"] = fsync_env
    root: Path | None = None
    rank_root: str | None = None  # the root as the ranks see it, when not ``root``
    if cfg.backend == "localfs":
        root = workdir / "localfs"
    elif cfg.backend == "sharedfs" and cfg.sharedfs_mount() == "sshfs":
        if storage is None:
            raise BenchConfigError("storage", "a sshfs sharedfs run needs its SshfsStorage")
        root = storage.export / "bench"
        rank_root = f"{storage.mount_template}/bench"
    elif cfg.backend == "sharedfs":
        root = (Path(cluster.shared_dir) / "bench") if cluster is not None else workdir / "sharedfs"
    elif cluster is None:
        env["INSTRIDE_DIR"] = str(workdir / "instride")
        cleanup.append(workdir / "instride" / run_id)
    else:
        cleanup += [Path(cluster.node(n).env["INSTRIDE_DIR"]) / run_id for n in set(nodes_of)]
    if cluster is not None:
        env.update(_common_env(cluster, nodes_of))
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        cleanup.append(root / run_id)
    spec = cfg.spec(run_id, raw, rank_root or (str(root) if root else None), nodes_of)
    spec_path = raw / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    argv = _command(cfg, spec_path, rep, nodes_of, cluster, fsync_env)
    (raw / "command.txt").write_text(" ".join(argv) + "\n")
    # With --keep-frames, the frames' directory of a one-node run in the user's --workdir
    # stays (nothing else of the run is in it). A temporary workdir is removed after the run,
    # and emulated nodes' directories go with the cluster: no frame could be found there.
    kept: Path | None = None
    if cfg.keep_frames and cfg.workdir is not None and cluster is None:
        kept = root / run_id if root is not None else workdir / "instride" / run_id
    budget = cfg.time_budget()
    segments = mpich_segments()
    ok = False
    try:
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            stdout, stderr = proc.communicate(timeout=budget)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            # what the ranks wrote until now (the pipes close with the killed group)
            try:
                stdout, stderr = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # (a process outside the group holds a pipe)
                stdout, stderr = b"", b""
            tail = _tail(stdout, stderr)
            raise BenchRunError(
                cfg.name, f"repetition {rep} exceeded {budget:.0f} s"
                + (f"; the ranks' output ended with:\n{tail}" if tail else "")
            ) from None
        finally:
            if proc.returncode is None:  # timed out, interrupted, or the wait itself failed
                _kill_group(proc)
        (raw / "mpiexec.log").write_bytes(stdout + b"\n--- stderr ---\n" + stderr)
        if proc.returncode != 0:
            _kill_group(proc)  # ranks of the aborted job that are still exiting
            raise BenchRunError(
                cfg.name, f"repetition {rep}: mpiexec exited {proc.returncode}:\n"
                + _tail(b"", stderr)
            )
        ok = True
    finally:
        if not ok:  # on every failure path: what an aborted MPICH job leaves in /dev/shm, /tmp
            remove_orphan_segments(segments)
        for path in cleanup:
            if ok and path == kept:
                continue  # (a failed repetition's frames are not results: removed)
            shutil.rmtree(path, ignore_errors=True)
    return kept


def run(
    cfg: RunConfig,
    out: str | os.PathLike[str],
    *,
    cluster: Any = None,
    storage: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every repetition of ``cfg`` and write its results under ``out``.

    Writes ``out/timings.csv`` (one row per repetition x rank x frame x region),
    ``out/ranks.csv`` (one row per repetition x rank: wall time, frames verified),
    ``out/summary.json`` (per role: mean data movement / idle time per frame, and more) and
    ``out/raw/``. They are built in a hidden staging directory under ``out`` and replace an
    earlier run's only when every repetition succeeded; a failed run leaves ``out`` as it was.

    Parameters
    ----------
    cfg
        The configuration.
    out
        Output directory (created); other files in it are left alone.
    cluster
        A running :class:`~instride.emulate.EmulatedCluster` to reuse for ``nodes >= 2``;
        default: one is created for this run and torn down after it.
    storage
        A running :class:`~instride.bench.sshfs.SshfsStorage` on ``cluster``, mounted on the
        run's nodes, to reuse for a sshfs ``sharedfs`` run; default: one is set up for this
        run (a second or so) and torn down after it.
    progress
        Show a progress bar over repetitions.

    Returns
    -------
    dict
        The summary (also written to ``summary.json``); its ``frames_kept`` lists the
        directories of the frames kept (``cfg.keep_frames`` with ``cfg.workdir`` on one node).

    Raises
    ------
    BenchConfigError
        Invalid configuration.
    BenchRunError
        A rank failed or the run timed out.
    """
    cfg.validate()
    workdir = Path(cfg.workdir) if cfg.workdir else _default_workdir()
    own_workdir = cfg.workdir is None
    workdir.mkdir(parents=True, exist_ok=True)
    timings: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    kept: list[str] = []
    started = time.time()
    try:
        # everything is built in out/.partial-*, and moved into out only once complete
        with staged_output(out, RUN_OUTPUTS) as stage, _maybe_cluster(cfg, cluster) as clu, \
                _maybe_storage(cfg, clu, storage) as sto:
            from ..progress import progress as tqdm

            for rep in tqdm(range(cfg.repetitions), desc=cfg.label or cfg.name, unit="rep",
                            disable=not progress, leave=False):
                frames = run_once(cfg, stage, rep, clu, workdir, sto)
                if frames is not None:
                    kept.append(str(frames))
                t, r = merge_repetition(stage / "raw" / f"rep{rep}")
                timings += t
                ranks += r
            summary = summarize(timings, ranks, cfg.summary_config())
            summary["elapsed_s"] = time.time() - started
            summary["frames_kept"] = kept  # (--keep-frames: directories of frames left)
            write_tables(stage, timings, ranks, summary)
    except BaseException:
        for path in kept:  # a failed run leaves nothing of its own behind, frames included
            shutil.rmtree(path, ignore_errors=True)
        raise
    finally:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    return summary


__all__ = ["SHAREDFS_KINDS", "BenchRunError", "RunConfig", "mpiexec_path", "placement", "run",
           "run_once", "segments_in_use"]
