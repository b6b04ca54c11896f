"""``instride analyze`` and ``instride export`` (a plugin of :mod:`instride.cli`).

``instride analyze rmsd --topology TOP --trajectory TRAJ --select SEL --workers N --out DIR``
runs split-apply-combine over TRAJ (a file MDAnalysis reads, an H5MD ``.h5`` file, or
``instride://STREAM``) and writes ``DIR/rmsd.csv`` plus the timing report
(``timing.txt``, ``timing.json``, ``timing_ranks.csv``, ``timing.png``).

``--backend mpi``: when the command runs under a launcher (``mpiexec -n N instride analyze
... --backend mpi``, ``srun``), the N ranks are the workers. Otherwise it launches itself with
``mpiexec -n WORKERS`` (the ``mpiexec`` next to the Python interpreter, ``$INSTRIDE_MPIEXEC``
or ``--mpiexec``).

``instride export --h5md STREAM out.h5`` writes a stream as an H5MD file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

from . import exit_code, positive_int, positive_number, positive_seconds, timeout_arg

_MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _rank() -> int:
    for v in _MPI_RANK_VARS:
        if v in os.environ:
            return int(os.environ[v])
    return 0


def _straggle(text: str) -> tuple[int, float]:
    """``RANK:SECONDS`` of ``--straggle``: a rank >= 0 and a finite delay >= 0."""
    rank, sep, sec = text.partition(":")
    try:
        if not sep:
            raise ValueError
        r, s = int(rank), float(sec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected RANK:SECONDS, got {text!r}") from None
    if r < 0 or not math.isfinite(s) or s < 0:
        raise argparse.ArgumentTypeError(
            f"expected RANK:SECONDS with RANK >= 0 and SECONDS a finite number >= 0, got {text!r}")
    return r, s


def _kwargs(text: str) -> dict[str, Any]:
    """``--kwargs``: a JSON object (the keyword arguments of the class)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"k\": 1}}', "
                                         f"got {text!r}")
    return value


def _analysis(args: argparse.Namespace) -> Any:
    from ..parallel.adapters import AnalysisBaseAdapter, radius_of_gyration, rmsd
    from ..parallel.inputs import ADK_CORE_CA

    given = args.select is not None  # (an empty selection is refused, not the default's)
    if args.analysis == "rmsd":
        return rmsd(select=args.select if given else ADK_CORE_CA, ref_frame=args.ref_frame)
    if args.analysis == "rg":
        return radius_of_gyration(select=args.select if given else "protein")
    return AnalysisBaseAdapter(args.cls, select=args.select if given else "all",
                               kwargs=args.kwargs)


def _check_out(out: str) -> None:
    """Refuse an ``--out`` the results could not be written to, before the analysis runs
    (not after it: hours of work lost). Nothing is created here."""
    from ..errors import ConfigError

    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ConfigError("--out", out, "exists and is not a directory")
    parent = path if path.exists() else next(
        (p for p in path.absolute().parents if p.exists()), Path("/"))
    if not parent.is_dir():
        raise ConfigError("--out", out, f"{parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError("--out", out, f"{parent} is not writable")


def _relaunch_argv(args: argparse.Namespace) -> list[str]:
    """The same command, for each rank started by mpiexec."""
    argv = ["analyze", args.analysis, "--topology", args.topology, "--trajectory",
            args.trajectory, "--backend", "mpi", "--workers", str(args.workers),
            "--out", args.out, "--straggler-factor", str(args.straggler_factor)]
    if args.select is not None:
        argv += ["--select", args.select]
    if args.baseline_serial:
        argv.append("--baseline-serial")
    if args.baseline_time is not None:
        argv += ["--baseline-time", str(args.baseline_time)]
    for r, s in args.straggle:
        argv += ["--straggle", f"{r}:{s}"]
    if args.timeout is not None:
        argv += ["--timeout", str(args.timeout)]
    if args.no_plot:
        argv.append("--no-plot")
    if args.progress:
        argv.append("--progress")
    if args.analysis == "rmsd":
        argv += ["--ref-frame", str(args.ref_frame)]
    if args.analysis == "mda":
        argv += ["--class", args.cls, "--kwargs", json.dumps(args.kwargs)]
    return argv


_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE")


def _check_straggle(args: argparse.Namespace) -> None:
    """Refuse a ``--straggle`` of a rank that will not exist (it was accepted, never applied)."""
    from ..errors import ConfigError

    if args.backend != "mpi":
        ranks: int | None = 1 if args.backend == "serial" else (args.workers or 1)
    elif args.workers is not None:
        ranks = args.workers
    else:  # (under a launcher: its count; else unknown here, checked by the ranks)
        ranks = next((int(os.environ[v]) for v in _MPI_SIZE_VARS
                      if os.environ.get(v, "").isdigit()), None)
    for rank, seconds in args.straggle:
        if ranks is not None and rank >= ranks:
            raise ConfigError("--straggle", f"{rank}:{seconds}",
                              f"there is no rank {rank}: the analysis runs {ranks} rank(s), "
                              f"0..{ranks - 1}")


def cmd_analyze(args: argparse.Namespace) -> int:
    from ..errors import InstrideError
    from ..parallel.execute import analyze, launch_mpi, under_mpi_launcher

    _check_out(args.out)
    _check_straggle(args)
    if args.backend == "mpi" and not under_mpi_launcher() and (args.workers or 1) > 1:
        return launch_mpi(_relaunch_argv(args), args.workers, args.mpiexec)
    baseline: str | float | None = None
    if args.baseline_serial:
        baseline = "serial"
    elif args.baseline_time is not None:
        baseline = args.baseline_time
    try:
        run = analyze(
            _analysis(args), args.trajectory, args.topology, workers=args.workers,
            backend=args.backend, baseline=baseline, straggle=dict(args.straggle),
            straggler_factor=args.straggler_factor, timeout=args.timeout,
            progress=args.progress,
        )
    except InstrideError as exc:
        if args.backend == "mpi" and _rank() != 0:
            return exit_code(exc)  # rank 0 prints the error once
        raise
    if run is None:  # MPI rank > 0
        return 0
    paths = run.write(args.out, plot=not args.no_plot)
    print(run.timing.format())
    for kind, path in paths.items():
        print(f"wrote {kind:9} {path}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..parallel.h5md import export_h5md

    path = export_h5md(args.source, args.out, topology=args.topology, timeout=args.timeout,
                       overwrite=args.force, progress=not args.quiet)
    print(path)
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``analyze`` and ``export`` to the ``instride`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--topology", required=True, help="topology file (PSF, PDB, GRO, ...)")
    common.add_argument("--trajectory", required=True,
                        help="trajectory file, H5MD .h5 file, or instride://STREAM")
    common.add_argument("--select", default=None, help="MDAnalysis atom selection")
    common.add_argument("--workers", type=positive_int, default=None,
                        help="number of ranks (mpi under a launcher: the launcher's count)")
    common.add_argument("--backend", choices=("multiprocessing", "mpi", "serial"),
                        default="multiprocessing",
                        help="multiprocessing on this node (default) or MPI; mpi without a "
                        "launcher starts `mpiexec -n WORKERS` itself")
    common.add_argument("--out", default="analysis_out", help="output directory")
    base = common.add_mutually_exclusive_group()
    base.add_argument("--baseline-serial", action="store_true",
                      help="run on one rank first, to report S(N), E(N) and serial R_comp/IO")
    base.add_argument("--baseline-time", type=positive_seconds, default=None, metavar="SECONDS",
                      help="a known serial t_total(1), for S(N) and E(N)")
    common.add_argument("--straggle", type=_straggle, action="append", default=[],
                        metavar="RANK:SECONDS",
                        help="testing/diagnostics: make RANK sleep SECONDS per frame")
    common.add_argument("--straggler-factor", type=positive_number, default=1.5,
                        help="flag ranks whose work time exceeds this x the median (1.5)")
    common.add_argument("--timeout", type=timeout_arg, default=None,
                        help="seconds a stream input waits for frames (0: do not wait)")
    common.add_argument("--mpiexec", default=None, help="mpiexec to launch with")
    common.add_argument("--no-plot", action="store_true", help="skip timing.png")
    common.add_argument("--progress", action="store_true",
                        help="progress bar for rank 0's block, on stderr")

    p = subparsers.add_parser("analyze", help="parallel trajectory analysis (split-apply-combine)")
    sub = p.add_subparsers(dest="analysis", metavar="ANALYSIS", required=True)
    q = sub.add_parser("rmsd", parents=[common],
                       help="RMSD after superposition (default: Cα of the adk CORE domain)")
    q.add_argument("--ref-frame", type=int, default=0, help="reference frame (default 0)")
    q.set_defaults(func=cmd_analyze)
    q = sub.add_parser("rg", parents=[common], help="radius of gyration (default: protein)")
    q.set_defaults(func=cmd_analyze)
    q = sub.add_parser("mda", parents=[common],
                       help="a parallelizable MDAnalysis AnalysisBase class")
    q.add_argument("--class", dest="cls", required=True,
                   help="import path, e.g. MDAnalysis.analysis.rms:RMSD")
    q.add_argument("--kwargs", type=_kwargs, default="{}",
                   help="keyword arguments of the class, a JSON object")
    q.set_defaults(func=cmd_analyze)

    p = subparsers.add_parser("export", help="write a stream (or trajectory) as an H5MD file")
    p.add_argument("--h5md", action="store_true", required=True,
                   help="output format H5MD (the only one)")
    p.add_argument("source", help="stream name or instride://NAME (a trajectory file with "
                   "--topology)")
    p.add_argument("out", help="output .h5 file")
    p.add_argument("--topology", default=None, help="topology of a trajectory-file source")
    p.add_argument("--timeout", type=timeout_arg, default=None,
                   help="seconds to wait per frame (0: do not wait)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_export)
