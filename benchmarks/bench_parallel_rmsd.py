"""Strong scaling of the parallel RMSD (Khoshlessan et al. 2020) on 1 and 2 cores.

The adk trajectory of MDAnalysisTests (3,341 atoms, 98 frames) is repeated to at least
``--frames`` frames (default 50,000 -> 50,078 frames, ~2 GB of coordinates per format) and
stored three ways:

* ``stream`` — instride per-frame files (``xyz32``, one file per frame: the limit of the
  paper's "subfiling"), in a managed directory;
* ``dcd``    — one shared DCD file, read through MDAnalysis by every rank;
* ``h5md``   — one H5MD file, every rank reading its own slice with h5py (independent I/O).

For each format and N in ``--cores`` (default 1 2), ``instride.parallel.analyze`` computes the
RMSD of the 146 Cα atoms of the CORE domain, under MPI (``mpiexec -n N``; default) or
multiprocessing, and reports the per-rank breakdown (Table 3). In the same run, MDAnalysis's own
``RMSD(...).run(backend="multiprocessing", n_workers=N)`` (``run()`` for N=1) is timed as the
baseline. Ratios printed: S(N) = t_total(1)/t_total(N) per format, and each format's time over
MDAnalysis's at the same N.

All files are read from the page cache (they were just written; the machine has enough memory),
so "I/O" here is the CPU cost of getting a frame from the kernel into numpy, not storage
bandwidth. Two cores cannot show inter-node effects (Lustre contention, network, stragglers
from remote I/O); see docs/analysis.md.

Usage::

    python benchmarks/bench_parallel_rmsd.py                       # 50,078 frames, N = 1 2
    python benchmarks/bench_parallel_rmsd.py --frames 5000 --cores 1 2 4 --backend multiprocessing
    # on a cluster (one node per line of ranks, data on the parallel FS or node-local):
    python benchmarks/bench_parallel_rmsd.py --dir $SCRATCH/bench --cores 1 24 48 96 \\
        --launcher "srun -n {n}"
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header  # noqa: E402

KINDS = ("stream", "dcd", "h5md")


def build(data: Path, frames: int) -> dict[str, Any]:
    """Write the long trajectory as DCD, H5MD and an instride stream (skipped if present)."""
    import MDAnalysis as mda
    from MDAnalysisTests.datafiles import DCD, PSF

    from instride import Stream
    from instride.client import Client
    from instride.config import Settings
    from instride.parallel import export_h5md

    warnings.simplefilter("ignore")
    data.mkdir(parents=True, exist_ok=True)
    u = mda.Universe(PSF, DCD)
    coords = [ts.positions.copy() for ts in u.trajectory]
    times = [ts.time for ts in u.trajectory]
    dt = u.trajectory.dt
    repeats = math.ceil(frames / len(coords))
    total = repeats * len(coords)
    dcd = data / f"adk_x{repeats}.dcd"
    h5 = data / f"adk_x{repeats}.h5"
    managed = data / "managed"
    stream_name = f"adk_x{repeats}"
    built: dict[str, float] = {}
    from tqdm.auto import tqdm

    if not dcd.exists():
        t0 = time.perf_counter()
        tmp = dcd.with_suffix(".tmp.dcd")
        with mda.Writer(str(tmp), n_atoms=u.atoms.n_atoms, dt=dt) as w:
            for i in tqdm(range(total), desc="write dcd", unit="frame"):
                u.atoms.positions = coords[i % len(coords)]
                w.write(u.atoms)
        tmp.rename(dcd)
        built["dcd"] = time.perf_counter() - t0
    if not h5.exists():
        t0 = time.perf_counter()
        export_h5md(dcd, h5, topology=PSF, progress=True, batch=1024)
        built["h5md"] = time.perf_counter() - t0
    managed.mkdir(exist_ok=True)
    client = Client(Settings.from_env({"INSTRIDE_DIR": str(managed), "INSTRIDE_FSYNC": "0"}))
    if not (managed / stream_name / "end_of_stream.json").exists():
        t0 = time.perf_counter()
        with Stream(stream_name, mode="w", client=client, overwrite=True) as s:
            for i in tqdm(range(total), desc="write stream", unit="frame"):
                s.append(coords[i % len(coords)], step=i, time=times[0] + i * dt)
        built["stream"] = time.perf_counter() - t0
    client.close()
    return {"psf": PSF, "frames": total, "repeats": repeats, "managed": str(managed),
            "paths": {"stream": f"instride://{stream_name}", "dcd": str(dcd), "h5md": str(h5)},
            "build_seconds": built,
            "bytes": {"dcd": dcd.stat().st_size, "h5md": h5.stat().st_size,
                      "stream": sum(p.stat().st_size for p in (managed / stream_name).iterdir())}}


def worker(args: argparse.Namespace) -> None:
    """Inside mpiexec (or alone for multiprocessing): one analyze() run; rank 0 writes JSON."""
    from instride.parallel import analyze

    warnings.simplefilter("ignore")
    backend = args.backend
    kwargs: dict[str, Any] = {"backend": backend}
    if backend == "multiprocessing":
        kwargs["workers"] = args.n
    run = analyze("rmsd", args.traj, args.psf, **kwargs)
    if run is not None:
        out = Path(args.json)
        out.write_text(json.dumps({"timing": run.timing.to_dict(),
                                   "rmsd_head": run.data["rmsd"][:5].tolist(),
                                   "rmsd_sum": float(run.data["rmsd"].sum())}))
        run.timing.write(out.with_suffix(""), plot=True)


def mda_baseline(psf: str, dcd: str, n: int) -> dict[str, Any]:
    """MDAnalysis's own RMSD, serial (n=1) or its multiprocessing backend; wall time."""
    import MDAnalysis as mda
    from MDAnalysis.analysis.rms import RMSD

    from instride.parallel import ADK_CORE_CA

    warnings.simplefilter("ignore")
    t0 = time.perf_counter()
    u = mda.Universe(psf, dcd)
    r = RMSD(u, select=ADK_CORE_CA)
    if n == 1:
        r.run()
    else:
        r.run(backend="multiprocessing", n_workers=n)
    wall = time.perf_counter() - t0
    return {"wall": wall, "rmsd_sum": float(r.results.rmsd[:, 2].sum())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=50_000, help="at least this many frames")
    p.add_argument("--cores", type=int, nargs="+", default=[1, 2], help="rank counts N")
    p.add_argument("--backend", choices=("mpi", "multiprocessing"), default="mpi")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (median)")
    p.add_argument("--launcher", default=None,
                   help="MPI launch prefix with {n}, default: '<venv>/mpiexec -n {n}'")
    p.add_argument("--dir", default=None, help="data directory (default: a temp dir in /dev/shm, "
                   "removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the data directory")
    p.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "bench_parallel_rmsd"),
                   help="where per-run JSON/PNG go (default: /tmp/bench_parallel_rmsd)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--traj", help=argparse.SUPPRESS)
    p.add_argument("--psf", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--mda-baseline", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.mda_baseline:
        print(json.dumps(mda_baseline(args.psf, args.traj, args.n)))
        return 0

    machine = header("parallel RMSD strong scaling: instride stream vs DCD vs H5MD vs MDAnalysis")
    # Default: node-local tmpfs, where instride keeps frames (INSTRIDE_DIR defaults to
    # /dev/shm). On the VM's ext4 /tmp, reading files while the kernel writes back the 5.6 GB
    # just created made every input slower and noisier, the per-frame files most of all.
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    tmpdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench_parallel_", dir=shm))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        info = build(tmpdir, args.frames)
        print(f"data: {info['frames']} frames ({info['repeats']} x 98) in {tmpdir}; "
              f"sizes {', '.join(f'{k} {v / 2**30:.2f} GiB' for k, v in info['bytes'].items())}; "
              f"build s: {info['build_seconds']}")
        launcher = args.launcher or f"{Path(sys.executable).parent / 'mpiexec'} -n {{n}}"
        env = dict(os.environ, INSTRIDE_DIR=info["managed"])
        env.pop("INSTRIDE_REDIS_URL", None)
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            k: {n: [] for n in args.cores} for k in (*KINDS, "mdanalysis")}
        for rep_i, n in ((r, n) for r in range(args.repeats) for n in args.cores):
            print(f"\n# repeat {rep_i + 1}/{args.repeats}, N={n}, load {os.getloadavg()[0]:.2f}")
            for kind in KINDS:
                js = out / f"{kind}_n{n}_r{rep_i}.json"
                me = [sys.executable, __file__, "--worker", "--backend", args.backend,
                      "--traj", info["paths"][kind], "--psf", info["psf"], "--json", str(js),
                      "--n", str(n)]
                cmd = (shlex.split(launcher.format(n=n)) + me) if args.backend == "mpi" else me
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                launch_wall = time.perf_counter() - t0
                if proc.returncode != 0:
                    print(proc.stderr)
                    raise SystemExit(f"run failed: {' '.join(cmd)}")
                res = json.loads(js.read_text())
                res["launch_wall"] = launch_wall
                runs[kind][n].append(res)
                rep = res["timing"]
                print(f"\n## {kind}, N={n}: t_total={rep['t_total']:.3f} s, launch wall "
                      f"{launch_wall:.2f} s, R_comp/IO={rep['r_comp_io']:.3f}, "
                      f"stragglers {rep['stragglers']}")
                from instride.parallel import TimingReport

                print(TimingReport.from_dict(rep).format())
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--mda-baseline", "--psf",
                                   info["psf"], "--traj", info["paths"]["dcd"], "--n", str(n)],
                                  env=env, capture_output=True, text=True, check=True)
            mres = json.loads(proc.stdout.strip().splitlines()[-1])
            mres["launch_wall"] = time.perf_counter() - t0
            mres["t_total"] = mres["wall"]
            runs["mdanalysis"][n].append(mres)
            how = "run()" if n == 1 else f"run(backend='multiprocessing', n_workers={n})"
            print(f"\n## MDAnalysis RMSD.{how}: wall {mres['wall']:.3f} s")

        # ---------------------------------------------------------------- summary
        def median_run(rs: list[dict[str, Any]]) -> dict[str, Any]:
            key = (lambda r: r["timing"]["t_total"]) if "timing" in rs[0] else \
                (lambda r: r["wall"])
            return sorted(rs, key=key)[len(rs) // 2]

        results = {k: {n: median_run(v[n]) for n in args.cores} for k, v in runs.items()}
        print(f"\n## summary: median of {args.repeats} repeat(s), seconds; "
              "S(N) = t_total(1)/t_total(N); vs MDA = t_total / MDAnalysis wall at the same N; "
              f"load at end {os.getloadavg()[0]:.2f}")
        print(f"{'input':11} {'N':>2} {'t_total':>8} {'t_open':>7} {'t_IO':>7} {'t_comp':>7} "
              f"{'t_comm':>7} {'S(N)':>5} {'E(N)':>5} {'vs MDA':>6} {'R_c/IO':>6}")
        lo = min(args.cores)
        for kind in KINDS:
            for n in args.cores:
                rep = results[kind][n]["timing"]
                t1 = results[kind][lo]["timing"]["t_total"] if lo == 1 else None
                s = t1 / rep["t_total"] if t1 else float("nan")
                mda_wall = results["mdanalysis"][n]["wall"]
                m = rep["mean"]
                print(f"{kind:11} {n:>2} {rep['t_total']:8.3f} {m['t_open']:7.3f} "
                      f"{m['t_io']:7.3f} {m['t_comp']:7.3f} {m['t_comm']:7.4f} {s:5.2f} "
                      f"{s / n:5.2f} {rep['t_total'] / mda_wall:6.2f} {rep['r_comp_io']:6.3f}")
        for n in args.cores:
            w = results["mdanalysis"][n]["wall"]
            s = results["mdanalysis"][lo]["wall"] / w if lo == 1 else float("nan")
            print(f"{'MDAnalysis':11} {n:>2} {w:8.3f} {'':7} {'':7} {'':7} {'':7} {s:5.2f} "
                  f"{s / n:5.2f} {1.0:6.2f}")
        print("all t_total (s): " + "; ".join(
            f"{k} N={n}: " + ", ".join(
                f"{(r['timing']['t_total'] if 'timing' in r else r['wall']):.2f}" for r in v[n])
            for k, v in runs.items() for n in args.cores))
        sums = {k: results[k][n]["rmsd_sum"] for k in (*KINDS, "mdanalysis")
                for n in args.cores[:1]}
        print(f"checksum (sum of RMSD, N={args.cores[0]}): {sums}")
        (out / "summary.json").write_text(json.dumps(
            {"machine": machine, "data": info, "backend": args.backend, "runs": runs},
            indent=2, default=str))
        print(f"per-run JSON and PNG in {out}")
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
