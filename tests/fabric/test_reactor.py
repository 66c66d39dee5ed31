"""The per-queue-group poll loop: readers, timers, cross-thread calls, fault isolation."""

from __future__ import annotations

import os
import threading
import time

from blockfabric.fabric.reactor import Reactor


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
