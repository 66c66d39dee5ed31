"""PeerBackoff: failed authentications per peer address, and the back-off they earn."""

from __future__ import annotations

from blockfabric.target import backoff
from blockfabric.target.backoff import PeerBackoff

LIMIT, WINDOW, BACKOFF = 3, 60.0, 30.0


def fail(b: PeerBackoff, peer: str, now: float) -> bool:
    return b.failed(peer, now, LIMIT, WINDOW, BACKOFF)


def test_limit_failures_in_the_window_block_for_the_backoff() -> None:
    b = PeerBackoff()
    assert not fail(b, "10.0.0.1", 0) and not fail(b, "10.0.0.1", 1)
    assert b.blocked("10.0.0.1", 1) == 0
    assert fail(b, "10.0.0.1", 2)                   # the third within 60 s
    assert b.blocked("10.0.0.1", 2) == BACKOFF
    assert b.blocked("10.0.0.2", 2) == 0            # only that address
    assert b.blocked("10.0.0.1", 2 + BACKOFF - 1) == 1
    assert b.blocked("10.0.0.1", 2 + BACKOFF) == 0  # and then it is over
    assert not fail(b, "10.0.0.1", 40)              # counting starts afresh


def test_failures_spread_wider_than_the_window_never_block() -> None:
    b = PeerBackoff()
    for i in range(20):
        assert not fail(b, "10.0.0.1", i * (WINDOW / 2 + 1))
        assert b.blocked("10.0.0.1", i * (WINDOW / 2 + 1)) == 0


def test_memory_stays_bounded_under_many_addresses() -> None:
    b = PeerBackoff()
    for i in range(3 * backoff.MAX_PEERS):
        for _ in range(LIMIT):
            fail(b, f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 0.0)
    assert len(b._failures) <= backoff.MAX_PEERS and len(b._until) <= backoff.MAX_PEERS
