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
from blockfabric.net import netns_pair as _netns_pair
from helpers.netns import require_netns

AGENT = pathlib.Path(__file__).with_name("agent.py")


class Host:
    """One agent: ``host.do(op, **fields)`` returns its JSON answer."""

    def __init__(self, name: str, netns: str | None, traddr: str, port: int,
                 nqn: str = NQN, transport: str = "rdma") -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(AGENT), *(["--netns", netns] if netns else []),
             "--traddr", traddr, "--port", str(port), "--nqn", nqn, "--name", name,
             "--transport", transport],
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


@pytest.fixture(scope="module", params=[("rdma", 1), ("tcp", 2)],
                ids=lambda p: f"{p[0]}-{p[1]}r")
def resv_lab(tmp_path_factory, request):
    """(target, x, y, z) for a whole module: a file-volume target in namespace B; hosts x
    and y in A, z in B (on B's address).  Tests start from :func:`reset`.  Once over the
    soft provider with one poll group, once over NVMe/TCP with two: each host's two I/O
    queues are then in different groups (processes), and the reservation must hold in
    both."""
    require_netns()
    transport, reactors = request.param
    tmp = tmp_path_factory.mktemp("resv")
    with _netns_pair("bfr") as pair:
        port = 4420 + free_port() % 1000
        addr = pair.ipv4[1]
        target = Restartable(file_config(port, tmp / "vol.img", addr, transport=transport,
                                         reactors=reactors), tmp, netns=pair.names[1])
        hosts = [Host(n, pair.names[i // 2], addr, port, transport=transport)
                 for i, n in enumerate("xyz")]
        try:
            yield (target, *[h.connected() for h in hosts])
        finally:
            for h in hosts:
                h.close()
            target.stop()
        assert "Traceback" not in target.log, target.log


def reset(x: Host, *others: Host) -> None:
    """No registrant, no reservation, every host's notification log read empty."""
    assert x.do("register", nrkey=0xEE, rrega=2, iekey=True)["status"] == 0
    assert x.do("release", crkey=0xEE, rrela=1)["status"] == 0
    for h in (x, *others):
        while h.do("log")["type"]:
            pass
