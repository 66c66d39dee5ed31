"""Failed authentications per peer address, and the back-off they earn.

Pure bookkeeping (the caller passes the time and the limits), so it is tested on its own.
Memory is bounded whatever peers do: at most ``limit`` times per address, and at most
:data:`MAX_PEERS` addresses (the stalest are forgotten first).
"""

from __future__ import annotations

from collections import deque

#: Addresses remembered at most; beyond that the least recently failed are dropped (a
#: peer that owns more addresses than this can guess anyway, at one try per address).
MAX_PEERS = 4096


class PeerBackoff:
    """Failures of each peer address in a sliding window; ``limit`` of them within
    ``window`` seconds block that address for ``backoff`` seconds."""

    def __init__(self) -> None:
        self._failures: dict[str, deque[float]] = {}
        self._until: dict[str, float] = {}

    def failed(self, peer: str, now: float, limit: int, window: float,
               backoff: float) -> bool:
        """Record one failure of ``peer`` at ``now``; True when it starts a back-off."""
        times = self._failures.pop(peer, None)
        if times is None or times.maxlen != limit:
            times = deque(times or (), maxlen=limit)
        times.append(now)
        self._failures[peer] = times        # (re)inserted last: the dict is in failure order
        started = False
        if len(times) == limit and now - times[0] <= window and self.blocked(peer, now) <= 0:
            self._until[peer] = now + backoff
            del self._failures[peer]            # counting starts afresh after the back-off
            started = True
        self._forget(now, window)
        return started

    def blocked(self, peer: str, now: float) -> float:
        """Seconds of back-off ``peer`` has left (0: none)."""
        until = self._until.get(peer)
        if until is None:
            return 0.0
        if until <= now:
            del self._until[peer]
            return 0.0
        return until - now

    def _forget(self, now: float, window: float) -> None:
        """Bound both tables (oldest first), and drop one expired entry of each per call:
        amortised, never a scan."""
        for table in (self._failures, self._until):
            while len(table) > MAX_PEERS:
                del table[next(iter(table))]
        stale = next(iter(self._failures), None)
        if stale is not None and now - self._failures[stale][-1] > window:
            del self._failures[stale]
        first = next(iter(self._until), None)
        if first is not None and self._until[first] <= now:
            del self._until[first]
