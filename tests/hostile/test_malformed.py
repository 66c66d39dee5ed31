"""A malicious host's capsules, each sent while another host verifies its data: every one
gets its documented status (or, for a forged key, loses only the attacker's queue), the
target stays up and the bystander sees no error and no wrong byte."""

from __future__ import annotations

import time

import pytest

from blockfabric.initiator.host import QueueDead, connect
from blockfabric.protocol import IOOpcode, KeyedSGL, OffsetSGL, ReadWrite, StatusCode

from .conftest import (HOSTNQN, MAX_CONN, NQN, TargetProbe, addr_of, assert_answers,
                       assert_undisturbed, attacker_of, via)

MiB = 1 << 20
BS = 4096
MDTS = MiB              # the target's default limits.mdts


@pytest.fixture(params=(1, 2), ids=lambda n: f"{n}r")
def target_reactors(request) -> int:
    """Every test here with one poll group and with two (an attacker's NVMe/TCP I/O queues
    in a worker process)."""
    return request.param


def keyed(ctrl, opcode: IOOpcode, nlb: int, length: int, key: int | None = None) -> bytes:
    mr = ctrl.arena.mr
    return ReadWrite(opcode, 1, 0, nlb).to_sqe(
        sgl=KeyedSGL(mr.addr, length, mr.rkey if key is None else key)).pack()


#: (name, capsule builder, expected status); every one with DNR set
ATTACKS = [
    ("sgl shorter than the blocks", lambda c: keyed(c, IOOpcode.READ, 1, BS),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("sgl longer than the blocks", lambda c: keyed(c, IOOpcode.WRITE, 0, 2 * BS),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("length beyond MDTS", lambda c: keyed(c, IOOpcode.READ, 2 * MDTS // BS - 1, 2 * MDTS),
     StatusCode.INVALID_FIELD),
    ("16 MiB - 1 keyed length, read", lambda c: keyed(c, IOOpcode.READ, 0, (16 * MiB) - 1),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("16 MiB - 1 keyed length, write", lambda c: keyed(c, IOOpcode.WRITE, 0, (16 * MiB) - 1),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("length 0, read", lambda c: keyed(c, IOOpcode.READ, 0, 0),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("length 0, write", lambda c: keyed(c, IOOpcode.WRITE, 0, 0),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("in-capsule data on a read", lambda c: ReadWrite(IOOpcode.READ, 1, 0, 0).to_sqe(
        sgl=OffsetSGL(0, BS)).pack() + bytes(BS), StatusCode.INVALID_FIELD),
]


@pytest.mark.timeout(60)
def test_malformed_capsules_get_their_status(target, transport, bystander):
    probe = TargetProbe(target)
    with attacker_of(target, bystander, "malformed capsules", transport) as attacker:
        assert_answers(attacker, ATTACKS, 20)
        ns = attacker.namespaces[1]
        # The attacker's queue still works, on a block outside the bystander's region (its
        # verify load owns blocks 0-255: a write there read back as the bystander's mismatch).
        ns.write(1003 * BS, b"\xa5" * BS)
        assert ns.read(1003 * BS, BS) == b"\xa5" * BS
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    probe.assert_bounded()


@pytest.mark.timeout(60)
def test_forged_key_costs_only_the_attackers_queue(target, bystander):
    """A write whose SGL names a key the attacker never registered: the target's RDMA READ
    fails with a remote access error, and that queue (only) is torn down."""
    with connect(addr_of(), NQN, target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1, ctrl_loss_tmo=0) as attacker:
        queue = attacker.io_queues[0]
        forged = attacker.arena.mr.rkey ^ 0x5A5A5A
        with pytest.raises(QueueDead):
            attacker.raw(queue, keyed(attacker, IOOpcode.WRITE, 0, BS, key=forged))
        assert target.wait_log("REM_ACCESS_ERR", 5) or target.wait_log("RDMA READ", 5), \
            target.log
    time.sleep(0.5)
    assert_undisturbed(bystander.finish())
    assert target.alive()


@pytest.mark.timeout(60)
def test_controller_flood_is_refused_past_the_per_host_limit(target, bystander):
    """Whole controllers (admin + one I/O queue each) from the bystander's own address: the
    connections beyond ``max_connections_per_host`` get CM reject NO_RESOURCES; the
    bystander's live queues are not touched."""
    ctrls = []
    try:
        with pytest.raises(ConnectionRefusedError, match="NO_RESOURCES"):
            for _ in range(MAX_CONN):
                ctrls.append(connect(addr_of(), NQN, target.port, **via(),
                                     hostnqn=HOSTNQN, nr_io_queues=1, ctrl_loss_tmo=0))
        # the bystander holds 2 of the 6 connections, so exactly 2 controllers fit
        assert len(ctrls) == (MAX_CONN - 2) // 2, len(ctrls)
    finally:
        for c in ctrls:
            c.close()
    assert_undisturbed(bystander.finish())
    assert target.alive()
