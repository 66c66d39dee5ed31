"""The Ceph user a gateway runs as, on a cluster with cephx on: with exactly the caps
docs/ceph.md tells operators to give it (read from that file, so the two cannot drift), two
gateways serve I/O, hold and hand over their ANA group leases (lock, xattr, watch/notify on
the group's RADOS objects) and share reservations (the RADOS store); with too few caps
(read-only) a gateway refuses to start at once, saying so, instead of hanging."""

from __future__ import annotations

import pathlib
import re
import subprocess
import uuid

import pytest

from ceph.test_gateway import NQN, gateway_config, start_refused, states, wait_for
from e2e.conftest import HOSTNQN, TargetProc, free_port
from initiator.host import connect
from resv.conftest import Host
from blockfabric.protocol.logpages import AnaState

pytestmark = pytest.mark.timeout(120)
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "ceph.md"
CONFLICT = 0x083


def documented_caps(pool: str) -> list[str]:
    """The caps of the `ceph auth get-or-create` in docs/ceph.md, for ``pool``."""
    m = re.search(r"ceph auth get-or-create client\.blockfabric \\\n\s+mon '([^']+)' "
                  r"osd '([^']+)'", DOC.read_text())
    assert m, "docs/ceph.md has no `ceph auth get-or-create client.blockfabric` with caps"
    return ["mon", m.group(1), "osd", m.group(2).replace("pool=rbd", f"pool={pool}")]


def as_user(conf: dict, client: str, keyring: str) -> dict:
    for ns in conf["subsystems"][0]["namespaces"]:
        ns["rbd"].update(client=client, keyring=keyring)
    return conf


def test_two_gateways_with_the_documented_caps(ceph_cephx, tmp_path):
    ceph = ceph_cephx
    keyring = ceph.user("bfgw", documented_caps(ceph.pool))
    image = f"gw-{uuid.uuid4().hex[:8]}"
    ceph.rbd("create", "--size", "32M", "--image-feature", "layering", f"{ceph.pool}/{image}")
    group, ports = f"x{uuid.uuid4().hex[:6]}", (free_port(), free_port())
    confs = [as_user(gateway_config(ceph, [image], ports[0], "gw-a", group, (1, 99), [1]),
                     "client.bfgw", keyring),
             as_user(gateway_config(ceph, [image], ports[1], "gw-b", group, (100, 199), []),
                     "client.bfgw", keyring)]
    procs = [TargetProc(c, tmp_path).start() for c in confs]
    hosts: list[Host] = []
    try:
        with connect("127.0.0.1", NQN, ports[1], provider="soft", hostnqn=HOSTNQN) as b:
            # the lease: A owns group 1, B reports it non-optimized
            wait_for(lambda: states(b) == {1: AnaState.NON_OPTIMIZED}, 10, "A owns group 1")
            b.namespaces[1].write(8192, b"c" * 8192)                    # I/O as the user
            assert b.namespaces[1].read(8192, 8192) == b"c" * 8192
            # reservations through the RADOS store, seen across the gateways (notify)
            hosts = [Host("x", None, "127.0.0.1", ports[0], NQN).connected(),
                     Host("y", None, "127.0.0.1", ports[1], NQN).connected()]
            x, y = hosts
            assert x.register(0xA1) == 0
            assert x.do("acquire", crkey=0xA1, rtype=1)["status"] == 0
            assert y.do("probe", lba=2) == {"read": 0, "write": CONFLICT}
            x.close()
            # failover state: A stops (planned: it unlocks and notifies), B takes group 1
            events: list = []
            b.ana_listeners.append(lambda _c, log: events.append(log))
            procs[0].stop()
            wait_for(lambda: states(b) == {1: AnaState.OPTIMIZED}, 10, "B takes group 1")
            assert events
    finally:
        for h in hosts:
            h.close()
        for p in procs:
            p.stop()
            assert "Traceback" not in p.log, p.log
    for p in procs:
        for bad in ("ermission", "EPERM", "EACCES"):
            assert bad not in p.log, p.log


def test_too_few_caps_refuse_to_start_at_once(ceph_cephx, tmp_path):
    ceph = ceph_cephx
    keyring = ceph.user("bfro", ["mon", "profile rbd", "osd",
                                 f"profile rbd-read-only pool={ceph.pool}"])
    image = f"gw-{uuid.uuid4().hex[:8]}"
    ceph.rbd("create", "--size", "16M", "--image-feature", "layering", f"{ceph.pool}/{image}")
    conf = as_user(gateway_config(ceph, [image], free_port(), "gw-r", f"r{uuid.uuid4().hex[:6]}",
                                  (1, 9), [1]), "client.bfro", keyring)
    out, took = start_refused(tmp_path, conf)
    # not librados' 300 s default: a permission error is answered at once (the rest is the
    # daemon's start, 10 s and more on a loaded 2-core machine)
    assert took < 30, (took, out.stderr)
    last = out.stderr.strip().splitlines()[-1]
    assert f"{ceph.pool}/{image}" in last and "client.bfro" in last, out.stderr
    assert "permission error" in last and "it needs mon 'profile rbd' osd 'profile rbd " \
        f"pool={ceph.pool}'" in last, out.stderr
    print(f"\nread-only caps: refused in {took:.2f} s: {last}")


def test_a_coordination_pool_outside_the_caps_is_refused_at_start(ceph_cephx, tmp_path):
    """Images in pool rbd (covered by the caps), the group's objects in another pool (not):
    the gateway does not start, and says which pool its user needs caps on."""
    ceph = ceph_cephx
    subprocess.run(["ceph", "--conf", ceph.conf, "osd", "pool", "create", "gwq", "8"],
                   check=True, capture_output=True, timeout=30)
    keyring = ceph.user("bfgq", documented_caps(ceph.pool))
    image = f"gw-{uuid.uuid4().hex[:8]}"
    ceph.rbd("create", "--size", "16M", "--image-feature", "layering", f"{ceph.pool}/{image}")
    conf = as_user(gateway_config(ceph, [image], free_port(), "gw-q", f"q{uuid.uuid4().hex[:6]}",
                                  (1, 9), [1]), "client.bfgq", keyring)
    conf["gateway"]["ceph"] = {"pool": "gwq", "ceph_conf": ceph.conf, "client": "client.bfgq",
                               "keyring": keyring}
    out, took = start_refused(tmp_path, conf)
    assert took < 30, (took, out.stderr)
    last = out.stderr.strip().splitlines()[-1]
    assert "gateway gw-q: Ceph pool gwq" in last and "as client.bfgq" in last and \
        "osd 'profile rbd pool=gwq'" in last, out.stderr
