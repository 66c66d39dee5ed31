"""Faults between two network namespaces (target in B, host in A, joined by veth), while a
verify load runs in A: the link taken down and up, and packets dropped with nftables in B
(this kernel has no tc netem; nf_tables is built in).  Outcome: no error, no wrong byte,
and the host's counters show the I/O was held and re-issued (for the partitions)."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from .conftest import HOSTNQN, NQN, Restartable, file_config, free_port

pytestmark = [pytest.mark.netns, pytest.mark.timeout(90), pytest.mark.needs_transport(
    "rdma", "network namespaces joined by veth: the lab's rxe0 is in the guest's root namespace")]
LOAD = pathlib.Path(__file__).with_name("verifyload.py")


@pytest.fixture
def lab(netns_pair, tmp_path):
    """(pair, target): the target in namespace B on B's address."""
    port = 4420 + free_port() % 1000
    target = Restartable(file_config(port, tmp_path / "vol.img", netns_pair.ipv4[1]),
                         tmp_path, netns=netns_pair.names[1])
    target.port = port
    yield netns_pair, target
    target.stop()
    assert "Traceback" not in target.log, target.log


def start_load(pair, port: int, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(LOAD), "--netns", pair.names[0], "--traddr", pair.ipv4[1],
         "--port", str(port), "--nqn", NQN, "--hostnqn", HOSTNQN, "--seconds", str(seconds),
         "--threads", "4", "--kato", "1", "--reconnect-delay", "0.5", "--ctrl-loss-tmo", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "connected" in proc.stderr.readline()
    return proc


def finish(proc: subprocess.Popen) -> dict:
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out, err
    result = json.loads(out)
    assert result["errors"] == 0 and result["mismatches"] == 0, result
    assert result["ios"] > 50, result
    print(f"\nobserved: ios {result['ios']} errors 0 mismatches 0 recovery "
          f"{result['recovery']}")                        # for docs/reliability.md (pytest -s)
    return result


def ns_run(ns: str, *argv: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *argv], check=True, capture_output=True,
                   timeout=10)


def test_link_down_and_up(lab):
    pair, target = lab
    load = start_load(pair, target.port, 6)
    time.sleep(1.0)
    ns_run(pair.names[0], "ip", "link", "set", pair.ifnames[0], "down")
    time.sleep(2.0)                                 # past KATO: the host notices
    ns_run(pair.names[0], "ip", "link", "set", pair.ifnames[0], "up")
    rec = finish(load)["recovery"]
    assert rec["reconnects"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, rec


@pytest.mark.skipif(shutil.which("nft") is None, reason="nft missing (Debian nftables)")
@pytest.mark.parametrize("rule,expect_reconnect", [
    ("numgen random mod 100 < 10 drop", False),     # 10% loss: TCP retransmits, no loss
    ("drop", True),                                  # a partition for 2.5 s
])
def test_packet_drop_with_nftables(lab, rule, expect_reconnect):
    pair, target = lab
    b = pair.names[1]
    ns_run(b, "nft", "add", "table", "inet", "bffault")
    ns_run(b, "nft", "add chain inet bffault in { type filter hook input priority 0 ; }")
    load = start_load(pair, target.port, 6)
    time.sleep(1.0)
    ns_run(b, "nft", f"add rule inet bffault in tcp dport {target.port} {rule}")
    time.sleep(2.5)
    ns_run(b, "nft", "flush", "chain", "inet", "bffault", "in")
    rec = finish(load)["recovery"]
    if expect_reconnect:
        assert rec["reconnects"] >= 1 and rec["held"] >= 1 and rec["retried"] >= 1, rec
