"""What the two stateful fuzzers share: one live target with a bystander beside it (made
once per test and remade only when an example left either broken, so that the next example,
and hypothesis's shrinking, start from a healthy target), the checks every example ends with,
and the budget: a fixed, seeded run in ``make test``, rounds of fresh seeds for
``FUZZ_SECONDS`` in ``make fuzz``.

Environment:

* ``FUZZ_SECONDS`` unset (``make test``): one round of ``FUZZ_EXAMPLES`` examples (default
  per fuzzer) from the fixed seed ``FUZZ_SEED`` (default 13), no example database: the same
  inputs every run, so a red run is a real regression, never a lucky draw.
* ``FUZZ_SECONDS=n`` (``make fuzz``): rounds of ``FUZZ_EXAMPLES`` examples, each from a new
  random seed (printed), until n seconds have passed; failures are kept in
  ``.hypothesis/fuzz/<name>`` and replayed first on the next run.  ``FUZZ_SEED`` pins the
  first round's seed (to replay a printed one).
"""

from __future__ import annotations

import os
import random
import re
import time
from typing import Callable

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test

from e2e.conftest import RDMA, BIN, TargetProc, free_port, listener, ram_config

from blockfabric.protocol import CMConnectRequest
from blockfabric.rdma.soft.wire import Frame

from .conftest import MAX_GAP, RATES, Bystander, assert_undisturbed
from .rawpeer import RawPeer

DEFAULT_SEED = 13
SYNC_SOURCE = "127.0.0.4"
SYNC_CM = CMConnectRequest(recfmt=0, qid=0, hrqsize=32, hsqsize=31, cntlid=0).pack()
#: bytes of target log one step may add (a refused peer is one or two lines)
LOG_PER_STEP = 16 << 10
#: fds the target may hold over its baseline once an example's peers are gone
FD_SLACK = 4
#: resident memory the target may grow by over the whole run
RSS_SLACK = 128 << 20
#: the target's address space: a peer-driven allocation of gigabytes (a log page of 16 GiB,
#: say) must fail in the target, not take the memory of the machine the tests run on
TARGET_AS = 2 << 30
#: in ``make test``, hypothesis shrinks a failure for at most this long (its own limit,
#: 300 s, holds in ``make fuzz``): the suite stays bounded while today's bugs are unfixed
SHRINK_SECONDS = int(os.environ.get("FUZZ_SHRINK_SECONDS", 45))
#: seconds the first bystander runs alone, for its undisturbed rate
WARMUP = 1.0
#: a bystander is replaced after this long (its verify load stops itself after 120 s)
BYSTANDER_AGE = 90.0


def fuzz_seconds() -> float | None:
    value = os.environ.get("FUZZ_SECONDS")
    return float(value) if value else None


class Harness:
    """A ramdisk target (attackers come from 127.0.0.2 and up, the bystander from 127.0.0.1)
    and a bystander host verifying its data; :meth:`begin` and :meth:`end` bracket one
    example and check what it did to them."""

    def __init__(self, tmp, name: str = "fuzz", limits: dict | None = None) -> None:
        self.tmp = tmp
        self.name = name
        self.attack_from: float | None = None     # the first example of this bystander
        self.limits = {"max_connections_per_host": 16, "connect_timeout": 5, **(limits or {})}
        self.target: TargetProc | None = None
        self.bystander: Bystander | None = None
        #: (seconds since start, what happened) for every target or bystander replaced
        self.casualties: list[tuple[float, str]] = []
        self.results: list[dict] = []
        self.started = time.monotonic()
        self.examples = 0
        self.steps = 0
        self._start_target()

    # -- the target and the bystander ----------------------------------------------------
    def _start_target(self) -> None:
        port = free_port()
        config = ram_config(port)
        # sync() needs the soft provider's wire: in a verbs run, a soft listener beside
        sync_port = port if RDMA == "rdma" else free_port()
        if sync_port != port:
            config["listeners"].append(listener(sync_port, transport="rdma"))
        config["limits"] = self.limits
        self.target = TargetProc(config, self.tmp, command=[
            "prlimit", f"--as={TARGET_AS}", "--", str(BIN / "blockfabric-target")]).start()
        self.target.port, self.target.sync_port = port, sync_port
        self._start_bystander()
        time.sleep(WARMUP)          # the bystander's rate before any attack, for the summary
        self.base = self.sample()

    def _start_bystander(self) -> None:
        self.bystander = Bystander(self.target.port)

    def _finish_bystander(self, why: str) -> None:
        b, self.bystander = self.bystander, None
        if self.attack_from is not None:
            b.windows[f"examples until {why}"] = (self.attack_from, time.monotonic())
            self.attack_from = None
        result = b.finish()
        for row in b.report():
            RATES.append((self.name, *row))
        self.results.append(result)

    def sample(self) -> dict[str, int]:
        pid = self.target.proc.pid
        rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "rss": rss}

    @property
    def port(self) -> int:
        return self.target.port

    @property
    def log(self) -> str:
        """What the target logged in this example (the whole log grows to megabytes)."""
        return "".join(self.target.lines[self.line0:])

    def trouble(self) -> str | None:
        """Why the target or the bystander cannot serve the next example, if so."""
        b = self.bystander
        if not self.target.alive():
            return "target died"
        if b is None or not b.thread.is_alive():
            return "bystander ended"
        last = b.times[-1] if b.times else b.started
        if time.monotonic() - last >= MAX_GAP:
            return "bystander stalled"
        return None

    # -- one example ---------------------------------------------------------------------
    def begin(self) -> None:
        """Before an example: replace a dead target or a stalled or old bystander."""
        why = self.trouble()
        if why is not None:
            self.casualties.append((round(time.monotonic() - self.started, 1), why))
            self._finish_bystander(why)
            if not self.target.alive():
                self.target.stop()
                self._start_target()
            else:
                self._start_bystander()
        elif time.monotonic() - self.bystander.started > BYSTANDER_AGE:
            self._finish_bystander("rotation")
            self._start_bystander()
        self.examples += 1
        if self.attack_from is None:
            self.attack_from = time.monotonic()
        self.t0 = time.monotonic()
        self.example_steps = 0
        self.line0 = len(self.target.lines)

    def step(self) -> None:
        """Count a step.  The checks wait for :meth:`end`: what the target does with a frame
        shows in its log a little later, and a check that sometimes fails one step late
        would make hypothesis's replays disagree (a flaky test that shrinks nothing)."""
        self.steps += 1
        self.example_steps += 1

    def check_log(self) -> None:
        """The target is alive, logged no traceback, and at most LOG_PER_STEP per step."""
        new = self.log
        assert self.target.alive(), "the target died:\n" + new[-3000:]
        if "Traceback" in new:
            raise target_bug(new)("the target logged a traceback:\n" + new[-3000:])
        assert len(new) <= LOG_PER_STEP * (self.example_steps + 1), \
            f"{self.example_steps} steps made the target log {len(new)} bytes:\n" + new[-2000:]

    def sync(self) -> None:
        """Return once the target has handled what came before: it logs the acceptance of
        a new connection (from 127.0.0.4, a source no attacker uses) in its own order.  The
        connection is the soft provider's, on loopback: in a verbs run on a soft listener of
        its own (its accept is served by the same event loop as the verbs listener's)."""
        lines = self.target.lines
        start = len(lines)
        peer = RawPeer(("127.0.0.1", self.target.sync_port), source=SYNC_SOURCE)
        try:
            where = f"accepted ({SYNC_SOURCE!r}, {peer.sock.getsockname()[1]})"
            kind, _ = peer.connect_cm(SYNC_CM)
            assert kind == Frame.CONN_REP, f"the target refused a connection: {kind}"
            deadline = time.monotonic() + 5
            while not any(where in line for line in lines[start:]):
                assert time.monotonic() < deadline, "the target did not log the connection"
                time.sleep(0.001)
        finally:
            peer.close()

    def end(self) -> None:
        """After an example (its peers closed): the bystander never stood still, the target
        gave back its fds and kept its memory, and nothing it logged was a traceback."""
        self.sync()
        self.check_log()
        b = self.bystander
        t1 = time.monotonic()
        deadline = t1 + MAX_GAP
        while (not b.times or b.times[-1] < t1) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert b.times, "the bystander never completed an I/O:\n" + self.log[-3000:]
        gap = b.max_gap(max(self.t0, b.times[0]))
        assert gap < MAX_GAP, f"the bystander made no progress for {gap:.2f} s:\n" \
            + self.log[-3000:]
        deadline = time.monotonic() + 5
        while True:
            now = self.sample()
            if now["fds"] <= self.base["fds"] + FD_SLACK or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert now["fds"] <= self.base["fds"] + FD_SLACK, \
            f"the target holds {now['fds'] - self.base['fds']} fds more than before"
        assert now["rss"] - self.base["rss"] <= RSS_SLACK, \
            f"the target grew by {(now['rss'] - self.base['rss']) >> 20} MiB"
        self.check_log()

    def close(self) -> list[dict]:
        """Stop the bystander and the target; every bystander's counts."""
        if self.bystander is not None:
            self._finish_bystander("end")
        if self.target is not None and self.target.alive():
            self.target.stop()
        return self.results


_BUGS: dict[str, type] = {}
_WHERE = re.compile(r'File "([^"]+)", line (\d+), in (\w+)')


def target_bug(log: str) -> type[AssertionError]:
    """An AssertionError subclass named after where the target's first traceback in ``log``
    was raised (exception type, and the innermost file and line of the project's own code):
    hypothesis tells failures apart by their
    exception's type, so each distinct bug in the target is reported and shrunk on its own
    instead of the first one found hiding the others."""
    tb = log[log.index("Traceback"):]
    frames = _WHERE.findall(tb.split("\n\n")[0])
    error = next((line.split(":")[0] for line in tb.splitlines()[1:]
                  if line and not line.startswith((" ", "Traceback"))), "Error")
    ours = [f for f in frames if "site-packages" not in f[0] and not f[0].startswith("/usr/")]
    file, line, func = (ours or frames or [("?", "0", "?")])[-1]
    key = f"{error} in {func} at {os.path.basename(file)}:{line}"
    if key not in _BUGS:
        name = "Target" + re.sub(r"\W", "_", f"{error}_{func}_{os.path.basename(file)}_{line}")
        _BUGS[key] = type(name, (AssertionError,), {"__doc__": key})
    return _BUGS[key]


def _write(request, line: str) -> None:
    """A line on the terminal now (not captured): seeds and rates must be seen."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.getplugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)
    else:
        print(line)


def run_fuzzer(request, machine: type[RuleBasedStateMachine], name: str, harness: Harness,
               *, examples: int, steps: int) -> None:
    """Run ``machine`` against ``harness`` within the budget (see the module docstring),
    then check every bystander kept its data and rate."""
    examples = int(os.environ.get("FUZZ_EXAMPLES", examples))
    budget = fuzz_seconds()
    first_seed = os.environ.get("FUZZ_SEED")
    base = settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=list(HealthCheck), print_blob=True,
                    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
    if budget is None:
        config = settings(base, database=None)

        def seeds(_round: int) -> int:
            return int(first_seed or DEFAULT_SEED)
    else:
        db = DirectoryBasedExampleDatabase(os.path.join(".hypothesis", "fuzz", name))
        config = settings(base, database=db)

        def seeds(r: int) -> int:
            if first_seed and r == 0:
                return int(first_seed)
            return random.SystemRandom().getrandbits(32)
    machine.harness = harness
    started = time.monotonic()
    shrink_limit = engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS if budget is None else shrink_limit
    round_ = 0
    try:
        while True:
            value = seeds(round_)
            _write(request, f"{name}: round {round_}, seed {value} (FUZZ_SEED={value} "
                            f"replays it), {examples} examples of up to {steps} steps")
            test = seed(value)(get_state_machine_test(machine, settings=config))
            n0, s0, t0 = harness.examples, harness.steps, time.monotonic()
            try:
                test()
            finally:
                took = time.monotonic() - t0
                _write(request, f"{name}: {harness.examples - n0} examples, "
                                f"{harness.steps - s0} steps in {took:.1f} s "
                                f"({(harness.examples - n0) / max(took, 1e-6):.1f} examples/s, "
                                f"{(harness.steps - s0) / max(took, 1e-6):.0f} steps/s)")
            round_ += 1
            if budget is None or time.monotonic() - started >= budget:
                break
    finally:
        engine.MAX_SHRINKING_SECONDS = shrink_limit
        results = harness.close()
        if harness.casualties:
            _write(request, f"{name}: replaced after a failing example: {harness.casualties}")
    for result in results:
        assert_undisturbed(result)


def replay(machine: type[RuleBasedStateMachine], harness: Harness,
           programs: dict[str, Callable[[RuleBasedStateMachine], None]]) -> None:
    """Run each of ``programs`` (failures the fuzzer found, shrunk, kept as regressions so
    that ``make test`` checks them whatever the seed finds) as one example of ``machine``;
    every one runs, and the test fails naming those that failed."""
    machine.harness = harness
    failed = []
    for name, program in programs.items():
        state = machine()
        try:
            try:
                program(state)
            finally:
                state.teardown()
        except AssertionError as exc:
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:1500]}")
    results = harness.close()
    assert not failed, "\n\n".join(failed)
    for result in results:
        assert_undisturbed(result)


@pytest.fixture
def harness(tmp_path, request):
    h = Harness(tmp_path, request.node.name)
    yield h
    h.close()
