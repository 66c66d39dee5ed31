"""Reservation fixtures: a file-backed target in namespace B, and hosts (agent.py
processes, each its own host NQN and host ID) in namespace A or B."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from e2e.conftest import NQN, free_port  # noqa: F401
from faults.conftest import Restartable, file_config
from helpers.netns import netns_pair  # noqa: F401

AGENT = pathlib.Path(__file__).with_name("agent.py")


class Host:
    """One agent: ``host.do(op, **fields)`` returns its JSON answer."""

    def __init__(self, name: str, netns: str, traddr: str, port: int) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), "--netns", netns, "--traddr", traddr,
             "--port", str(port), "--nqn", NQN, "--name", name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def do(self, op: str, **fields: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"host {self.name} died: {self.proc.stderr.read()}")
        out = json.loads(line)
        assert "error" not in out, (self.name, op, out)
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.do("quit")
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def resv_lab(netns_pair, tmp_path):
    """(target, hosts(*names)): a file-volume target in namespace B; ``hosts`` starts agents,
    the first two in A, a third in B (on B's address), all stopped at teardown."""
    port = 4420 + free_port() % 1000
    addr = netns_pair.ipv4[1]
    target = Restartable(file_config(port, tmp_path / "vol.img", addr), tmp_path,
                         netns=netns_pair.names[1])
    started: list[Host] = []

    def hosts(*names: str) -> list[Host]:
        spaces = [netns_pair.names[0], netns_pair.names[0], netns_pair.names[1]]
        new = [Host(n, spaces[i % 3], addr, port) for i, n in enumerate(names)]
        started.extend(new)
        return new

    yield target, hosts
    for h in started:
        h.close()
    target.stop()
    assert "Traceback" not in target.log, target.log
