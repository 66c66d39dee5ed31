"""The per-queue-group poll loop: readers, timers, cross-thread calls, fault isolation."""

from __future__ import annotations

import os
import threading
import time

import pytest

from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.reactor import _oversubscribed as _real_oversubscribed


def test_reader_timer_and_threadsafe_call_run_on_the_loop_thread():
    reactor = Reactor("t")
    r, w = os.pipe()
    seen: list[tuple[str, str]] = []
    done = threading.Event()

    def on_read():
        os.read(r, 10)
        seen.append(("read", threading.current_thread().name))

    def on_timer():
        seen.append(("timer", threading.current_thread().name))
        done.set()

    reactor.add_reader(r, on_read)
    reactor.start()
    try:
        reactor.call_soon_threadsafe(lambda: reactor.call_later(0.05, on_timer))
        os.write(w, b"x")
        assert done.wait(5)
    finally:
        reactor.stop()
        reactor.join(5)
        reactor.close()
        os.close(r)
        os.close(w)
    assert ("read", "t") in seen and ("timer", "t") in seen
    assert seen.index(("read", "t")) < seen.index(("timer", "t"))


def test_cancelled_timer_never_runs_and_timers_run_in_order():
    reactor = Reactor()
    order: list[int] = []
    reactor.call_later(0.03, lambda: order.append(3))
    cancelled = reactor.call_later(0.01, lambda: order.append(99))
    reactor.call_later(0.0, lambda: order.append(1))
    reactor.call_later(0.02, lambda: order.append(2))
    cancelled.cancel()
    deadline = time.monotonic() + 2
    while len(order) < 3 and time.monotonic() < deadline:
        reactor.run_once(0.1)
    reactor.close()
    assert order == [1, 2, 3]


def test_a_failing_callback_does_not_stop_the_loop(caplog):
    reactor = Reactor("faulty")
    ran: list[str] = []
    reactor.call_later(0, lambda: 1 / 0)
    reactor.call_later(0, lambda: ran.append("after"))
    reactor.run_once(0.1)
    reactor.close()
    assert ran == ["after"]
    assert "unhandled error" in caplog.text


def test_a_callback_unregistered_earlier_in_the_same_batch_does_not_run():
    reactor = Reactor()
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    ran: list[str] = []

    def first() -> None:
        ran.append("first")
        reactor.remove_reader(r2)       # e.g. a CM event closing a queue whose CQ is ready
        reactor.remove_reader(r1)

    def second() -> None:
        ran.append("second")
        reactor.remove_reader(r2)
        reactor.remove_reader(r1)

    reactor.add_reader(r1, first)
    reactor.add_reader(r2, second)
    os.write(w1, b"x")
    os.write(w2, b"x")
    reactor.run_once(1)
    reactor.close()
    for fd in (r1, w1, r2, w2):
        os.close(fd)
    assert len(ran) == 1


def test_several_callbacks_may_share_one_fd():
    """A provider may serve many CQs through one fd (soft in poll mode: its epoll fd)."""
    reactor = Reactor()
    r, w = os.pipe()
    ran: list[str] = []

    def a() -> None:
        ran.append("a")

    def b() -> None:
        ran.append("b")
        os.read(r, 1)

    reactor.add_reader(r, a)
    reactor.add_reader(r, b)
    os.write(w, b"x")
    reactor.run_once(1)
    reactor.remove_reader(r, a)
    os.write(w, b"x")
    reactor.run_once(1)
    reactor.remove_reader(r, b)
    os.write(w, b"x")
    reactor.run_once(0.05)
    reactor.close()
    os.close(r)
    os.close(w)
    assert ran == ["a", "b", "b"]


def test_a_cq_removed_and_closed_leaves_nothing_behind_for_the_next_one():
    """Thread progress: the reactor waits on each CQ's own fd; one removed and closed must
    leave no stale registration that would swallow the next CQ's (same-numbered) fd."""
    from blockfabric.rdma import WC, WcOpcode, WcStatus
    from blockfabric.rdma.soft import SoftProvider

    provider = SoftProvider(progress="thread")
    ctx = provider.context
    reactor = Reactor()
    ran: list[str] = []
    try:
        first = ctx.create_cq()
        reactor.add_cq(first, lambda: ran.append("first"))
        reactor.remove_cq(first, lambda: None)      # an unknown callback: nothing happens
        reactor.remove_cq(first, reactor._readers[first.fileno()][0])
        first.close()
        second = ctx.create_cq()

        def serve() -> None:
            second.ack_events()
            ran.append("second")
            second.poll()
        reactor.add_cq(second, serve)
        second.req_notify()
        second.push(WC(1, WcStatus.SUCCESS, WcOpcode.RECV))
        reactor.run_once(2)
        assert ran == ["second"]
        reactor.remove_cq(second, serve)
        second.close()
    finally:
        reactor.close()
        provider.close()


def test_poll_mode_cqs_are_served_through_one_registration():
    """Poll progress: CQs of one device attached to a reactor share one registration (the
    device does the loop's waiting: its epoll holds the loop's, one epoll_wait per wake-up);
    a completion wakes only its own CQ's owner."""
    from blockfabric.rdma import WC, WcOpcode, WcStatus
    from blockfabric.rdma.soft import SoftProvider

    provider = SoftProvider(progress="poll")
    ctx = provider.context
    reactor = Reactor()
    ran: list[str] = []
    try:
        cqs = [ctx.create_cq() for _ in range(3)]
        owners = [lambda i=i: (ran.append(i), cqs[i].poll()) for i in range(3)]
        for cq, owner in zip(cqs, owners):
            reactor.add_cq(cq, owner)
        assert len(reactor._readers) == 2       # the wake pipe, the device's eventfd
        assert reactor._waiter is not None      # ... and the device waits for the loop
        cqs[1].push(WC(7, WcStatus.SUCCESS, WcOpcode.RECV))   # as from another thread
        reactor.run_once(2)
        assert ran == [1]
        # the loop's own fds wait in the device's epoll (one epoll_wait per wake-up): one
        # ready alone runs its reader and no CQ owner
        r, w = os.pipe2(os.O_NONBLOCK)
        reactor.add_reader(r, lambda: ran.append(os.read(r, 9)))
        assert r in reactor._moved
        os.write(w, b"fuse")
        reactor.run_once(2)
        assert ran == [1, b"fuse"]
        reactor.remove_reader(r)
        assert r not in reactor._moved
        os.close(r)
        os.close(w)
        for cq, owner in zip(cqs, owners):
            reactor.remove_cq(cq, owner)
            cq.close()
        reactor.run_once(0)                     # the group's last CQ went: unregistered
        assert len(reactor._readers) == 1 and reactor._waiter is None
    finally:
        reactor.close()
        provider.close()


def test_a_device_served_by_two_reactors_nests_in_both():
    """The first reactor that serves a poll-mode device lets it wait (one epoll_wait per
    wake-up); once a second reactor serves it too, neither waits in the device's epoll (one
    loop's ready fds would wake the other, which cannot clear them): both nest it, and a
    completion still reaches each owner."""
    from blockfabric.rdma import WC, WcOpcode, WcStatus
    from blockfabric.rdma.soft import SoftProvider

    provider = SoftProvider(progress="poll")
    ctx = provider.context
    first, second = Reactor("first"), Reactor("second")
    ran: list[str] = []
    try:
        cq1, cq2 = ctx.create_cq(), ctx.create_cq()
        first.add_cq(cq1, lambda: (ran.append("one"), cq1.poll()))
        assert first._waiter is not None
        second.add_cq(cq2, lambda: (ran.append("two"), cq2.poll()))
        assert second._waiter is None
        r, w = os.pipe2(os.O_NONBLOCK)
        first.add_reader(r, lambda: ran.append(os.read(r, 9)))
        assert r in first._moved
        first.run_once(0)                   # the nest call queued for the first loop
        assert first._waiter is None and len(first._readers) == 4
        assert not first._moved             # its fds back in its own epoll, still served
        os.write(w, b"fuse")
        first.run_once(2)
        assert ran == [b"fuse"]
        ran.clear()
        first.remove_reader(r)
        os.close(r)
        os.close(w)
        cq1.push(WC(1, WcStatus.SUCCESS, WcOpcode.RECV))
        cq2.push(WC(2, WcStatus.SUCCESS, WcOpcode.RECV))
        first.run_once(2)
        second.run_once(2)
        assert sorted(ran) == ["one", "two"]
    finally:
        first.close()
        second.close()
        provider.close()


@pytest.fixture(autouse=True)
def _machine_not_crowded(monkeypatch):
    """The spin tests below must not depend on this machine's load average (the reactor does
    not spin on an oversubscribed machine: test_no_spin_on_a_crowded_machine; nor under CPU
    pressure: test_reactor_spin_guards.py)."""
    from blockfabric.fabric import reactor as mod
    monkeypatch.setattr(mod, "_oversubscribed", lambda: False)
    monkeypatch.setattr(mod, "cpu_pressure", lambda path=None: None)


def test_no_spin_on_a_crowded_machine(monkeypatch):
    """A load average above SPIN_LOAD_FACTOR x the usable CPUs: the loop sleeps at once,
    leaving the CPU to its peer and the application; the check is redone each second."""
    from blockfabric.fabric import reactor as mod
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(mod, "_oversubscribed", _real_oversubscribed)
    monkeypatch.setattr(mod.os, "getloadavg", lambda: (mod.SPIN_LOAD_FACTOR * cpus + 1, 0, 0))
    reactor = _spinning_reactor(10_000.0)
    polled = [0]
    reactor.add_poller(lambda: polled.__setitem__(0, polled[0] + 1) or False)
    try:
        reactor.run_once(0.001)
        assert polled[0] == 0 and reactor.spin_misses == 0
        monkeypatch.setattr(mod.os, "getloadavg", lambda: (0.1, 0, 0))
        reactor._load_at = 0.0              # (a second later)
        reactor.run_once(0.001)
        assert polled[0] > 0
    finally:
        reactor.close()


def _spinning_reactor(spin_us: float) -> Reactor:
    return Reactor("spin", spin_us=spin_us)


class _Clock:
    """A monotonic clock for the reactor's spin decisions, so they do not depend on how
    loaded the machine is: each reading advances ``step`` s; ``jump`` adds time."""

    def __init__(self, step: float = 1e-5) -> None:
        self.t, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.t += self.step
        return self.t


def _fake_time(monkeypatch, reactor: Reactor, wait_takes: list[float]) -> _Clock:
    """Patch the reactor module's clock; each wait after a spin that ran out "takes" the
    next of ``wait_takes`` seconds of that clock."""
    from blockfabric.fabric import reactor as mod
    clock = _Clock()
    fake = type("T", (), {"monotonic": staticmethod(clock.monotonic)})
    monkeypatch.setattr(mod, "time", fake)
    real = reactor._wait_and_serve

    def wait_and_serve(timeout):
        real(0.0)
        if reactor._spun_out and wait_takes:
            clock.t += wait_takes.pop(0)
    monkeypatch.setattr(reactor, "_wait_and_serve", wait_and_serve)
    return clock


def test_spin_stops_after_far_misses_and_only_probes(monkeypatch):
    """A peer that answers far later than the spin (4x spin_us and more after the spin
    began): two such far misses stop the spinning, and then only one wait in
    SPIN_PROBE_EVERY spins, so an idle outstanding request (a keep-alive) or a slow
    backend costs no CPU."""
    from blockfabric.fabric import reactor as mod
    reactor = _spinning_reactor(100.0)
    calls = [0]

    def never() -> bool:
        calls[0] += 1
        return False            # work outstanding, nothing arrived yet

    reactor.add_poller(never)
    _fake_time(monkeypatch, reactor, [0.01] * 10)
    try:
        reactor.run_once(0.5)
        assert reactor._spinning and reactor.spin_misses == 1
        reactor.run_once(0.5)
        assert not reactor._spinning and reactor.spin_misses == 2
        before = calls[0]
        for _ in range(mod.SPIN_PROBE_EVERY - 1):
            reactor.run_once(0.5)
        assert calls[0] == before, "a loop that stopped spinning must not poll"
        reactor.run_once(0.5)             # the probe
        assert calls[0] > before and reactor.spin_misses == 3
    finally:
        reactor.close()


def test_near_miss_keeps_spinning_and_a_hit_restores_it(monkeypatch):
    """A spin that ran out but whose wait ended soon after (the peer was asleep: once it
    spins too, answers come in time) keeps the loop spinning; a hit after probing restores
    the full spin."""
    reactor = _spinning_reactor(100.0)
    state = {"n": 0, "answer_after": 10**9}

    def poller() -> bool:
        state["n"] += 1
        return state["n"] >= state["answer_after"]

    reactor.add_poller(poller)
    _fake_time(monkeypatch, reactor, [0.0001] * 3 + [0.01] * 2)
    try:
        for _ in range(3):
            reactor.run_once(0.5)         # ran out; answered 0.2 ms after it began: near
        assert reactor._spinning and reactor.spin_misses == 3
        reactor.run_once(0.5)
        reactor.run_once(0.5)             # two far misses
        assert not reactor._spinning
        reactor._spin_skips = 10**6       # the next wait probes
        state["n"], state["answer_after"] = 0, 3    # the answer now comes while spinning
        reactor.run_once(0.5)
        assert reactor.spin_hits == 1 and reactor._spinning
    finally:
        reactor.close()


def test_no_spin_without_outstanding_work_or_with_spin_zero():
    polled = []
    for spin, answer in ((400.0, None), (0.0, False)):
        reactor = _spinning_reactor(spin)
        reactor.add_poller(lambda a=answer: polled.append(spin) or a)
        try:
            reactor.run_once(0.0005)
        finally:
            reactor.close()
    assert polled == [400.0]        # asked once (nothing outstanding); never with spin 0
    assert reactor.spin_hits == reactor.spin_misses == 0


def test_a_spin_ends_as_soon_as_anything_else_of_the_loop_is_ready():
    """The spin waits for the loop's next event, not only for its pollers' answers: while
    a poller still waits (an NVMe/TCP answer due), a descriptor of the loop that turns
    readable (a FUSE request, a call from another thread) ends the spin as a hit and is
    served by the same pass."""
    reactor = _spinning_reactor(10_000.0)
    reactor.spin_load = 100.0               # (the pressure guard has its own tests)
    ran: list[bytes] = []
    r, w = os.pipe2(os.O_NONBLOCK)
    try:
        reactor.add_reader(r, lambda: ran.append(os.read(r, 9)))
        polled = [0]
        reactor.add_poller(lambda: polled.__setitem__(0, polled[0] + 1) or False)
        os.write(w, b"request")
        reactor.run_once(5)
        assert ran == [b"request"]
        assert (reactor.spin_hits, reactor.spin_misses) == (1, 0)
        assert polled[0] == 1               # one turn of the spin, not 10 ms of them
        reactor.remove_reader(r)
    finally:
        reactor.close()
        os.close(r)
        os.close(w)


def test_a_following_poller_never_makes_a_loop_spin_on_its_own():
    """The FUSE session's poller ``follows``: alone (a loop whose answers come from another
    thread, which a spin would keep from the GIL) it makes no spin; beside a transport's
    poller it keeps that loop's spin going.  (A 10 ms spin, the longest: on a loaded machine
    one turn, its sched_yield, took more than 2 ms, and the follower was asked only once.)"""
    reactor = _spinning_reactor(10_000.0)
    reactor.spin_load = 100.0
    asked = [0]

    def expecting() -> bool:
        asked[0] += 1
        return False
    reactor.add_poller(expecting, follows=True)
    try:
        reactor.run_once(0.001)
        assert asked[0] == 0 and reactor.spin_misses == 0
        transport = []                      # nothing due on the transport's side
        reactor.add_poller(lambda: transport.append(1) and None)
        reactor.run_once(0.001)
        assert asked[0] > 1 and reactor.spin_misses == 1      # the follower kept it up
        reactor.remove_poller(expecting)
        assert not reactor._followers
    finally:
        reactor.close()


def test_a_spin_gives_way_at_every_turn(monkeypatch):
    """Each turn of a spin yields the CPU (sched_yield): on a machine with fewer cores
    than busy threads, a peer or the application woken on the spinner's CPU runs at once
    instead of waiting for the spin to end."""
    from blockfabric.fabric import reactor as mod
    yields = [0]
    monkeypatch.setattr(mod, "_yield", lambda: yields.__setitem__(0, yields[0] + 1))
    reactor = _spinning_reactor(2_000.0)
    reactor.spin_load = 100.0
    polled = [0]
    reactor.add_poller(lambda: polled.__setitem__(0, polled[0] + 1) or False)
    try:
        reactor.run_once(0.001)
    finally:
        reactor.close()
    assert reactor.spin_misses == 1 and polled[0] > 1
    assert yields[0] == polled[0]


def test_spin_knob_is_validated(monkeypatch):
    from blockfabric.fabric import reactor as mod
    with pytest.raises(ValueError):
        Reactor("bad", spin_us=-1)
    with pytest.raises(ValueError):
        Reactor("bad", spin_us=mod.MAX_SPIN_US + 1)
    monkeypatch.setenv(mod.SPIN_ENV, "junk")
    assert mod.spin_default() == mod.DEFAULT_SPIN_US
    monkeypatch.setenv(mod.SPIN_ENV, "25")
    assert mod.spin_default() == 25.0
    mod.set_default_spin(7)
    try:
        assert Reactor("x").spin_us == 7.0
    finally:
        mod.set_default_spin(None)


def test_idle_spin_catches_the_next_request_right_after_a_wake_up(monkeypatch):
    """With nothing outstanding the device's busy-poll still looks for the next request
    for IDLE_SPIN_WINDOW after a wake-up that found work (at QD1 the next FUSE request
    comes microseconds after the reply): a request then is served by the spin, with no
    sleep; once the window is over the device says nothing is outstanding (no spin)."""
    from blockfabric.rdma.soft import SoftProvider
    from blockfabric.rdma.soft import device as soft_device

    monkeypatch.setattr(soft_device, "IDLE_SPIN_WINDOW", 0.05)   # room for a loaded machine
    provider = SoftProvider(progress="poll")
    ctx = provider.context
    reactor = Reactor("idle", spin_us=10_000.0)
    ran: list[bytes] = []
    r, w = os.pipe2(os.O_NONBLOCK)
    try:
        cq = ctx.create_cq()
        reactor.add_cq(cq, cq.poll)
        reactor.add_reader(r, lambda: ran.append(os.read(r, 9)))
        (group,) = reactor._pollers
        assert group() is None                  # never active: nothing to spin for
        os.write(w, b"one")
        reactor.run_once(2)                     # a wake-up that found work
        assert ran == [b"one"] and reactor.spin_hits == 0
        assert group() is False                 # in the window: spin for the next one
        writes = [b"two"]

        def request_comes() -> bool:            # while the loop spins, a request comes
            if writes:
                os.write(w, writes.pop())
            return False
        reactor.add_poller(request_comes)
        reactor.run_once(2)
        assert ran == [b"one", b"two"] and reactor.spin_hits == 1
        time.sleep(soft_device.IDLE_SPIN_WINDOW * 2)
        assert group() is None
        reactor.remove_reader(r)
        reactor.remove_cq(cq, cq.poll)
        cq.close()
    finally:
        reactor.close()
        provider.close()
        os.close(r)
        os.close(w)
