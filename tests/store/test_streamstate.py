"""A stream's state shared through Redis (instride.store.streamstate): a group's lease."""

from __future__ import annotations

from pathlib import Path

import redis

from instride.config import Settings
from instride.metadata.redis import RedisMetadata
from instride.store.streamstate import Policy, RedisStreamState
from tests.conftest import RedisServer
from tests.metadata.test_redis import _ReplyDropper


def test_a_group_lease_whose_answer_was_lost_is_the_readers_own(redis_server: RedisServer,
                                                                tmp_path: Path) -> None:
    """The answer to the ``SET NX`` that takes a group's lease is lost (the connection fails
    after Redis ran it) and the client sends it again: the lease found taken is the reader's
    own, not another reader's (``GroupBusy``, the group locked until the lease ran out)."""
    relay = _ReplyDropper((redis_server.host, redis_server.port), marker=b"$3\r\nSET\r\n")
    meta = RedisMetadata(Settings(dir=tmp_path, redis_url=f"redis://127.0.0.1:{relay.port}/0",
                                  connect_timeout=2))
    direct = redis.Redis(host=redis_server.host, port=redis_server.port)
    try:
        state = RedisStreamState(meta, "lease", lease_s=30)
        state.start(Policy(), ("g",), reset=True)
        relay.armed = True
        cursor = state.open_group("g", 0)
        assert relay.dropped == 1
        lease = direct.get("instride:stream:lease:group:g:lease")
        assert lease is not None and lease.decode() == cursor._token
        cursor.close()
        assert direct.get("instride:stream:lease:group:g:lease") is None
    finally:
        direct.close()
        meta.close()
        relay.close()
