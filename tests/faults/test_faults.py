"""The fault suite, lean: a few trials of each case (``benchmarks/faults.py`` runs the full
counts and draws the figures). Every case must lose no frame, corrupt none and never hang.

Cases that mount a tmpfs or build network namespaces need root, as the emulated-node tests do.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from . import cluster_cases as C
from . import local_cases as L
from . import netns_cases as N
from .harness import CaseResult


def _check(res: CaseResult, *expected: str) -> None:
    print(res)
    assert res.trials > 0
    assert (res.lost, res.corrupted, res.hangs) == (0, 0, 0), res
    assert res.notes == [], res.notes
    for outcome in expected:
        assert any(outcome in seen for seen in res.outcomes), (outcome, res.outcomes)


def _root() -> None:
    if os.geteuid() != 0:
        pytest.fail("this fault case needs root (tmpfs mounts, network namespaces)")


def test_producer_sigkilled_mid_write(tmp_path: Path) -> None:
    _check(L.case_producer_sigkill(tmp_path, 8), "nothing partial published")


def test_enospc_on_a_small_tmpfs(tmp_path: Path) -> None:
    _root()
    _check(L.case_enospc(tmp_path, 2), "ENOSPC", "writes succeed again",
           "stream append (retain=None)", "stream append (retain=16)")


def test_thousand_waiters_on_one_key(tmp_path: Path) -> None:
    _check(L.case_many_waiters(tmp_path, 1, waiters=1000), "every waiter got the whole file")


def test_slow_stream_consumer(tmp_path: Path) -> None:
    _check(L.case_slow_consumer(tmp_path, 1, frames=150), "every frame")


def test_frame_headers_fuzzed(tmp_path: Path) -> None:
    _check(L.case_frame_fuzz(tmp_path, 20_000), "IntegrityError")


def test_paths_and_symlinks_local_interfaces(tmp_path: Path) -> None:
    _check(L.case_paths_local(tmp_path, 1), "UnsafePathError", "FileTypeError",
           "KeyValidationError", "patched open", "instride cat: exit 4")


def test_data_server_killed_mid_transfer(tmp_path: Path) -> None:
    _check(C.case_server_killed(tmp_path, 2), "consumed and verified once the server is back")


def test_redis_restarted_mid_run(tmp_path: Path) -> None:
    _check(C.case_redis_restart(tmp_path, 2), "waiter survived the restart",
           "persisted (AOF)")


def test_bit_flip_in_a_staged_frame(tmp_path: Path) -> None:
    _check(C.case_bitflip(tmp_path, 4), "IntegrityError (at rest)", "IntegrityError (in transit)",
           "IntegrityError (frame header at rest)", "IntegrityError (frame coordinates in transit)",
           "refetched and verified")


def test_wrong_missing_and_replayed_tokens(tmp_path: Path) -> None:
    _check(C.case_tokens(tmp_path, 1), "wrong token", "missing token", "replayed request")


def test_stalled_peer(tmp_path: Path) -> None:
    _check(C.case_stalled_peer(tmp_path, 1), "dropped by the server's send deadline",
           "other consumers served")


def test_wire_protocol_fuzzed(tmp_path: Path) -> None:
    _check(C.case_wire_fuzz(tmp_path, 2000), "WireError reply", "AuthenticationError reply",
           "served the published key exactly", "unix ERR reply")


def test_paths_and_symlinks_data_server(tmp_path: Path) -> None:
    _check(C.case_paths_cluster(tmp_path, 1), "UnsafePathError before any fetch")


def test_network_partition(tmp_path: Path) -> None:
    _root()
    _check(N.case_partition(tmp_path, 2, seed=3), "wait: completed and verified")


def test_republishing_the_same_original_keeps_it(tmp_path: Path) -> None:
    """Found by the wire fuzz: a thin client's PUBLISH of a key this node already published
    (the same bytes) removed the published original, and its consumers then waited forever.
    Since round 36 it is confirmed (the very file recorded: how an unsettled publication is
    settled), and the original stays."""
    with C.nodes(tmp_path, 2) as (n1, n2):
        c1 = n1.client()
        C._publish(c1, "same/k.bin", b"original")
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(str(n1.dir / ".instride" / "node.sock"))
            s.sendall(b"PUBLISH same/k.bin\n")
            reply = s.makefile("rb").readline()
        assert reply == f"OK {n1.dir / 'same' / 'k.bin'}\n".encode(), reply
        assert (n1.dir / "same" / "k.bin").read_bytes() == b"original"
        c2 = n2.client()
        assert c2.consume("same/k.bin", timeout=10).read_bytes() == b"original"
        c1.close()
        c2.close()
