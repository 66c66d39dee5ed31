"""Start the real target daemon as a subprocess and talk to it over real sockets."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest
import yaml

BIN = pathlib.Path(sys.executable).parent
NQN = "nqn.2026-12.io.blockfabric:ram0"
HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-3333-4444-555555555555"
OTHER_HOSTNQN = "nqn.2014-08.org.nvmexpress:uuid:99999999-2222-3333-4444-555555555555"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``BLOCKFABRIC_TEST_REACTORS=N``: every target a test starts without naming ``reactors`` in
#: its configuration gets N poll groups (``make test-reactors`` runs the end-to-end, fault and
#: hostile suites so with 2, beside the tests parametrised with 1 and 2 reactors).
DEFAULT_REACTORS = int(os.environ.get("BLOCKFABRIC_TEST_REACTORS") or 1)


class TargetProc:
    """``blockfabric-target run`` in a subprocess, with its stderr collected."""

    def __init__(self, config: dict[str, Any], tmp: pathlib.Path, netns: str | None = None,
                 env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
        if DEFAULT_REACTORS != 1 and "reactors" not in config:
            config = {**config, "reactors": DEFAULT_REACTORS}
        self.config = config
        #: what runs instead of ``blockfabric-target`` (a wrapper with the same command line)
        self.command = command or [str(BIN / "blockfabric-target")]
        self.path = tmp / f"target-{time.monotonic_ns()}.yaml"
        self.path.write_text(yaml.safe_dump(config))
        self.netns = netns
        self.env = env
        self.lines: list[str] = []
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()

    def start(self, timeout: float = 20) -> TargetProc:
        timeout = start_timeout(timeout)
        preexec = None
        if self.netns:
            name = self.netns

            def preexec() -> None:
                from blockfabric.net import enter_netns
                enter_netns(name)
        env = dict(os.environ, **(self.env or {}))
        self.proc = subprocess.Popen(
            [*self.command, "run", "-C", str(self.path), "-v"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, preexec_fn=preexec, env=env)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout):
            self.stop()
            raise AssertionError("target did not become ready:\n" + self.log)
        if self.proc.poll() is not None:
            raise AssertionError("target exited:\n" + self.log)
        return self

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if "ready:" in line:
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_log(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log:
                return True
            time.sleep(0.02)
        return False

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError("target did not stop in time:\n" + self.log)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


#: ``BLOCKFABRIC_TEST_TRANSPORTS`` (a comma list, default ``rdma,tcp``): what the suites that
#: run over every transport are parametrised with.  ``rdma`` is NVMe-oF over the soft RDMA
#: provider and ``tcp`` NVMe/TCP (issue 18), both on loopback; ``verbs`` is NVMe-oF over the
#: verbs provider on ``BLOCKFABRIC_TEST_ADDR`` (an RDMA device's address: rxe0's in the lab,
#: tests/lab/suites.sh).
TRANSPORTS = tuple(name.strip() for name in
                   os.environ.get("BLOCKFABRIC_TEST_TRANSPORTS", "rdma,tcp").split(",")
                   if name.strip())
KNOWN_TRANSPORTS = ("rdma", "tcp", "verbs")
if not TRANSPORTS or set(TRANSPORTS) - set(KNOWN_TRANSPORTS):
    raise ValueError(f"BLOCKFABRIC_TEST_TRANSPORTS={','.join(TRANSPORTS)!r}: "
                     f"a comma list of {', '.join(KNOWN_TRANSPORTS)}")
#: The RDMA transport of the tests that are not parametrised over transports (NVMe-oF over
#: RDMA, whichever provider): the soft provider, unless the run names verbs and not rdma.
RDMA = "verbs" if "verbs" in TRANSPORTS and "rdma" not in TRANSPORTS else "rdma"
#: where a verbs listener listens and its hosts connect (an address an RDMA device owns)
VERBS_ADDR = os.environ.get("BLOCKFABRIC_TEST_ADDR", "127.0.0.1")
#: ... and with one poll group (one process) and two (a worker process beside the
#: coordinator: NVMe/TCP and soft-RDMA I/O queues spread over both).
REACTORS = (1, 2)
#: ``BLOCKFABRIC_TEST_START_TIMEOUT`` (seconds): how long a fixture waits for a daemon it
#: starts to say it is ready (default 20).  Under TCG (the lab) a start with pyverbs and a
#: poll-group worker takes far longer than on the host.  It only lengthens waits for a
#: daemon to come up, never a bound a test checks.
START_TIMEOUT = float(os.environ.get("BLOCKFABRIC_TEST_START_TIMEOUT") or 20)


def start_timeout(default: float) -> float:
    """A start/ready wait of ``default`` seconds, lengthened (never shortened) to
    ``BLOCKFABRIC_TEST_START_TIMEOUT``."""
    return max(default, START_TIMEOUT)


def case_timeout(default: float) -> float:
    """A whole test's cap (pytest-timeout) of ``default`` seconds, lengthened in proportion
    where ``BLOCKFABRIC_TEST_START_TIMEOUT`` is above its default of 20 s (a slow machine,
    the lab's TCG guest: its daemons start and its restarts run that much slower)."""
    return default * max(1.0, START_TIMEOUT / 20)


def addr_of(transport: str | None = None) -> str:
    """The address a listener of ``transport`` (default :data:`RDMA`) listens on, and its
    hosts connect to: loopback, or ``BLOCKFABRIC_TEST_ADDR`` for verbs."""
    return VERBS_ADDR if (transport or RDMA) == "verbs" else "127.0.0.1"


def peer_addr(n: int, transport: str | None = None) -> str:
    """Host address number ``n`` (1 is :func:`addr_of` itself) for a test that connects from
    several source addresses: 127.0.0.n, or for verbs ``BLOCKFABRIC_TEST_ADDR`` with its last
    octet n (tests/lab/suites.sh adds 10.99.0.2-9 to rxe0's netdev for them)."""
    base = addr_of(transport)
    return base.rsplit(".", 1)[0] + f".{n}"


def provider_of(transport: str | None = None) -> str:
    """The RDMA provider of an rdma or verbs ``transport`` (default :data:`RDMA`)."""
    return "verbs" if (transport or RDMA) == "verbs" else "soft"


def listener(port: int, address: str | None = None, transport: str | None = None
             ) -> dict[str, Any]:
    """A listener of ``transport`` (default :data:`RDMA`; rdma: the soft provider, verbs:
    the verbs provider) in a target configuration, on :func:`addr_of` unless ``address``."""
    transport = transport or RDMA
    address = address or addr_of(transport)
    if transport == "tcp":
        return {"transport": "tcp", "address": address, "port": port}
    return {"provider": provider_of(transport), "address": address, "port": port}


def via(transport: str | None = None) -> dict[str, Any]:
    """The ``connect()`` keywords that reach a :func:`listener` of ``transport``."""
    if (transport or RDMA) == "tcp":
        return {"transport": "tcp"}
    return {"provider": provider_of(transport)}


def cli_via(transport: str | None = None) -> list[str]:
    """The same as the host CLI's flags."""
    if (transport or RDMA) == "tcp":
        return ["-t", "tcp"]
    return ["--provider", provider_of(transport)]


def ram_config(port: int, address: str | None = None, transport: str | None = None,
               reactors: int = 1, **subsystem: Any) -> dict[str, Any]:
    sub = {"nqn": NQN, "allow_any_host": True,
           "namespaces": [{"nsid": 1, "backend": "ramdisk", "size": "64MiB"}]}
    sub.update(subsystem)
    config = {"listeners": [listener(port, address, transport)], "subsystems": [sub]}
    if reactors != 1:
        config["reactors"] = reactors
    return config


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """Each transport in turn (the test runs once per transport)."""
    return request.param


@pytest.fixture(params=REACTORS, ids=lambda n: f"{n}r")
def reactors(request) -> int:
    """One poll group, then two (the test runs once per count)."""
    return request.param


def _stop_and_check(proc: TargetProc) -> None:
    """Stop ``proc`` if it still runs; its log must show no traceback."""
    if proc.alive():
        proc.stop()
    assert "Traceback" not in proc.log, proc.log


def _start_ram(start: Callable[[dict[str, Any]], TargetProc], transport: str | None = None,
               reactors: int = 1) -> TargetProc:
    """A ramdisk target on a free port, started by ``start(config)``; ``proc.port``,
    ``proc.transport``, ``proc.reactors`` and ``proc.via`` (how to connect to it)."""
    port, transport = free_port(), transport or RDMA
    proc = start(ram_config(port, transport=transport, reactors=reactors))
    proc.port, proc.transport, proc.via = port, transport, via(transport)
    proc.reactors = reactors
    return proc


@pytest.fixture
def start_target(tmp_path):
    """start_target(config, netns=None) -> a running TargetProc, stopped at teardown."""
    started: list[TargetProc] = []

    def start(config: dict[str, Any], netns: str | None = None, **kw: Any) -> TargetProc:
        proc = TargetProc(config, tmp_path, netns, **kw).start()
        started.append(proc)
        return proc

    yield start
    for proc in started:
        _stop_and_check(proc)


@pytest.fixture(scope="module")
def module_ram_target(tmp_path_factory):
    """One ramdisk target shared by a whole test module (a target start costs ~0.5 s)."""
    proc = _start_ram(lambda c: TargetProc(c, tmp_path_factory.mktemp("target")).start())
    yield proc
    _stop_and_check(proc)


@pytest.fixture
def ram_target(start_target):
    return _start_ram(start_target)


@pytest.fixture(scope="module", params=[(t, r) for t in TRANSPORTS for r in REACTORS],
                ids=lambda p: f"{p[0]}-{p[1]}r")
def module_any_target(request, tmp_path_factory):
    """One ramdisk target per transport and poll-group count shared by a whole test module
    (``proc.via``)."""
    proc = _start_ram(lambda c: TargetProc(c, tmp_path_factory.mktemp("target")).start(),
                      *request.param)
    yield proc
    _stop_and_check(proc)


@pytest.fixture
def any_target(start_target, transport, reactors):
    """A ramdisk target listening on ``transport`` with ``reactors`` poll groups
    (``proc.via``: how to connect to it)."""
    return _start_ram(start_target, transport, reactors)
