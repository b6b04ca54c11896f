"""Cluster mode: a stream produced on one node, read on another by the MDAnalysis reader and by
the parallel analysis, both through ``instride.Stream`` only (frames fetched from the owner)."""

from __future__ import annotations

import json
import textwrap
import warnings

import MDAnalysis as mda
import numpy as np
from MDAnalysis.analysis.rms import RMSD
from MDAnalysisTests.datafiles import DCD, PSF

from instride import Stream
from instride.parallel import ADK_CORE_CA
from tests.conftest import LoopbackNode, finish, spawn_py

NFRAMES = 12

CONSUMER = textwrap.dedent(
    """
    import json, warnings
    warnings.simplefilter("ignore")
    import MDAnalysis as mda
    import instride.analytics
    from instride.parallel import analyze
    from MDAnalysisTests.datafiles import PSF
    u = mda.Universe(PSF, "instride://remote", timeout=30)
    reader = u.trajectory
    live = [len(reader), reader.ended]
    steps = [int(ts.data["step"]) for ts in reader]        # waits for each frame, then the end
    final = [len(reader), reader.ended]
    run = analyze("rmsd", "instride://remote", PSF, workers=2, timeout=30)
    print(json.dumps({"live": live, "final": final, "steps": steps,
                      "rmsd": run.data["rmsd"].tolist(),
                      "blocks": [r.n_frames for r in run.timing.ranks]}))
    """
)


def test_reader_and_parallel_read_a_remote_stream(loopback_nodes: list[LoopbackNode]) -> None:
    producer_node, consumer_node = loopback_nodes[0], loopback_nodes[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        u = mda.Universe(PSF, DCD)
    client = producer_node.client()
    try:
        stream = Stream("remote", mode="w", client=client)
        for ts in u.trajectory[:3]:
            stream.append(u.atoms.positions, step=ts.frame, time=ts.time)
        consumer = spawn_py(CONSUMER, env=consumer_node.env)
        for ts in u.trajectory[3:NFRAMES]:
            stream.append(u.atoms.positions, step=ts.frame, time=ts.time)
        stream.close()
    finally:
        client.close()
    rc, out, err = finish(consumer, timeout=120)
    assert rc == 0, err
    got = json.loads(out.splitlines()[-1])
    assert got["steps"] == list(range(NFRAMES))
    assert got["final"] == [NFRAMES, True]
    assert 3 <= got["live"][0] <= NFRAMES
    want = RMSD(u, select=ADK_CORE_CA).run(stop=NFRAMES).results.rmsd[:, 2]
    assert np.array_equal(np.array(got["rmsd"]), want)  # same float32 positions, same QCP
    assert got["blocks"] == [NFRAMES // 2] * 2
    # the frames crossed nodes: they are now stored on the consumer's node too
    assert (consumer_node.dir / "remote" / "frame_000000011.isf").exists()
