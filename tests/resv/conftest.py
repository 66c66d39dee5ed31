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

    def __init__(self, name: str, netns: str | None, traddr: str, port: int,
                 nqn: str = NQN) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), *(["--netns", netns] if netns else []),
             "--traddr", traddr, "--port", str(port), "--nqn", nqn, "--name", name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def register(self, key: int, **fields: Any) -> int:
        """Register ``key`` (kept as ``.key``): the status."""
        self.key = key
        return self.do("register", nrkey=key, **fields)["status"]

    def connected(self) -> Host:
        """Wait for the agent's Connect (its first line)."""
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"host {self.name} did not connect: {self.proc.stderr.read()}")
        assert "connected" in json.loads(line), line
        return self

    def do(self, op: str, **fields: Any) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
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


def fence_a_writer(x: Host, y: Host, blocks: int = 256, depth: int = 32) -> str:
    """x writes ``blocks`` blocks over and over (32 a command, ``depth`` in flight) until
    100 writes have landed; y (registered) preempts and aborts x's key.  Returns the
    region's SHA-256 as y read it at once after the preempt answered, once x's writes
    have all answered and y reads the same again (nothing of x landed after it)."""
    x.do("hammer", lba=0, blocks=blocks, depth=depth, size=32)
    x.do("wait_hammer", ok=100)
    assert y.do("acquire", crkey=y.key, prkey=x.key, rtype=1, racqa=2)["status"] == 0
    after = y.do("read", lba=0, blocks=blocks)["sha256"]
    counts = x.do("stop")
    assert counts["ok"] >= 100 and counts["conflicts"] > 0 and counts["other"] == 0, counts
    assert y.do("read", lba=0, blocks=blocks)["sha256"] == after
    return after


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
        return [h.connected() for h in new]

    yield target, hosts
    for h in started:
        h.close()
    target.stop()
    assert "Traceback" not in target.log, target.log
