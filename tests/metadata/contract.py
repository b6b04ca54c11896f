"""The metadata contract every backend passes (run by test_files.py and test_redis.py).

A backend's test module subclasses :class:`MetadataContract` and provides a ``backend``
fixture returning a fresh backend and a ``put`` fixture that publishes a key the way that
backend expects (a file under its final name, then ``publish``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from instride.errors import ConsumeTimeout
from instride.metadata.base import MetadataBackend, Record

Put = Callable[[str, bytes], Record]


class MetadataContract:
    def test_lookup_missing_is_none(self, backend: MetadataBackend) -> None:
        assert backend.lookup("nope/never") is None

    def test_publish_then_lookup(self, backend: MetadataBackend, put: Put) -> None:
        put("c/one", b"12345")
        rec = backend.lookup("c/one")
        assert rec is not None
        assert rec.key == "c/one" and rec.size == 5 and rec.version >= 1
        assert rec.time > 0

    def test_wait_returns_immediately_when_published(self, backend: MetadataBackend, put: Put) -> None:
        put("c/ready", b"x")
        start = time.monotonic()
        assert backend.wait_any(["c/ready"], timeout=5).key == "c/ready"
        assert time.monotonic() - start < 2

    def test_wait_wakes_on_publication(self, backend: MetadataBackend, put: Put) -> None:
        result: list[Record] = []
        t = threading.Thread(target=lambda: result.append(backend.wait_any(["c/later"], 10)))
        t.start()
        time.sleep(0.2)
        assert result == []
        put("c/later", b"late")
        t.join(10)
        assert result and result[0].key == "c/later"

    def test_wait_any_of_several(self, backend: MetadataBackend, put: Put) -> None:
        result: list[Record] = []
        t = threading.Thread(target=lambda: result.append(backend.wait_any(["c/a", "c/b"], 10)))
        t.start()
        time.sleep(0.1)
        put("c/b", b"b")
        t.join(10)
        assert result[0].key == "c/b"

    def test_wait_timeout(self, backend: MetadataBackend) -> None:
        with pytest.raises(ConsumeTimeout) as info:
            backend.wait_any(["c/absent"], timeout=0.2)
        assert info.value.key == "c/absent"

    def test_list_by_prefix_and_delete(self, backend: MetadataBackend, put: Put) -> None:
        for k in ("p/a/1", "p/a/2", "p/b/1", "q/1"):
            put(k, b"v")
        assert backend.list("p/a/") == ["p/a/1", "p/a/2"]
        assert backend.list("p/") == ["p/a/1", "p/a/2", "p/b/1"]
        backend.delete("p/a/1")
        assert backend.lookup("p/a/1") is None
        assert backend.list("p/a/") == ["p/a/2"]
        backend.delete("p/never")  # no error

    def test_no_lost_wakeup_when_publishing_right_away(self, backend: MetadataBackend, put: Put) -> None:
        # A waiter with no timeout must never miss a publication that lands while it is
        # arming its wait (for Redis: before its SUBSCRIBE is in force). Many tight rounds.
        for i in range(300):
            result: list[Record] = []
            t = threading.Thread(
                target=lambda k=f"race/{i}", out=result: out.append(backend.wait_any([k], None)),
                daemon=True,
            )
            t.start()
            put(f"race/{i}", b"x")
            t.join(5)
            assert result, f"round {i}: the waiter missed the publication"
