"""The reactor's spin follows the depth and backs off under CPU pressure: no busy-poll
while more than SPIN_MAX_DEPTH commands are outstanding, none for SPIN_BUSY_WAITS waits
after a receive brought several commands at once, none while /proc/pressure/cpu's
"some avg10" is above the limit ($BLOCKFABRIC_REACTOR_SPIN_LOAD); each skip is counted."""

from __future__ import annotations

import pytest

from blockfabric.fabric import reactor as mod
from blockfabric.fabric.reactor import Reactor


@pytest.fixture(autouse=True)
def _quiet_machine(monkeypatch):
    """Decisions must not depend on this machine's load: no load average, no PSI, unless
    a test writes its own pressure file."""
    monkeypatch.setattr(mod, "_oversubscribed", lambda: False)
    monkeypatch.setattr(mod, "PSI_CPU", "/nonexistent/pressure/cpu")
    monkeypatch.delenv(mod.SPIN_LOAD_ENV, raising=False)


class _Engine:
    """A poller with ``depth`` commands outstanding whose answer is already there (a spin
    finds it at once: a hit), counting how often it is polled."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.polled = 0

    def poll(self) -> bool:
        self.polled += 1
        return True

    def in_flight(self) -> int:
        return self.depth


def _reactor(*engines: _Engine) -> Reactor:
    reactor = Reactor("spin", spin_us=200.0)
    for engine in engines:
        reactor.add_poller(engine.poll, engine.in_flight)
    return reactor


def test_no_spin_above_the_depth_limit_summed_over_pollers():
    shallow, other = _Engine(mod.SPIN_MAX_DEPTH), _Engine(0)
    reactor = _reactor(shallow, other)
    try:
        reactor.run_once(0.001)
        assert shallow.polled == 1 and reactor.spin_hits == 1   # (a hit ends the spin)
        assert reactor.spin_skips_depth == 0
        other.depth = 1                     # MAX_DEPTH + 1 outstanding in all
        reactor.run_once(0.001)
        assert (shallow.polled, other.polled) == (1, 0), "at depth the loop must not poll"
        assert reactor.spin_skips_depth == 1 and reactor.spin_hits == 1
        other.depth = 0                     # back to QD <= 2: spinning again
        reactor.run_once(0.001)
        assert shallow.polled == 2 and reactor.spin_hits == 2
        reactor.remove_poller(shallow.poll)
        shallow.depth = 99                  # removed: its depth no longer counts
        reactor.run_once(0.001)
        assert other.polled == 1 and reactor.spin_skips_depth == 1
    finally:
        reactor.close()


def test_a_poller_without_depth_does_not_block_the_spin():
    engine = _Engine(50)
    reactor = Reactor("spin", spin_us=200.0)
    reactor.add_poller(engine.poll)         # (the soft provider's engine gives none)
    try:
        reactor.run_once(0.001)
        assert engine.polled == 1 and reactor.spin_skips_depth == 0
    finally:
        reactor.close()


def test_several_arrivals_at_once_skip_the_next_waits(monkeypatch):
    monkeypatch.setattr(mod, "SPIN_BUSY_WAITS", 5)
    engine = _Engine(0)
    reactor = _reactor(engine)
    try:
        reactor.note_arrivals(1)            # one at a time: QD1, keep spinning
        reactor.run_once(0.001)
        assert engine.polled == 1 and reactor.spin_skips_depth == 0
        reactor.note_arrivals(mod.SPIN_BUSY_ARRIVALS)
        for _ in range(5):
            reactor.run_once(0.001)
        assert engine.polled == 1 and reactor.spin_skips_depth == 5
        reactor.run_once(0.001)             # the burst is over: spinning again
        assert engine.polled == 2 and reactor.spin_hits == 2
    finally:
        reactor.close()


def test_cpu_pressure_is_read_from_psi(tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=41.25 avg60=5.70 avg300=5.38 total=848402260\n"
                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert mod.cpu_pressure(str(psi)) == 41.25
    psi.write_text("some avg10=junk\n")
    assert mod.cpu_pressure(str(psi)) is None
    assert mod.cpu_pressure(str(tmp_path / "absent")) is None


def test_no_spin_under_cpu_pressure_and_the_check_is_redone(monkeypatch, tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=55.00 avg60=1.00 avg300=1.00 total=1\n")
    monkeypatch.setattr(mod, "PSI_CPU", str(psi))
    engine = _Engine(1)
    reactor = _reactor(engine)
    assert reactor.spin_load == mod.DEFAULT_SPIN_LOAD
    try:
        reactor.run_once(0.001)
        assert engine.polled == 0 and reactor.spin_skips_pressure == 1
        psi.write_text("some avg10=12.00 avg60=1.00 avg300=1.00 total=1\n")
        reactor.run_once(0.001)             # not looked at again within SPIN_LOAD_EVERY
        assert engine.polled == 0 and reactor.spin_skips_pressure == 2
        reactor._load_at = 0.0              # (a second later)
        reactor.run_once(0.001)
        assert engine.polled == 1 and reactor.spin_hits == 1
        stats = reactor.spin_stats()
        assert stats == {"spin_us": 200.0, "load_limit": mod.DEFAULT_SPIN_LOAD, "hits": 1,
                         "misses": 0, "skips_depth": 0, "skips_pressure": 2}
    finally:
        reactor.close()


def test_spin_load_knob(monkeypatch, tmp_path):
    psi = tmp_path / "cpu"
    psi.write_text("some avg10=55.00 avg60=1.00 avg300=1.00 total=1\n")
    monkeypatch.setattr(mod, "PSI_CPU", str(psi))
    monkeypatch.setenv(mod.SPIN_LOAD_ENV, "60")
    engine = _Engine(1)
    reactor = _reactor(engine)
    try:
        assert reactor.spin_load == 60.0
        reactor.run_once(0.001)             # 55 % is under a limit of 60 %
        assert engine.polled == 1 and reactor.spin_skips_pressure == 0
    finally:
        reactor.close()
    for bad in ("junk", "-1", "101"):
        monkeypatch.setenv(mod.SPIN_LOAD_ENV, bad)
        assert mod.spin_load_limit() == mod.DEFAULT_SPIN_LOAD
    monkeypatch.setenv(mod.SPIN_LOAD_ENV, "100")     # the guard off: PSI is not even read
    monkeypatch.setattr(mod, "cpu_pressure", lambda path=None: pytest.fail("read PSI"))
    reactor = Reactor("spin", spin_us=200.0)
    try:
        assert not reactor._pressed()
    finally:
        reactor.close()
