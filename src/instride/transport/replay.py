"""Refusing replayed requests: every nonce is accepted once within the timestamp window.

A signed request carries a random nonce and a timestamp; :func:`~instride.transport.wire.verify`
accepts timestamps within :data:`~instride.transport.wire.MAX_SKEW` of the server's clock. A
:class:`ReplayGuard` remembers the nonces it has accepted for as long as their timestamps are
inside that window, so a request captured on the network and sent again is refused.

Memory is bounded: at most ``capacity`` nonces are kept. When the bound is reached the oldest
are forgotten and the guard raises its *floor* to their timestamp; a request not newer than the
floor is refused as too old. So nothing replayable is ever forgotten: under extreme request
rates the accepted window only shrinks (to about ``capacity`` / rate seconds).

>>> g = ReplayGuard(capacity=2)
>>> g.check("n1", 100.0, now=100.0) is None
True
>>> g.check("n1", 100.0, now=100.0)
'replayed request (nonce already used)'
"""

from __future__ import annotations

import heapq

from .wire import MAX_SKEW


class ReplayGuard:
    """Accept each nonce once while its timestamp is within the window.

    Parameters
    ----------
    capacity
        Most nonces remembered at once.
    window
        Seconds a timestamp stays acceptable (the server's clock skew allowance).
    """

    def __init__(self, capacity: int = 1_000_000, window: float = MAX_SKEW) -> None:
        self.capacity = capacity
        self.window = window
        self.floor = float("-inf")
        self._seen: set[str] = set()
        self._order: list[tuple[float, str]] = []  # heap of (timestamp, nonce)

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, nonce: str, ts: float, *, now: float) -> str | None:
        """Remember ``nonce``; return ``None`` if it is fresh, else why it is refused.

        Call it only for requests whose MAC and timestamp window were verified.
        """
        order = self._order
        while order and order[0][0] < now - self.window:  # outside the window: cannot replay
            old_ts, old = heapq.heappop(order)
            self._seen.discard(old)
            # (and anything not newer is refused from now on: a request whose window check
            # read the clock an instant before this one would otherwise pass with a nonce
            # just forgotten — its replay served again)
            self.floor = max(self.floor, old_ts)
        if ts <= self.floor:
            return "request too old for the replay window (resend it)"
        if nonce in self._seen:
            return "replayed request (nonce already used)"
        self._seen.add(nonce)
        heapq.heappush(order, (ts, nonce))
        while len(order) > self.capacity:
            old_ts, old = heapq.heappop(order)
            self._seen.discard(old)
            self.floor = max(self.floor, old_ts)
        return None
