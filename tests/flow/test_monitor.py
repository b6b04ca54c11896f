"""The counters `instride top` shows: queue depth joins producer and consumer counters."""

from __future__ import annotations

from instride.flow.monitor import render, rows


def _stats(module, inputs, outputs, wait=0.0, updated=10.0):
    return {"module": module, "instance": 0, "node": "n1", "pid": 1, "started": 0.0,
            "updated": updated, "seconds": {"wait": wait}, "inputs": inputs,
            "outputs": outputs}


def test_queue_rate_idle() -> None:
    producer = _stats("sim", {}, {"frames": {"stream": "s/sim.0/frames", "msgs": 50,
                                             "bytes": 2**20}})
    consumer = _stats("ana", {"frames": {"stream": "s/sim.0/frames", "msgs": 20, "bytes": 0,
                                         "cursor": 20}}, {}, wait=2.5)
    table = rows({"stats": [producer, consumer]})
    (ana,) = [r for r in table if r["instance"] == "ana[0]"]
    assert ana["queue"] == "30"  # published 50, taken 20
    assert ana["idle%"] == "25"  # 2.5 s of 10 s in wait()
    assert ana["rate/s"] == "2.0"
    (sim,) = [r for r in table if r["instance"] == "sim[0]"]
    assert sim["MiB"] == "1.00" and sim["queue"] == ""
    later = _stats("ana", {"frames": {"stream": "s/sim.0/frames", "msgs": 40, "bytes": 0,
                                      "cursor": 40}}, {}, updated=12.0)
    (again,) = [r for r in rows({"stats": [producer, later]}, {"stats": [consumer]})
                if r["instance"] == "ana[0]"]
    assert again["rate/s"] == "10.0"  # 20 messages in the 2 s between the snapshots
    text = render(table, title="t")
    assert text.splitlines()[1].split()[:3] == ["instance", "node", "port"]
