"""Malformed reservation commands from a hostile host, while another host verifies its
data: each gets its status with DNR, nothing is reserved by them, the target's memory
stays bounded (a Report's NUMD asks for up to 16 GiB) and the bystander sees no error."""

from __future__ import annotations

import pytest

from blockfabric.initiator import resv
from blockfabric.protocol import KeyedSGL, StatusCode
from blockfabric.protocol import resv as resv_protocol
from blockfabric.protocol.capsule import SQE

from .conftest import TargetProbe, assert_answers, assert_undisturbed, attacker_of

MiB = 1 << 20


def capsule(ctrl, opcode: int, length: int, *, nsid: int = 1, cdw10: int = 0,
            cdw11: int = 0) -> bytes:
    mr = ctrl.arena.mr
    return SQE(opcode=opcode, nsid=nsid, cdw10=cdw10, cdw11=cdw11,
               sgl=KeyedSGL(mr.addr, length, mr.rkey)).pack()


def report(numd: int, length: int, eds: bool = True):
    return lambda c: capsule(c, resv_protocol.OP_REPORT, length, cdw10=numd, cdw11=int(eds))


ATTACKS = [
    ("report: NUMD for 16 GiB", report(0xFFFFFFFF, 4096), StatusCode.SGL_DATA_LENGTH_INVALID),
    ("report: 2 MiB, past MDTS", report(2 * MiB // 4 - 1, 2 * MiB), StatusCode.INVALID_FIELD),
    ("report: SGL shorter than NUMD", report(1023, 64), StatusCode.SGL_DATA_LENGTH_INVALID),
    ("report: without EDS", report(1023, 4096, eds=False), StatusCode.HOST_ID_INCONSISTENT),
    ("report: 32 bytes", report(7, 32), StatusCode.INVALID_FIELD),
    ("register: 4 bytes of keys", lambda c: capsule(c, resv_protocol.OP_REGISTER, 4),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("register: action 7", lambda c: capsule(c, resv_protocol.OP_REGISTER, 16, cdw10=7),
     StatusCode.INVALID_OPCODE),
    ("register: CPTPL 1 (reserved)",
     lambda c: capsule(c, resv_protocol.OP_REGISTER, 16, cdw10=1 << 30),
     StatusCode.INVALID_FIELD),
    ("register: PTPL on a ramdisk",
     lambda c: capsule(c, resv_protocol.OP_REGISTER, 16, cdw10=3 << 30),
     StatusCode.INVALID_FIELD),
    ("acquire: rtype 0xff", lambda c: capsule(c, resv_protocol.OP_ACQUIRE, 16, cdw10=0xFF << 8),
     StatusCode.INVALID_FIELD),
    ("acquire: not registered", lambda c: capsule(c, resv_protocol.OP_ACQUIRE, 16, cdw10=1 << 8),
     StatusCode.RESERVATION_CONFLICT),
    ("release: IEKEY", lambda c: capsule(c, resv_protocol.OP_RELEASE, 16, cdw10=1 << 3),
     StatusCode.INVALID_FIELD),
    ("release: every namespace",
     lambda c: capsule(c, resv_protocol.OP_RELEASE, 16, nsid=0xFFFFFFFF),
     StatusCode.INVALID_NS),
]


@pytest.mark.timeout(60)
def test_malformed_reservation_commands(target, transport, bystander):
    probe = TargetProbe(target)
    with attacker_of(target, bystander, "malformed reservation commands",
                     transport) as attacker:
        assert_answers(attacker, ATTACKS, 10)
        state = resv.report(attacker.namespaces[1])
        assert (state.rtype, state.regctl, state.gen) == (0, 0, 0)
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    probe.assert_bounded()
