"""A network partition between emulated nodes (network namespaces), during waits and transfers.

The link between node 2 and the cluster's bridge is taken down (``ip link set ... down`` on
the hub's side of its veth) and brought back up, while node 2 waits for a key (its Redis
subscription crosses the link) or fetches a 96 MiB file from node 1.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

from instride.emulate import EmulatedCluster
from instride.emulate import netns as nn

from .harness import HANG_MARGIN, CaseResult, digest, payload, timed

PY = sys.executable

_PRODUCE = textwrap.dedent("""
    import random, sys, instride
    key, seed, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with instride.open(key, "wb") as fh:
        fh.write(random.Random(seed).randbytes(size))
""")
_CONSUME = textwrap.dedent("""
    import sys, xxhash, instride
    try:
        path = instride.consume(sys.argv[1], timeout=float(sys.argv[2]))
    except instride.InstrideError as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
        sys.exit(1)
    with open(path, "rb") as fh:
        print("OK", xxhash.xxh3_64_hexdigest(fh.read()), flush=True)
""")


@contextlib.contextmanager
def cluster(nodes: int = 2) -> Iterator[EmulatedCluster]:
    """An emulated cluster with a name of this suite's own (``irl-`` prefix)."""
    with EmulatedCluster(nodes=nodes, name=f"irl-{secrets.token_hex(3)}",
                         env={"INSTRIDE_CONNECT_TIMEOUT": "2"}) as c:
        yield c


def throttle(c: EmulatedCluster, index: int, rate: str = "400mbit") -> None:
    """Limit what node ``index`` receives (a token bucket on the hub's end of its veth), so a
    large transfer lasts long enough to be cut in the middle."""
    subprocess.run(["tc", "-n", c.hub, "qdisc", "replace", "dev", f"n{index}", "root", "tbf",
                    "rate", rate, "burst", "256kb", "latency", "100ms"], check=True,
                   capture_output=True)


def link(c: EmulatedCluster, index: int, up: bool) -> None:
    """Take node ``index``'s link to the bridge down or up (the hub's end of its veth)."""
    nn.ip("-n", c.hub, "link", "set", f"n{index}", "up" if up else "down")


def _run(c: EmulatedCluster, node: int, code: str, *args: str) -> subprocess.Popen[str]:
    return c.popen(node, [PY, "-c", code, *args], stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], limit: float) -> tuple[str, str] | None:
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None
    return out.strip(), err


def _subscribers(c: EmulatedCluster) -> int:
    """Redis clients subscribed to something (``CLIENT LIST``'s ``sub``/``psub``), asked from
    node 1."""
    assert c.redis_url is not None
    out = subprocess.run(c.command(1, ["redis-cli", "-u", c.redis_url, "CLIENT", "LIST"]),
                         capture_output=True, text=True, check=True).stdout
    return sum(1 for line in out.splitlines()
               if " sub=0 " not in f" {line} " or " psub=0 " not in f" {line} ")


def _until_subscribed(c: EmulatedCluster, base: int, seconds: float = 30.0) -> None:
    """Return once more clients are subscribed than ``base`` (a consumer's wait began)."""
    deadline = time.monotonic() + seconds
    while _subscribers(c) <= base:
        if time.monotonic() > deadline:
            raise AssertionError(f"no new Redis subscriber within {seconds:.0f} s")
        time.sleep(0.02)


def _until_receiving(where: Path, prefix: str, consumer: subprocess.Popen,
                     seconds: float = 30.0) -> None:
    """Wait until the consumer's copy is being received: a hidden file of the key beside it
    (``prefix``: ``.NAME.``) that has bytes, or the consumer has ended."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and consumer.poll() is None:
        with contextlib.suppress(OSError):
            if any(e.name.startswith(prefix) and e.stat().st_size > 0
                   for e in os.scandir(where)):
                return
        time.sleep(0.01)


def case_partition(work: Path, trials: int, seed: int = 14, size: int = 96 << 20) -> CaseResult:
    """Even trials: node 2 waits for a key while its link is down and node 1 publishes it.
    Odd trials: the link goes down for 1-7 s in the middle of a 96 MiB transfer (node 2's
    link is rate-limited to 400 Mbit/s so that the transfer lasts about 2 s).

    Checks: the waiter gets the key once the link is back; a transfer completes and verifies
    after a short cut, or fails with a typed error leaving nothing under the key (a cut
    longer than the connect timeout), and the next consume succeeds.
    """
    res = CaseResult("network partition between nodes")
    rng = random.Random(seed)
    with timed(res), cluster() as c:
        throttle(c, 2)  # 96 MiB take about 2 s to reach node 2
        for t in range(trials):
            res.trials += 1
            key = f"part/t{t}.bin"
            wait_case = t % 2 == 0
            nbytes = 200_000 if wait_case else size
            want = digest(payload(seed * 1000 + t, nbytes))
            down_for = rng.uniform(1.0, 3.0) if wait_case else rng.choice([1.0, 3.0, 7.0])
            if wait_case:
                base = _subscribers(c)
                consumer = _run(c, 2, _CONSUME, key, "60")
                _until_subscribed(c, base)  # the consumer waits (its subscription crosses the link)
                link(c, 2, up=False)
                prod = _run(c, 1, _PRODUCE, key, str(seed * 1000 + t), str(nbytes))
                if _finish(prod, 60) is None:
                    res.hangs += 1
                time.sleep(down_for)
                link(c, 2, up=True)
            else:
                prod = _run(c, 1, _PRODUCE, key, str(seed * 1000 + t), str(nbytes))
                if _finish(prod, 60) is None:
                    res.hangs += 1
                consumer = _run(c, 2, _CONSUME, key, "60")
                # cut once bytes arrive (a fixed delay, 2-3 s, sometimes cut after the
                # consumer was done: counted as a transfer that rode the cut out)
                _until_receiving(c.node(2).dir / "part", f".t{t}.bin.", consumer)
                time.sleep(rng.uniform(0.0, 0.5))
                early = consumer.poll() is not None
                link(c, 2, up=False)
                time.sleep(down_for)
                link(c, 2, up=True)
            done = _finish(consumer, 60 + HANG_MARGIN)
            what = "wait" if wait_case else f"transfer, link down {down_for:.0f} s"
            if not wait_case and early:
                what = f"transfer done before the cut (link down {down_for:.0f} s)"
            if done is None:
                res.hangs += 1
                res.notes.append(f"trial {t} ({what}): consumer hung")
                continue
            out, err = done
            if out.startswith("OK "):
                if out.split()[1] == want:
                    res.saw(f"{what}: completed and verified after the link came back")
                else:
                    res.corrupted += 1
                continue
            if not out.startswith("ERROR "):
                res.corrupted += 1
                res.notes.append(f"trial {t}: untyped failure: {err[-500:]}")
                continue
            res.saw(f"{what}: {out.split()[1]}")
            if (c.node(2).dir / key).exists():
                res.corrupted += 1
                res.notes.append(f"trial {t}: a file was left under {key} after a failure")
            again = _finish(_run(c, 2, _CONSUME, key, "60"), 60 + HANG_MARGIN)
            if again is None:
                res.hangs += 1
            elif again[0].startswith("OK ") and again[0].split()[1] == want:
                res.saw("consumed and verified on retry")
            else:
                res.lost += 1
                res.notes.append(f"trial {t}: retry failed: {again}")
    return res
