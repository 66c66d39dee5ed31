"""The target's Read/Write fast path, without sockets: a TargetQueue over a stand-in QP and a
real Controller over ramdisks.

* every capsule the queue decodes on ints (protocol.rw) gets exactly what the full decode
  (SQE.unpack_from, then the in-capsule checks) gives: the same refusal status and cid, or
  the same command fields;
* a slot's work requests are made once and reused (fields updated, never new objects);
* the controller's Read/Write checks answer the statuses nvmet does, in its order, and move
  data straight to and from the volume's memory.
"""

from __future__ import annotations

import itertools
import random
import struct

import pytest

from blockfabric.fabric.endpoint import INDEX_MASK, KIND_READ, KIND_RECV, KIND_SEND, KIND_SHIFT
from blockfabric.fabric.target_side import TargetQueue, data_direction
from blockfabric.protocol import SQE, OffsetSGL, ProtocolError, StatusCode
from blockfabric.protocol.capsule import pack_cqe_into
from blockfabric.protocol.controller import ControllerState, Phase
from blockfabric.protocol.rw import CQE_FIELDS, keyed_word, offset_word, pack_rw_into
from blockfabric.rdma import WC, SendWR, WcOpcode, WcStatus, WrOpcode
from blockfabric.rdma.base import QP
from blockfabric.rdma.soft.device import SoftContext
from blockfabric.target import config as cfg
from blockfabric.target.controller import Controller
from blockfabric.target.server import Target

INLINE = 4096
DEPTH = 8


class StandInQP:
    """Records what is posted: (the WR object, its fields at post time)."""

    max_unsent = 0

    def __init__(self) -> None:
        self.posted: list[tuple[SendWR, tuple]] = []
        self.recv_posts = 0

    def post_send(self, wrs) -> None:
        for wr in [wrs] if isinstance(wrs, SendWR) else wrs:
            sges = tuple((s.addr, s.length, s.lkey) for s in wr.sg_list)
            self.posted.append((wr, (wr.wr_id, wr.opcode, sges, wr.remote_addr, wr.rkey,
                                     wr.invalidate_rkey)))

    def post_recv(self, wrs) -> None:
        self.recv_posts += 1

    # the base class's: the WRITE's SGE and remote address aimed, then post_send
    post_write_send = QP.post_write_send


class StandInCMId:
    def __init__(self, context) -> None:
        self.context = context
        self.peer_address = ("127.0.0.1", 1)
        self.qp = StandInQP()

    def create_qp(self, *args, **kwargs) -> StandInQP:
        return self.qp

    def disconnect(self) -> None:
        pass

    def close(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.handled = []
        self.broken = []

    def handle(self, cmd) -> None:
        self.handled.append(cmd)

    def queue_broken(self, queue, reason) -> None:
        self.broken.append(reason)


@pytest.fixture(scope="module")
def context():
    ctx = SoftContext("poll")
    yield ctx
    ctx.close()


def make_queue(context, handler, qid: int = 1) -> TargetQueue:
    return TargetQueue(StandInCMId(context), context.alloc_pd(), qid=qid, depth=DEPTH,
                       inline_size=INLINE if qid else 0, handler=handler, name="t")


def completion(kind: int, index: int, byte_len: int = 0) -> WC:
    return WC(kind << KIND_SHIFT | index, WcStatus.SUCCESS, WcOpcode.RECV, byte_len)


def receive(queue: TargetQueue, capsule: bytes, slot: int = 0) -> None:
    queue.recv_views[slot][:len(capsule)] = capsule
    queue.on_completion(completion(KIND_RECV, slot, len(capsule)))


def cqe(queue: TargetQueue, index: int) -> tuple[int, int, int, bool]:
    """(cid, status, sq_id, dnr) of the response in command slot ``index``."""
    _result, _head, sq_id, cid, word = struct.unpack_from("<QHHHH", queue.send_pool.views[index])
    return cid, (word >> 1) & 0x3FFF, sq_id, bool(word & 0x8000)


def finish_sends(queue: TargetQueue) -> None:
    """Complete every posted SEND (frees the slots) and forget what was posted."""
    qp = queue.qp
    for wr, fields in qp.posted:
        if fields[0] >> KIND_SHIFT == KIND_SEND:
            queue.on_completion(completion(KIND_SEND, fields[0] & INDEX_MASK))
    qp.posted.clear()


def reference(capsule: bytes, inline_size: int):
    """What the transport decided before the fast path: the full decode and checks."""
    length = len(capsule)
    try:
        sqe = SQE.unpack_from(capsule)
        sgl = sqe.sgl
        if isinstance(sgl, OffsetSGL):
            if data_direction(sqe) != 1:
                raise ProtocolError("", StatusCode.INVALID_FIELD, cid=sqe.cid)
            if sgl.offset + sgl.length > min(length - 64, inline_size):
                raise ProtocolError("", StatusCode.SGL_INVALID_OFFSET, cid=sqe.cid)
    except ProtocolError as exc:
        return exc
    return sqe


OPCODES = (0x01, 0x02, 0x00, 0x08, 0x09, 0x7F)
FLAGS = (0x40, 0x41, 0x42, 0x00, 0x80, 0xC0, 0x7F)
#: what the fast path takes (0x40, 0x4F, 0x01) and every near miss of it
TYPE_BYTES = (0x40, 0x4F, 0x01, 0x00, 0x41, 0x4E, 0x02, 0x10, 0x11, 0x50, 0xF0, 0xCF, 0xC0)
#: (SGL address, SGL length, in-capsule bytes received)
SPANS = ((0, 4096, 4096), (0, 4096, 4095), (1, 4095, 4096), (4096, 0, 4096), (0, 0, 0),
         (5000, 1, INLINE), (0, 8192, INLINE), ((1 << 64) - 1, 0xFFFFFF, 100),
         (0, 0xFFFFFFFF, INLINE))


def test_fast_decode_decides_what_the_full_decode_decides(context):
    """Every combination of opcode, flags, SGL type and in-capsule span on both queue kinds
    (the other fields at random): refused with the full decode's status and cid, or handed
    on with its fields."""
    rng = random.Random(14)
    recorder = Recorder()
    queues = {0: make_queue(context, recorder, 0), 1: make_queue(context, recorder)}
    fast = 0
    for opcode, flags, type_byte, (addr, length, received), qid in itertools.product(
            OPCODES, FLAGS, TYPE_BYTES, SPANS, (0, 1)):
        queue = queues[qid]
        cid, nsid = rng.getrandbits(16), rng.getrandbits(32)
        slba, cdw12, key = rng.getrandbits(64), rng.getrandbits(32), rng.getrandbits(32)
        word = (length & 0xFFFFFFFF) | key << 24 | type_byte << 56 if type_byte != 0x01 \
            else length | type_byte << 56
        word &= (1 << 64) - 1
        capsule = bytearray(64 + (received if qid else 0))
        capsule[64:] = rng.randbytes(len(capsule) - 64)
        struct.pack_into("<BBHI16xQQQI", capsule, 0, opcode, flags, cid, nsid, addr, word,
                         slba, cdw12)
        expected = reference(bytes(capsule), queue.inline_size)
        receive(queue, bytes(capsule))
        case = (opcode, flags, type_byte, addr, length, received, qid)
        if isinstance(expected, ProtocolError):
            assert recorder.handled == [], case
            (wr, fields), = queue.qp.posted
            assert fields[1] == WrOpcode.SEND, case
            index = fields[0] & INDEX_MASK
            assert cqe(queue, index) == (expected.cid, expected.status, qid, True), case
        else:
            cmd, = recorder.handled
            recorder.handled.clear()
            assert cmd.rw == (qid != 0 and opcode in (1, 2)), case
            fast += cmd.rw
            assert (cmd.opcode, cmd.cid, cmd.nsid) == (expected.opcode, expected.cid,
                                                       expected.nsid), case
            assert cmd.sgl == expected.sgl, case
            assert cmd.data_length == expected.sgl.length, case
            assert cmd.sqe == expected, case
            if cmd.rw:
                assert cmd.slba == expected.cdw10 | expected.cdw11 << 32, case
                assert cmd.cdw12 == expected.cdw12, case
            if isinstance(expected.sgl, OffsetSGL):
                assert bytes(cmd.inline) == bytes(capsule[64:]), case
            queue.respond(cmd)
        finish_sends(queue)
        assert queue.outstanding == 0 and not recorder.broken, case
    assert fast >= 40


def test_success_cqe_layout_is_pack_cqe_into():
    a, b = bytearray(16), bytearray(16)
    CQE_FIELDS.pack_into(a, 0, 0, 17, 3, 0xBEEF, 0)
    pack_cqe_into(b, 0, 0xBEEF, 0, sq_head=17, sq_id=3)
    assert a == b


def test_a_slot_reuses_its_work_requests(context):
    recorder = Recorder()
    queue = make_queue(context, recorder)
    qp = queue.qp
    seen = []
    for rkey, invalidate in ((0x11, False), (0x22, True), (0x33, False)):
        capsule = bytearray(64)
        pack_rw_into(capsule, 0x02, 7, 1, 0, 0, 0x1000 * rkey, keyed_word(4096, rkey,
                                                                           invalidate))
        receive(queue, bytes(capsule))
        cmd = recorder.handled.pop()
        assert cmd.index == 0
        queue.respond_ok(cmd, 0xA000 + rkey, 4096, 0x5)
        (write, wf), (send, sf) = qp.posted
        assert wf[1:] == (WrOpcode.RDMA_WRITE, ((0xA000 + rkey, 4096, 0x5),), 0x1000 * rkey,
                          rkey, 0)
        assert sf[1] == (WrOpcode.SEND_WITH_INV if invalidate else WrOpcode.SEND)
        assert sf[5] == (rkey if invalidate else 0)
        seen.append((write, send, write.sg_list, send.sg_list))
        finish_sends(queue)
        # and a write's RDMA READ
        capsule = bytearray(64)
        pack_rw_into(capsule, 0x01, 8, 1, 0, 0, 0x2000, keyed_word(4096, rkey))
        receive(queue, bytes(capsule))
        cmd = recorder.handled.pop()
        done = []
        queue.fetch_to(cmd, 0xB000, 4096, 0x6, done.append)
        (read, rf), = qp.posted
        assert rf[1:] == (WrOpcode.RDMA_READ, ((0xB000, 4096, 0x6),), 0x2000, rkey, 0)
        qp.posted.clear()
        queue.on_completion(completion(KIND_READ, cmd.index))
        assert done == [cmd] and cmd.on_fetched is None
        queue.respond_ok(cmd)
        (send2, _), = qp.posted
        assert send2 is send
        seen.append((read, read.sg_list))
        finish_sends(queue)
    assert all(a is b for a, b in zip(seen[0], seen[2]))
    assert all(a is b for a, b in zip(seen[1], seen[3]))


# -- the controller's Read/Write ------------------------------------------------------------

CONF = """
listeners:
  - {transport: rdma, provider: soft, address: 127.0.0.1, port: 1}
subsystems:
  - nqn: nqn.2014-08.org.example:fast
    allow_any_host: true
    namespaces:
      - {nsid: 1, backend: ramdisk, size: 1MiB, block_size: 4096}
      - {nsid: 2, backend: ramdisk, size: 1MiB, block_size: 512, read_only: true}
limits: {mdts: 64KiB}
"""


class Rig:
    def __init__(self, context) -> None:
        self.target = Target(cfg.loads(CONF))
        sub = next(iter(self.target.subsystems.values()))
        self.ns = sub.namespaces
        state = ControllerState(cntlid=1, max_io_queues=4, phase=Phase.READY,
                                queues=frozenset({0, 1}))
        self.ctrl = Controller(self.target.resources, self.target.owner, state, sub,
                               "nqn.2014-08.org.example:h", bytes(16), "soft")
        self.queue = make_queue(context, Recorder())
        self.queue.dispatch = self.ctrl.handle
        self.ctrl.queues[1] = self.queue

    def run(self, opcode, nsid, slba, nlb, word, addr=0x9000, payload=b""):
        """Submit; complete its RDMA READ; return (status, dnr, posted fields)."""
        capsule = bytearray(64)
        pack_rw_into(capsule, opcode, 5, nsid, slba, nlb, addr, word)
        receive(self.queue, bytes(capsule) + payload)
        qp = self.queue.qp
        for _wr, f in list(qp.posted):
            if f[0] >> KIND_SHIFT == KIND_READ:
                qp.posted.remove((_wr, f))
                self.queue.on_completion(completion(KIND_READ, f[0] & INDEX_MASK))
        posted = [f for _wr, f in qp.posted]
        send = posted[-1]
        _cid, status, _q, dnr = cqe(self.queue, send[0] & INDEX_MASK)
        finish_sends(self.queue)
        return status, dnr, posted


@pytest.fixture
def rig(context):
    r = Rig(context)
    yield r
    assert r.queue.outstanding == 0
    assert all(ns.stats.inflight == 0 for ns in r.ns.values()) and r.ctrl.io.inflight == 0
    r.target.close()


@pytest.mark.parametrize("opcode, nsid, slba, nlb, length, status", [
    (0x02, 3, 0, 0, 4096, StatusCode.INVALID_NS),
    (0x02, 1, 0, 0, 512, StatusCode.SGL_DATA_LENGTH_INVALID),
    (0x02, 1, 0, 31, 32 * 4096, StatusCode.INVALID_FIELD),          # > MDTS
    (0x02, 1, 255, 1, 8192, StatusCode.LBA_OUT_OF_RANGE),
    (0x02, 1, 1 << 63, 0, 4096, StatusCode.LBA_OUT_OF_RANGE),
    (0x01, 2, 0, 0, 512, StatusCode.NS_WRITE_PROTECTED),
    (0x01, 2, 2047, 1, 1024, StatusCode.LBA_OUT_OF_RANGE),          # range before protection
    (0x02, 2, 2047, 0, 512, StatusCode.SUCCESS),
    (0x01, 1, 255, 0, 4096, StatusCode.SUCCESS),
])
def test_read_write_statuses(rig, opcode, nsid, slba, nlb, length, status):
    errors = rig.ctrl.io.errors
    got, dnr, posted = rig.run(opcode, nsid, slba, nlb, keyed_word(length, 0x42))
    assert got == status
    assert dnr == (status != StatusCode.SUCCESS)
    assert rig.ctrl.io.errors == errors + (status != StatusCode.SUCCESS)


def test_not_ready_is_a_command_sequence_error(rig):
    rig.ctrl.state = ControllerState(cntlid=1, max_io_queues=4, phase=Phase.DISABLED,
                                     queues=frozenset({0, 1}))
    assert not rig.ctrl.ready
    status, dnr, _ = rig.run(0x02, 1, 0, 0, keyed_word(4096, 1))
    assert (status, dnr) == (StatusCode.CMD_SEQ_ERROR, True)


def test_data_moves_straight_to_and_from_the_volume(rig):
    ns = rig.ns[1]
    mr = ns.mr(rig.queue.pd)
    # a read: one RDMA WRITE straight out of the volume's memory region, then the SEND
    status, _, posted = rig.run(0x02, 1, 3, 1, keyed_word(8192, 0x42), addr=0x7000)
    assert status == 0
    write, send = posted
    assert write[1:5] == (WrOpcode.RDMA_WRITE, ((mr.addr + 3 * 4096, 8192, mr.lkey),),
                          0x7000, 0x42)
    assert ns.stats.ops == [1, 0] and rig.ctrl.io.ops == [1, 0]
    assert ns.stats.bytes == [8192, 0] and sum(ns.stats.buckets[0]) == 1
    # a write by RDMA READ straight into it
    capsule = bytearray(64)
    pack_rw_into(capsule, 0x01, 6, 1, 5, 0, 0x8000, keyed_word(4096, 0x43))
    receive(rig.queue, bytes(capsule))
    (read, rf), = rig.queue.qp.posted
    assert rf[1:5] == (WrOpcode.RDMA_READ, ((mr.addr + 5 * 4096, 4096, mr.lkey),), 0x8000, 0x43)
    assert ns.stats.inflight == 1
    rig.queue.qp.posted.clear()
    rig.queue.on_completion(completion(KIND_READ, rf[0] & INDEX_MASK))
    finish_sends(rig.queue)
    assert ns.stats.ops == [1, 1] and ns.stats.inflight == 0
    # in-capsule data is copied from the capsule into the volume
    payload = bytes(range(256)) * 16
    status, _, posted = rig.run(0x01, 1, 7, 0, offset_word(4096), addr=0, payload=payload)
    assert status == 0 and len(posted) == 1
    assert bytes(ns.memory[7 * 4096:8 * 4096]) == payload


def test_a_read_pins_its_namespace_until_its_send_completes(rig):
    ns = rig.ns[1]
    capsule = bytearray(64)
    pack_rw_into(capsule, 0x02, 9, 1, 0, 0, 0x7000, keyed_word(4096, 0x42))
    receive(rig.queue, bytes(capsule))
    assert ns.stats.inflight == 1 and rig.ctrl.io.inflight == 1     # the WRITE reads it
    finish_sends(rig.queue)
    assert ns.stats.inflight == 0 and rig.ctrl.io.inflight == 0
