"""Input hygiene against a live target (issue 13, class 6): NQNs that are not NQNs (a newline
that would forge a log line, bytes that are not UTF-8 and made ``/metrics`` answer 503, too
long, unterminated, control characters, the wrong form) are refused at Connect with
CONNECT_INVALID_PARAM pointing at the field; what is logged of them is escaped; ``/metrics``
and ``status`` keep answering; and the discovery controller refuses I/O queues (each command
on one used to raise an internal error)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from blockfabric.protocol import DISCOVERY_NQN, ConnectData, Property, StatusCode
from blockfabric.protocol.fabrics import IPO_DATA_HOSTNQN, IPO_DATA_SUBNQN, IPO_SQE_QID

from e2e.conftest import BIN
from .attacker import admin_queue, attacker, raw_connect
from .conftest import (HOSTNQN, MAX_CONN, NQN, TargetProbe, assert_accepts_new_host,
                       assert_undisturbed, free_port, ram_config)


@pytest.fixture(params=(1, 2), ids=lambda n: f"{n}r")
def target_reactors(request) -> int:
    """Every test here with one poll group and with two (NVMe/TCP I/O queues in a
    worker process: resources at rest there too)."""
    return request.param


FORGED = "ERROR blockfabric.target: FORGED by the peer"
BAD = "nqn.2026-12.io.x:"

#: (name, subsystem NQN, host NQN, IPO of the refused field)
CASES = [
    ("newline in the host NQN", NQN, f"{BAD}a\n{FORGED}", IPO_DATA_HOSTNQN),
    ("carriage return", NQN, f"{BAD}a\r{FORGED}", IPO_DATA_HOSTNQN),
    ("not UTF-8", NQN, f"{BAD}\udcff\udcfe\udc80", IPO_DATA_HOSTNQN),
    ("terminal escape", NQN, f"{BAD}\x1b]0;owned\x07\x1b[2J", IPO_DATA_HOSTNQN),
    ("right-to-left override", NQN, f"{BAD}\u202egnp.", IPO_DATA_HOSTNQN),
    ("224 bytes", NQN, BAD + "a" * 207, IPO_DATA_HOSTNQN),
    ("256 bytes, no NUL", NQN, BAD + "a" * 239, IPO_DATA_HOSTNQN),
    ("empty host NQN", NQN, "", IPO_DATA_HOSTNQN),
    ("not nqn. form", NQN, "host-1", IPO_DATA_HOSTNQN),
    ("white space", NQN, f"{BAD}a b", IPO_DATA_HOSTNQN),
    ("UUID form without a UUID", NQN, "nqn.2014-08.org.nvmexpress:uuid:any",
     IPO_DATA_HOSTNQN),
    ("newline in the subsystem NQN", f"{NQN}\n{FORGED}", HOSTNQN, IPO_DATA_SUBNQN),
    ("subsystem NQN not UTF-8", NQN + "\udcc3", HOSTNQN, IPO_DATA_SUBNQN),
    ("subsystem NQN 256 bytes", BAD + "s" * 239, HOSTNQN, IPO_DATA_SUBNQN),
]


@pytest.fixture
def target(start_target, tmp_path):
    """The hostile suite's target, with metrics and a control socket to scrape."""
    port, metrics = free_port(), free_port()
    config = ram_config(port)
    # connect_timeout: an attacker's queue makes its refused Connects for longer than the
    # default 10 s where everything is slow (the verbs suites under TCG), and the target
    # would end it for never connecting, which is not what these tests look at
    config["limits"] = {"max_connections_per_host": MAX_CONN, "connect_timeout": 120}
    config["metrics"] = {"port": metrics}
    config["control_socket"] = str(tmp_path / "control.sock")
    proc = start_target(config)
    proc.port, proc.metrics, proc.socket = port, metrics, config["control_socket"]
    return proc


def scrape(target) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{target.metrics}/metrics",
                                timeout=5) as answer:
        assert answer.status == 200
        return answer.read().decode()


def status(target) -> dict:
    out = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", target.socket,
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    text = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket",
                           target.socket], capture_output=True, text=True, timeout=20)
    assert text.returncode == 0 and "controllers:" in text.stdout, text.stderr
    return json.loads(out.stdout)


@pytest.mark.timeout(60)
def test_hostile_nqns_are_refused_with_their_status(target, bystander):
    probe = TargetProbe(target)
    ctrl = attacker(target.port, NQN, HOSTNQN)
    try:
        with bystander.attack("hostile NQNs at Connect"):
            queue = admin_queue(ctrl)
            for _ in range(3):
                for name, subnqn, hostnqn, ipo in CASES:
                    data = ConnectData(hostid=bytes(range(16)), subnqn=subnqn, hostnqn=hostnqn)
                    got = raw_connect(ctrl, queue, data)
                    assert got == (StatusCode.CONNECT_INVALID_PARAM, True, 1 << 16 | ipo), \
                        (name, got)
                assert "blockfabric_up 1" in scrape(target)
            assert len(status(target)["controllers"]) == 1     # the bystander's only
            # the same queue then connects with good NQNs: only the bad Connects failed
            good = raw_connect(ctrl, queue, ConnectData(hostid=bytes(range(16)), subnqn=NQN,
                                                        hostnqn=HOSTNQN))
            assert good[0] == StatusCode.SUCCESS, good
    finally:
        ctrl.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    assert not [line for line in target.lines if line.startswith(FORGED)]
    refused = [line for line in target.lines if line.startswith("INFO ")
               and "connect refused" in line]
    assert len(refused) >= 3 * len(CASES), refused[-3:]
    assert any(f"hostnqn={BAD}a\\n{FORGED}" in line for line in refused)   # escaped
    assert any(f"hostnqn={BAD}\\xff\\xfe\\x80" in line for line in refused)
    assert all(line.isprintable() for line in "".join(target.lines).splitlines())
    probe.assert_bounded()
    assert_accepts_new_host(target.port)


@pytest.mark.timeout(60)
def test_discovery_controller_refuses_io_queues(target, bystander):
    """Connect on qid 1 to the discovery controller: CONNECT_INVALID_PARAM with IATTR 0
    (the SQE) and IPO 42 (its qid), as nvmet; the discovery controller itself carries on."""
    probe = TargetProbe(target)
    ctrl = attacker(target.port, DISCOVERY_NQN, HOSTNQN)
    try:
        with bystander.attack("I/O queue on the discovery controller"):
            admin = admin_queue(ctrl)
            got = raw_connect(ctrl, admin, ConnectData(hostid=bytes(16), subnqn=DISCOVERY_NQN,
                                                       hostnqn=HOSTNQN))
            assert got[0] == StatusCode.SUCCESS, got
            ctrl.cntlid = got[2] & 0xFFFF
            ctrl._enable()
            ctrl.inline_size = 0
            io = ctrl.open_queue(1, 16)
            ctrl.io_queues.append(io)
            for _ in range(10):
                got = raw_connect(ctrl, io, ConnectData(hostid=bytes(16), cntlid=ctrl.cntlid,
                                                        subnqn=DISCOVERY_NQN, hostnqn=HOSTNQN),
                                  qid=1, sqsize=15)
                assert got == (StatusCode.CONNECT_INVALID_PARAM, True, IPO_SQE_QID), got
            assert ctrl.property_get(Property.CSTS, 4) & 1      # still there, still ready
    finally:
        ctrl.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert "internal error" not in target.log and "Traceback" not in target.log
    probe.assert_bounded()
    assert_accepts_new_host(target.port)
