"""Fault-test fixtures: a file-backed target subprocess that can be killed and restarted on
the same port, and host options short enough for tests (KATO 1 s, reconnect every 0.5 s)."""

from __future__ import annotations

import pathlib
import signal
from typing import Any

import pytest

from blockfabric.initiator.host import ConnectOptions, Controller

from e2e.conftest import (HOSTNQN, NQN, REACTORS, TargetProc, addr_of,  # noqa: F401
                          free_port, listener, ram_config, reactors, start_target,
                          start_timeout, transport, via)
from helpers.netns import netns_pair  # noqa: F401

FAST = dict(keep_alive_tmo=1.0, reconnect_delay=0.5, connect_timeout=1.0)


def file_config(port: int, volume: pathlib.Path, address: str | None = None,
                extra_ports: tuple[int, ...] = (), transport: str | None = None,
                reactors: int = 1) -> dict[str, Any]:
    """One file-backed namespace (it survives SIGKILL: the data is in the file)."""
    config = ram_config(port, address, transport, reactors, namespaces=[
        {"nsid": 1, "backend": "file", "path": str(volume), "size": "32MiB"}])
    config["listeners"] += [listener(p, address, transport) for p in extra_ports]
    return config


class Restartable:
    """A target that can be SIGKILLed, paused and restarted with the same config and port."""

    def __init__(self, config: dict[str, Any], tmp: pathlib.Path,
                 netns: str | None = None) -> None:
        self.config, self.tmp, self.netns = config, tmp, netns
        self.procs: list[TargetProc] = []
        self.start()

    @property
    def proc(self) -> TargetProc:
        return self.procs[-1]

    def start(self) -> None:
        self.procs.append(TargetProc(self.config, self.tmp, self.netns).start())

    def kill(self) -> None:
        self.proc.proc.send_signal(signal.SIGKILL)
        self.proc.proc.wait(10)

    def signal(self, sig: int) -> None:
        self.proc.proc.send_signal(sig)

    def stop(self) -> None:
        for p in self.procs:
            if p.alive():
                p.proc.send_signal(signal.SIGCONT)
                p.stop()

    @property
    def log(self) -> str:
        return "".join(p.log for p in self.procs)


@pytest.fixture
def file_target(tmp_path):
    """A restartable file-backed target on loopback (``.port``), stopped at teardown."""
    port = free_port()
    target = Restartable(file_config(port, tmp_path / "vol.img"), tmp_path)
    target.port = port
    yield target
    target.stop()
    assert "Traceback" not in target.log, target.log


@pytest.fixture
def any_file_target(tmp_path, transport, reactors):
    """:func:`file_target` listening on ``transport`` with ``reactors`` poll groups
    (``.via``: the host's keywords)."""
    port = free_port()
    target = Restartable(file_config(port, tmp_path / "vol.img", transport=transport,
                                     reactors=reactors), tmp_path)
    target.port, target.via = port, via(transport)
    yield target
    target.stop()
    assert "Traceback" not in target.log, target.log


def host(port: int, **kw: Any) -> Controller:
    # ctrl_loss_tmo: how long the host waits for a restarted target to come back, a wait
    # for a daemon to come up (lengthened as BLOCKFABRIC_TEST_START_TIMEOUT says); the
    # tests of the bound itself give their own
    opts = dict(FAST, **via(), hostnqn=HOSTNQN, nr_io_queues=2,
                ctrl_loss_tmo=start_timeout(15.0))
    opts.update(kw)
    return Controller(ConnectOptions(traddr=addr_of(), trsvcid=port, subnqn=NQN,
                                     **opts)).connect()
