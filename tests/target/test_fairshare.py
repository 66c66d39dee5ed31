"""Fair shares of the target's pools (target/fairshare.py) and a queue's share of a reactor
pass (Endpoint.pass_limit), without sockets: who gets a unit, when, and in which order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from blockfabric.fabric.endpoint import Endpoint
from blockfabric.fabric.reactor import Reactor
from blockfabric.target import fairshare
from blockfabric.target.fairshare import BouncePool, FairShare


class Units(FairShare):
    """Grants recorded in order; units come back through ``give_back``."""

    def __init__(self, size: int, floor: int = 1) -> None:
        super().__init__(size, floor)
        self.granted: list[tuple[str, object]] = []
        self.owner: dict[object, object] = {}

    def _grant(self, h, item) -> None:
        self.granted.append((h.key, item[0]))
        self.owner[item[0]] = h

    def give_back(self, name: object) -> None:
        self.done(self.owner.pop(name))


def held(units: FairShare) -> dict[str, int]:
    return {k: h.held for k, h in units.hosts.items() if h.held}


def test_a_lone_host_gets_the_whole_pool():
    units = Units(8)
    for i in range(10):
        units.request("a", (i,))
    assert held(units) == {"a": 8} and units.waiting == 2


def test_waiting_hosts_are_served_round_robin_each_under_its_share():
    units = Units(8)
    for i in range(8):
        units.request("a", (f"a{i}",))
    for i in range(4):
        units.request("a", (f"a{8 + i}",))     # a waits for more, first in line
    for i in range(4):
        units.request("b", (f"b{i}",))
    assert held(units) == {"a": 8}
    units.granted.clear()
    for i in range(8):
        units.give_back(f"a{i}")
    # b, under its share (8 // 2), is served before a's older requests: a, over its share,
    # waits until it is back under it
    assert held(units) == {"a": 4, "b": 4}, units.granted
    assert [n for _, n in units.granted] == ["b0", "b1", "b2", "b3", "a8", "a9", "a10",
                                              "a11"]


def x_gives_back_while_a_and_b_wait(lend: bool) -> Units:
    """x took all 4 units, a and b ask for 3 each, x gives its 4 back."""
    units = Units(4)
    units.LEND = lend
    for i in range(4):
        units.request("x", (f"x{i}",))
    for i in range(3):
        units.request("a", (f"a{i}",))
        units.request("b", (f"b{i}",))
    for i in range(4):
        units.give_back(f"x{i}")
    return units


def test_hosts_under_their_share_take_turns():
    units = x_gives_back_while_a_and_b_wait(lend=False)
    # x is still active (it asked within ACTIVE_WINDOW): its share stays free for it
    assert [k for k, _ in units.granted[4:]] == ["a", "b"], units.granted
    assert units.used == 2


def test_lent_units_go_round_robin_to_hosts_over_their_share():
    units = x_gives_back_while_a_and_b_wait(lend=True)
    assert [k for k, _ in units.granted[4:]] == ["a", "b", "a", "b"], units.granted
    units.request("c", ("c0",))             # a newcomer waits for the next unit back...
    units.give_back("a0")
    assert units.granted[-1] == ("c", "c0")  # ...and gets it before a and b get more


def test_an_active_host_keeps_its_share_free_against_a_hoarder():
    units = Units(8)
    units.request("b", ("b0",))
    units.give_back("b0")                   # b is between two commands: still active
    for i in range(8):
        units.request("a", (f"a{i}",))
    assert held(units) == {"a": 4}          # the other half stays for b
    units.request("b", ("b1",))
    assert held(units) == {"a": 4, "b": 1}


def test_a_host_idle_past_the_window_no_longer_counts(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(fairshare, "monotonic", lambda: now[0])
    units = Units(8)
    units.request("b", ("b0",))
    units.give_back("b0")
    now[0] += fairshare.ACTIVE_WINDOW + 0.1
    for i in range(8):
        units.request("a", (f"a{i}",))
    assert held(units) == {"a": 8}
    assert set(units.hosts) == {"a"}        # b's entry is gone


def test_the_share_never_drops_below_the_floor():
    units = Units(64, floor=4)
    for h in range(20):
        units.request(f"h{h}", (f"h{h}-0",))
    for i in range(1, 10):
        units.request("h0", (f"h0-{i}",))
    assert held(units)["h0"] == 4           # 64 // 20 = 3, the floor is 4


class FakeBuffers:
    """What BouncePool uses of a BufferPool."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.views = [memoryview(bytearray(16)) for _ in range(count)]
        self.addrs = [0x1000 * (i + 1) for i in range(count)]
        self.lkey = 7
        self._free = list(range(count - 1, -1, -1))

    def get(self) -> int:
        return self._free.pop()

    def put(self, index: int) -> None:
        self._free.append(index)

    def close(self) -> None:
        pass


def fake_cmd() -> SimpleNamespace:
    return SimpleNamespace(queue=SimpleNamespace(closed=False), on_fetched=None,
                           responded=False)


def test_bounce_leases_count_only_the_wait_on_the_host(monkeypatch):
    now = [10.0]
    monkeypatch.setattr(fairshare, "monotonic", lambda: now[0])
    pool = BouncePool(FakeBuffers(4), 1, abort=lambda cmd: None)
    leases = []
    reading, fetching = fake_cmd(), fake_cmd()
    pool.request("a", (reading, 16, lambda view, sge, lease: leases.append(lease)))
    pool.request("a", (fetching, 16, lambda view, sge, lease: leases.append(lease)))
    fetching.on_fetched = object()          # its RDMA READ is posted
    now[0] += 5
    # the read is in the backend: not the host's fault
    assert pool.overdue(now[0], 3) == [leases[1]]
    leases[0].on_wire()                     # backend done, answer posted
    reading.responded = True
    now[0] += 2
    assert pool.overdue(now[0], 3) == [leases[1]]
    now[0] += 2
    assert pool.overdue(now[0], 3) == leases
    leases[0].release(reading)
    leases[0].release(reading)              # a second release changes nothing
    assert pool.used == 1 and pool.buffers._free == [3, 2, 0]


def test_bounce_waiters_of_a_closed_queue_are_dropped_and_aborted():
    aborted = []
    pool = BouncePool(FakeBuffers(1), 1, abort=aborted.append)
    leases = []
    first, gone = fake_cmd(), fake_cmd()
    pool.request("a", (first, 16, lambda v, s, lease: leases.append(lease)))
    pool.request("b", (gone, 16, lambda v, s, lease: leases.append(lease)))
    gone.queue.closed = True
    pool.drop_unwanted()
    assert aborted == [gone] and pool.waiting == 0
    leases[0].release(first)
    assert pool.used == 0 and len(leases) == 1


class FakeCQ:
    def __init__(self, count: int) -> None:
        self.wcs = list(range(count))
        self.armed = 0

    def ack_events(self) -> None:
        pass

    def poll(self, n: int) -> list[int]:
        out, self.wcs = self.wcs[:n], self.wcs[n:]
        return out

    def req_notify(self) -> None:
        self.armed += 1


@pytest.mark.parametrize("limit, passes", [(0, 1), (64, 4)])
def test_a_queue_takes_its_share_of_a_pass_then_comes_back(limit, passes):
    reactor = Reactor("test")
    try:
        ep = object.__new__(Endpoint)
        ep.closed, ep.cq, ep.reactor, ep._again = False, FakeCQ(200), reactor, False
        ep.pass_limit = limit
        seen: list[int] = []
        ep.on_completion = seen.append
        ep.service()
        counts = [len(seen)]
        while len(counts) < 10 and len(seen) < 200:
            reactor.run_once(0)
            counts.append(len(seen))
        assert seen == list(range(200))
        assert len(counts) == passes, counts
        if limit:
            assert all(b - a <= limit for a, b in zip([0, *counts], counts)), counts
        assert ep.cq.armed >= 1                 # re-armed once it was empty
    finally:
        reactor.close()


def test_the_kept_share_is_always_the_counted_one(monkeypatch):
    """share() keeps its count between the events that may change it; at every step it is
    what counting the active hosts afresh gives."""
    import random

    now = [100.0]
    monkeypatch.setattr(fairshare, "monotonic", lambda: now[0])
    rng = random.Random(5)
    units = Units(16, floor=2)
    names = iter(range(10**6))

    def counted() -> int:
        active = sum(1 for h in units.hosts.values() if h.held or h.waiting
                     or now[0] - h.last < fairshare.ACTIVE_WINDOW)
        return units.size if len(units.hosts) == 1 else \
            max(units.floor, units.size // max(active, 1))

    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            units.request(f"h{rng.randrange(6)}", (next(names),))
        elif op < 0.85 and units.owner:
            units.give_back(rng.choice(list(units.owner)))
        else:
            now[0] += rng.choice((0.01, 0.3, 0.7, fairshare.ACTIVE_WINDOW + 0.05))
        assert units.share(now[0]) == counted()
