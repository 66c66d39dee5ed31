"""Reservations through a gateway group: two target daemons export one RBD image, and the
reservation state lives in RADOS (blockfabric.target.resvstore.RadosStore).  Hosts are
agent processes (tests/resv/agent.py) on loopback, as the gateways are (the throwaway
cluster is not reachable from a network namespace): x through gateway A, y through B."""

from __future__ import annotations

import uuid

import pytest

from ceph.test_gateway import NQN, _image, _remove, gateway_config
from e2e.conftest import TargetProc, free_port
from resv.conftest import Host, fence_a_writer

pytestmark = pytest.mark.timeout(120)
CONFLICT = 0x083
KX, KY = 0xA1, 0xB2
REGION = 256


@pytest.fixture
def pair(ceph, tmp_path):
    image = _image(ceph)
    group = f"r{uuid.uuid4().hex[:6]}"
    ports = free_port(), free_port()
    procs = [TargetProc(gateway_config(ceph, [image], ports[0], "gw-a", group, (1, 99), [1]),
                        tmp_path).start(),
             TargetProc(gateway_config(ceph, [image], ports[1], "gw-b", group, (100, 199), []),
                        tmp_path).start()]
    hosts = [Host("x", None, "127.0.0.1", ports[0], NQN).connected(),
             Host("y", None, "127.0.0.1", ports[1], NQN).connected()]
    yield hosts, procs
    for h in hosts:
        h.close()
    for p in procs:
        p.stop()
        assert "Traceback" not in p.log, p.log
    _remove(ceph, image)


def test_state_identical_through_two_gateways_and_fencing_across_them(pair):
    (x, y), _procs = pair
    assert x.register(KX) == 0                                       # through A
    assert x.do("acquire", crkey=KX, rtype=1)["status"] == 0
    seen_a, seen_b = x.do("report")["report"], y.do("report")["report"]
    assert seen_a == seen_b and (seen_b["gen"], seen_b["rtype"], seen_b["regctl"]) == (1, 1, 1)
    assert y.do("probe", lba=2) == {"read": 0, "write": CONFLICT}     # B knows it at once
    assert y.register(KY) == 0                                       # through B
    assert y.do("acquire", crkey=KY, rtype=1)["status"] == CONFLICT   # A's x holds it
    assert x.do("report")["report"]["regctl"] == 2                    # A knows y
    # x (on A) writes at depth 32; y (on B) preempts and aborts it: once that has
    # answered, nothing of x lands, through either gateway
    assert x.do("acquire", crkey=KX, rtype=5, racqa=1, prkey=KX)["status"] == 0
    after = fence_a_writer(x, y, REGION)
    assert x.do("read", lba=0, blocks=REGION)["sha256"] == after       # through A too
    assert x.do("log")["type"] == 1                                   # preempted, on A
    seen_a, seen_b = x.do("report")["report"], y.do("report")["report"]
    # all registrants (5) with PRKEY x's key: x unregistered, the type stays (nvmet)
    assert seen_a == seen_b and (seen_a["rtype"], seen_a["regctl"]) == (5, 1)
    assert x.do("probe", lba=300) == {"read": 0, "write": CONFLICT}
