"""The target as a service: real daemons (tests.e2e's TargetProc), a notify socket the test
owns, real HTTP scrapes and the real control socket."""

from __future__ import annotations

import pathlib
import signal
import socket
import time
from typing import Any

import pytest
import yaml

from e2e.conftest import HOSTNQN, NQN, OTHER_HOSTNQN, TargetProc, free_port  # noqa: F401

from blockfabric.initiator.host import Controller, connect


class NotifySocket:
    """A NOTIFY_SOCKET of our own: every datagram the daemon sends, in order."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.messages: list[str] = []

    def wait_for(self, needle: str, timeout: float) -> list[str]:
        """Messages received until one contains ``needle`` (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        while not any(needle in m for m in self.messages):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {needle!r} within {timeout} s: {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                continue
        return self.messages

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path):
    ns = NotifySocket(tmp_path / "notify.sock")
    yield ns
    ns.close()


class Service:
    """A running target whose configuration file the test edits, then reloads with SIGHUP."""

    def __init__(self, proc: TargetProc, config: dict[str, Any]) -> None:
        self.proc = proc
        self.config = config
        self.port = config["listeners"][0]["port"]

    def rewrite(self, config: dict[str, Any] | str) -> None:
        text = config if isinstance(config, str) else yaml.safe_dump(config)
        self.proc.path.write_text(text)
        if not isinstance(config, str):
            self.config = config

    def reload(self, config: dict[str, Any] | str, timeout: float = 10) -> None:
        """Write the file, SIGHUP, and wait for the daemon to say it applied or refused it."""
        done = self.proc.log.count("reloaded ") + self.proc.log.count("reload rejected")
        self.rewrite(config)
        self.proc.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self.proc.log.count("reloaded ") + self.proc.log.count("reload rejected") == done:
            assert time.monotonic() < deadline, "no reload reported:\n" + self.proc.log
            time.sleep(0.01)

    def connect(self, subnqn: str = NQN, hostnqn: str = HOSTNQN, **kw: Any) -> Controller:
        kw.setdefault("nr_io_queues", 2)
        return connect("127.0.0.1", subnqn, self.port, provider="soft", hostnqn=hostnqn, **kw)


def base_config(tmp_path: pathlib.Path, port: int, **extra: Any) -> dict[str, Any]:
    config = {"listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
              "control_socket": str(tmp_path / "target.sock"),
              "subsystems": [{"nqn": NQN, "allow_any_host": True, "namespaces": [
                  {"nsid": 1, "backend": "ramdisk", "size": "16MiB"}]}]}
    config.update(extra)
    return config


@pytest.fixture
def start_service(tmp_path):
    """start_service(config, env=None) -> a running Service; stopped (and checked for
    tracebacks) at teardown."""
    started: list[TargetProc] = []

    def start(config: dict[str, Any], env: dict[str, str] | None = None) -> Service:
        proc = TargetProc(config, tmp_path, env=env)
        started.append(proc)
        proc.start()
        return Service(proc, config)

    yield start
    for proc in started:
        if proc.alive():
            proc.stop()
        assert "Traceback" not in proc.log, proc.log
