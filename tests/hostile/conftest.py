"""Hostile-peer fixtures: a ramdisk target with a small per-host connection limit, a good
host running a verify load beside the attacker, and the attacker's own controller."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

from blockfabric.initiator.host import connect

from e2e.conftest import (BIN, HOSTNQN, NQN, OTHER_HOSTNQN, RDMA, addr_of,  # noqa: F401
                          free_port, listener, ram_config, start_target, transport, via)
from faults.verifyload import verify_load

MAX_CONN = 6


@pytest.fixture
def target_reactors() -> int:
    """The target's poll groups; a module overrides it to run its tests with 1 and 2."""
    return 1


@pytest.fixture
def target(start_target, request, tmp_path, target_reactors):
    """Parametrize indirectly with a mapping to set further ``limits`` keys (and
    ``nofile``: run the target with that RLIMIT_NOFILE); with ``backend: file`` in it, the
    namespace is a file in ``tmp_path`` instead of a ramdisk (I/O through the shared bounce
    buffers and backend threads), and the target serves metrics (``proc.metrics``, a port)
    and ``status`` (``proc.socket``)."""
    port = free_port()
    limits = dict(getattr(request, "param", {}))
    backend = limits.pop("backend", "ramdisk")
    config = ram_config(port, reactors=target_reactors)
    tcp_port = free_port()      # and NVMe/TCP beside it: the same subsystem, the same limits
    config["listeners"].append(listener(tcp_port, transport="tcp"))
    padded_port = free_port()   # and one that asks for 16-byte aligned data (CPDA 3)
    config["listeners"].append({**listener(padded_port, transport="tcp"), "cpda": 3})
    nofile = limits.pop("nofile", None)
    if backend == "file":
        config["subsystems"][0]["namespaces"] = [
            {"nsid": 1, "backend": "file", "path": str(tmp_path / "volume"), "size": "64MiB"}]
        config["metrics"] = {"port": free_port()}
        config["control_socket"] = str(tmp_path / "control.sock")
    config["limits"] = {"max_connections_per_host": MAX_CONN, **limits}
    command = None if nofile is None else ["prlimit", f"--nofile={nofile}",
                                           str(BIN / "blockfabric-target")]
    proc = start_target(config, command=command)
    proc.port = port
    proc.tcp_port = tcp_port
    proc.padded_port = padded_port
    if backend == "file":
        proc.metrics, proc.socket = config["metrics"]["port"], config["control_socket"]
    return proc


class Bystander:
    """A well-behaved host (at :func:`addr_of`: 127.0.0.1, but on verbs) verifying its data
    in a thread while an attack runs; :meth:`finish` returns its counts, which must show no
    error and no mismatch.

    Every completed I/O is time-stamped, so a test can say how fast the bystander went
    before and during an attack (:meth:`attack`) and that it never stood still
    (:meth:`max_gap`)."""

    def __init__(self, port: int, hostnqn: str = OTHER_HOSTNQN, transport: str | None = None
                 ) -> None:
        self.ctrl = connect(addr_of(transport), NQN, port, **via(transport), hostnqn=hostnqn,
                            nr_io_queues=1, keep_alive_tmo=2.0)
        self.stop = threading.Event()
        self.result: dict = {}
        self.times: list[float] = []
        self.started = time.monotonic()
        self.windows: dict[str, tuple[float, float]] = {}
        self.thread = threading.Thread(target=lambda: self.result.update(
            verify_load(self.ctrl, 120, threads=2, region_blocks=128, stop=self.stop,
                        completions=self.times)))
        self.thread.start()

    def rate(self, t0: float, t1: float) -> float:
        """Completed I/Os per second in [t0, t1)."""
        n = sum(1 for t in list(self.times) if t0 <= t < t1)
        return n / max(t1 - t0, 1e-6)

    def max_gap(self, t0: float | None = None, t1: float | None = None) -> float:
        """The longest time without a completion in [t0, t1] (default: the whole run)."""
        t0 = self.started if t0 is None else t0
        t1 = time.monotonic() if t1 is None else t1
        marks = [t0, *(t for t in list(self.times) if t0 <= t <= t1), t1]
        return max(b - a for a, b in zip(marks, marks[1:]))

    @contextlib.contextmanager
    def attack(self, name: str, warmup: float = 1.0):
        """Time an attack: waits ``warmup`` s of undisturbed I/O first (the 'before' rate),
        then records the window of the ``with`` body under ``name`` for the summary."""
        time.sleep(max(0.0, self.started + warmup - time.monotonic()))
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.windows[name] = (t0, time.monotonic())

    def report(self) -> list[tuple[str, float, float, float]]:
        """(attack, I/O per s before, I/O per s during, longest gap during) per window."""
        out = []
        for name, (t0, t1) in self.windows.items():
            before = self.rate(self.started, t0)
            out.append((name, before, self.rate(t0, t1), self.max_gap(t0, t1)))
        return out

    def finish(self) -> dict:
        self.stop.set()
        self.thread.join(30)
        self.ctrl.close()
        return self.result


#: what every bystander saw, for the summary at the end of the run
RATES: list[tuple[str, str, float, float, float]] = []


@pytest.fixture
def bystander(target, request):
    """A host verifying its data over the test's ``transport`` (rdma unless the test takes
    that fixture)."""
    kind = request.getfixturevalue("transport") if "transport" in request.fixturenames \
        else RDMA
    b = Bystander(target.tcp_port if kind == "tcp" else target.port, transport=kind)
    yield b
    if b.thread.is_alive():
        b.stop.set()
        b.thread.join(30)
        b.ctrl.close()
    for row in b.report():
        RATES.append((request.node.name, *row))


@pytest.fixture(autouse=True)
def _rates_to_the_summary(request):
    """Hand what bystanders saw during this test to tests/conftest.py's summary, through the
    test's report: under pytest-xdist the test ran in a worker, the summary prints in the
    controller."""
    start = len(RATES)
    yield
    for row in RATES[start:]:
        request.node.user_properties.append(("bystander_rate", row))


MAX_GAP = 2.0   # seconds: the bystander must complete an I/O at least this often


VOLUME_BYTES = 64 << 20         # the size of ram_config's namespace


def volume_rss(pid: int, size: int = VOLUME_BYTES) -> int:
    """Resident bytes of ``pid``'s mapping of the volume, at most ``size``.  They are the
    hosts' data, not memory a peer made the target allocate, and they grow on their own:
    on verbs, registering the volume with the first I/O queue a process serves pins
    (faults in) every page of it.  The volume is in a mapping of at least ``size`` bytes:
    a private anonymous one (one poll group) may have been merged with its anonymous
    neighbours into a larger one, so the resident bytes of every mapping that large count,
    up to ``size`` (what an attacker might make the target allocate beyond that still
    shows)."""
    rss, in_volume = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):          # a mapping's first line
                start, end = head.split("-")
                in_volume = int(end, 16) - int(start, 16) >= size
            elif in_volume and head == "Rss:":
                rss += int(line.split()[1]) * 1024
    return min(rss, size)


class TargetProbe:
    """What the target process holds (open fds, resident memory besides the volume's own
    pages: see :func:`volume_rss`) and how much it logged: taken before an attack and
    compared after, so a test can show each stayed bounded."""

    def __init__(self, target) -> None:
        self.target = target
        self.pid = target.proc.pid
        self.base = self.sample()

    def sample(self) -> dict[str, int]:
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        rss = 0
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return {"fds": fds, "rss": rss - volume_rss(self.pid), "log": len(self.target.log)}

    def assert_bounded(self, *, fds: int = 16, rss: int = 64 << 20, log: int = 64 << 10,
                       settle: float = 10.0) -> dict[str, int]:
        """After the attack: at most ``fds`` more open files (once things settle), ``rss``
        more bytes resident and ``log`` more bytes of log than before it."""
        deadline = time.monotonic() + settle
        while True:
            now = self.sample()
            grew = {k: now[k] - self.base[k] for k in now}
            if grew["fds"] <= fds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert grew["fds"] <= fds, f"target holds {grew['fds']} more fds: {now}"
        assert grew["rss"] <= rss, f"target grew by {grew['rss'] >> 20} MiB: {now}"
        assert grew["log"] <= log, (f"target logged {grew['log']} bytes during the attack:\n"
                                    + self.target.log[-2000:])
        return grew


def assert_accepts_new_host(port: int, hostnqn: str = HOSTNQN) -> None:
    """After an attack, a new host can connect, write and read back."""
    with connect(addr_of(), NQN, port, **via(), hostnqn=hostnqn,
                 nr_io_queues=1, connect_timeout=5.0) as ctrl:
        ns = ctrl.namespaces[1]
        data = os.urandom(ns.block_size)
        ns.write(ns.block_size * 1000, data)
        assert ns.read(ns.block_size * 1000, len(data)) == data


@contextlib.contextmanager
def attacker_of(target, bystander: Bystander, name: str, transport: str | None = None):
    """A connected attacker (one I/O queue, over ``transport``) for the duration of attack
    ``name``."""
    port = target.tcp_port if transport == "tcp" else target.port
    with bystander.attack(name), \
            connect(addr_of(transport), NQN, port, **via(transport), hostnqn=HOSTNQN,
                    nr_io_queues=1) as attacker:
        yield attacker


def assert_answers(attacker, attacks, rounds: int) -> None:
    """Send each (name, capsule builder, status) of ``attacks`` raw, ``rounds`` times, on
    the attacker's first I/O queue: each gets exactly its status, with DNR."""
    queue = attacker.io_queues[0]
    for _ in range(rounds):
        for name, build, status in attacks:
            cqe = attacker.raw(queue, build(attacker))
            assert (cqe.status, cqe.dnr) == (status, True), (name, cqe)


def assert_undisturbed(result: dict, bystander: Bystander | None = None) -> None:
    """No error, no mismatch, no reconnect; with ``bystander``, also never a gap of
    MAX_GAP seconds without a completed I/O during any attack window."""
    assert result["errors"] == 0 and result["mismatches"] == 0, (
        f"{result['errors']} error(s) {result.get('error_samples')}, {result['mismatches']} "
        f"mismatch(es) {result.get('mismatch_samples')} in {result['ios']} I/Os")
    assert result["ios"] > 0 and result["recovery"]["losses"] == 0, result
    if bystander is not None:
        for name, before, during, gap in bystander.report():
            assert gap < MAX_GAP, (f"{name}: the bystander made no progress for {gap:.1f} s "
                                   f"({before:.0f}/s before, {during:.0f}/s during)")
