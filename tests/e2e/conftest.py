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
from typing import Any

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


class TargetProc:
    """``blockfabric-target run`` in a subprocess, with its stderr collected."""

    def __init__(self, config: dict[str, Any], tmp: pathlib.Path, netns: str | None = None,
                 env: dict[str, str] | None = None, command: list[str] | None = None) -> None:
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


def ram_config(port: int, address: str = "127.0.0.1", **subsystem: Any) -> dict[str, Any]:
    sub = {"nqn": NQN, "allow_any_host": True,
           "namespaces": [{"nsid": 1, "backend": "ramdisk", "size": "64MiB"}]}
    sub.update(subsystem)
    return {"listeners": [{"provider": "soft", "address": address, "port": port}],
            "subsystems": [sub]}


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
        if proc.alive():
            proc.stop()
        assert "Traceback" not in proc.log, proc.log


@pytest.fixture(scope="module")
def module_ram_target(tmp_path_factory):
    """One ramdisk target shared by a whole test module (a target start costs ~0.5 s)."""
    port = free_port()
    proc = TargetProc(ram_config(port), tmp_path_factory.mktemp("target")).start()
    proc.port = port
    yield proc
    if proc.alive():
        proc.stop()
    assert "Traceback" not in proc.log, proc.log


@pytest.fixture
def ram_target(start_target):
    port = free_port()
    proc = start_target(ram_config(port))
    proc.port = port
    return proc
