"""Reservations between hosts in network namespaces (target in B; hosts in A and B), each
host its own process with its own host ID: who may read and write under each type, a
preempt-and-abort that fences a host in the middle of its writes, and PTPL across a
target SIGKILL and restart."""

from __future__ import annotations

import pytest

from blockfabric.protocol.identify import CMIC_MULTI_CTRL, CMIC_MULTI_PORT

from .conftest import fence_a_writer, reset

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

CONFLICT = 0x083
KX, KY = 0xA1, 0xB2
# rtype: ((registrant y: read, write), (non-registrant z: read, write)), 0 = allowed;
# the holder x may always do both.
C = CONFLICT
TABLE = {
    1: ((0, C), (0, C)),
    2: ((C, C), (C, C)),
    3: ((0, 0), (0, C)),
    4: ((0, 0), (C, C)),
    5: ((0, 0), (0, C)),
    6: ((0, 0), (C, C)),
}


def probe(host, lba: int) -> tuple[int, int]:
    out = host.do("probe", lba=lba)
    return out["read"], out["write"]


def test_every_type_three_hosts(resv_lab):
    _target, x, y, z = resv_lab
    reset(x, y, z)
    gen0 = x.do("report")["report"]["gen"]
    assert x.do("register", nrkey=KX)["status"] == 0
    assert y.do("register", nrkey=KY)["status"] == 0
    for rtype, (reg, nonreg) in TABLE.items():
        assert x.do("acquire", crkey=KX, rtype=rtype)["status"] == 0
        assert probe(x, 1) == (0, 0), rtype
        assert (probe(y, 2), probe(z, 3)) == (reg, nonreg), rtype
        # another host cannot take it, nor release it for x
        assert y.do("acquire", crkey=KY, rtype=rtype)["status"] == \
            (0 if rtype in (5, 6) else CONFLICT), rtype
        assert z.do("acquire", crkey=0, rtype=rtype)["status"] == CONFLICT
        assert x.do("release", crkey=KX, rtype=rtype)["status"] == 0
        if rtype in (3, 4, 5, 6):       # "reservation released" for the other registrant
            assert y.do("log") | {"count": 0} == {
                "count": 0, "type": 2, "type_name": "reservation_released",
                "nr_pages": 0, "nsid": 1}, rtype
    report = x.do("report")["report"]
    assert (report["rtype"], report["regctl"], report["gen"] - gen0) == (0, 2, 2)
    assert {r["rkey"] for r in report["regctlext"]} == {KX, KY}
    assert len({r["hostid"] for r in report["regctlext"]}) == 2
    assert z.do("log")["type"] == 0                  # never registered: no notices


def test_one_subsystem_says_it_takes_many_controllers(resv_lab):
    """Identify Controller CMIC bit 1 (and bit 0) for every controller of the subsystem the
    three hosts share, no ANA bit without a gateway group: the Linux host refuses a second
    controller of a subsystem without bit 1 ("Subsystem does not support multiple
    controllers"), which kept a second kernel host identity from sharing a namespace
    (tests/lab/resv.sh)."""
    _target, *hosts = resv_lab
    ids = [h.do("identify") for h in hosts]
    assert len({i["cntlid"] for i in ids}) == 3, ids
    assert [i["cmic"] for i in ids] == [CMIC_MULTI_PORT | CMIC_MULTI_CTRL] * 3, ids


def test_preempt_and_abort_fences_a_writer(resv_lab):
    """x writes 256 blocks over and over, 32 in flight; y preempts and aborts x.  Once the
    preempt has answered, nothing of x lands: the region y reads then stays as it is."""
    _target, x, y, _z = resv_lab
    reset(x, y)
    assert x.register(KX) == 0 and y.register(KY) == 0
    assert x.do("acquire", crkey=KX, rtype=3)["status"] == 0   # registrants may write
    fence_a_writer(x, y)
    assert probe(x, 100) == (0, CONFLICT)               # write exclusive: x may only read
    assert x.do("log")["type"] == 1                      # registration preempted
    report = y.do("report")["report"]
    assert (report["rtype"], report["regctl"]) == (1, 1)
    assert report["regctlext"][0]["rkey"] == KY and report["regctlext"][0]["rcsts"] == 1


def test_ptpl_survives_sigkill_and_restart(resv_lab):
    target, x, y, _z = resv_lab
    reset(x, y)
    assert x.do("register", nrkey=KX, cptpl=3)["status"] == 0
    assert x.do("acquire", crkey=KX, rtype=1)["status"] == 0
    before = x.do("report")["report"]
    assert before["ptpls"] == 1
    target.kill()
    target.start()
    assert probe(x, 1) == (0, 0)          # held through the restart, then served
    assert x.do("report")["report"] == before
    assert probe(y, 2) == (0, CONFLICT)
    # (without PTPL a restart forgets it: tests/target/test_reservations.py, FileStore)
    assert x.do("register", nrkey=KX, cptpl=2)["status"] == 0
