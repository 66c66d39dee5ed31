"""Every error path answers with its NVMe status (and DNR), and the daemon carries on."""

from __future__ import annotations

import pytest

from blockfabric.initiator.host import (ConnectOptions, Controller, NvmeError, QueueDead,
                                        connect)
from blockfabric.protocol import (SQE, Identify, IdentifyCNS, IOOpcode, KeyedSGL, OffsetSGL,
                                  ReadWrite, StatusCode)

from .conftest import HOSTNQN, NQN, OTHER_HOSTNQN, addr_of, free_port, ram_config, via

SGL_TYPE_BYTE = 39  # SQE @24 + 15


@pytest.fixture
def ctrl(module_any_target):
    target = module_any_target
    with connect(addr_of(target.transport), NQN, target.port, **target.via, hostnqn=HOSTNQN,
                 nr_io_queues=1) as c:
        yield c


def read_sqe(ctrl: Controller, nsid: int = 1, slba: int = 0, nlb: int = 0,
             length: int = 4096) -> SQE:
    arena = ctrl.arena
    return ReadWrite(IOOpcode.READ, nsid, slba, nlb).to_sqe(
        sgl=KeyedSGL(arena.mr.addr, length, arena.mr.rkey))


def expect(cqe, status: StatusCode, dnr: bool = True) -> None:
    assert (cqe.status, cqe.dnr) == (status, dnr), cqe


def still_works(ctrl: Controller) -> None:
    ns = ctrl.namespaces[1]
    ns.write(0, b"\x5a" * 4096)
    assert ns.read(0, 4096) == b"\x5a" * 4096


def test_lba_out_of_range(ctrl):
    ns = ctrl.namespaces[1]
    with pytest.raises(NvmeError) as err:
        ns.read(ns.size, 4096)
    assert (err.value.status, err.value.dnr) == (StatusCode.LBA_OUT_OF_RANGE, True)
    assert (err.value.sct, err.value.sc) == (0, 0x80)      # generic, LBA Out of Range
    with pytest.raises(NvmeError) as err:
        ns.write(ns.size - 4096, bytes(8192))      # starts inside, ends outside
    assert err.value.status == StatusCode.LBA_OUT_OF_RANGE
    still_works(ctrl)


def test_invalid_namespace(ctrl):
    cqe = ctrl.raw(ctrl.io_queues[0], read_sqe(ctrl, nsid=7).pack())
    expect(cqe, StatusCode.INVALID_NS)
    still_works(ctrl)


def test_bad_sgl_type(ctrl):
    capsule = bytearray(read_sqe(ctrl).pack())
    capsule[SGL_TYPE_BYTE] = 0x20                 # descriptor type 2 (segment): not accepted
    expect(ctrl.raw(ctrl.io_queues[0], bytes(capsule)), StatusCode.SGL_DESCRIPTOR_TYPE_INVALID)
    capsule[SGL_TYPE_BYTE] = 0x42                 # keyed, unknown subtype
    expect(ctrl.raw(ctrl.io_queues[0], bytes(capsule)), StatusCode.INVALID_FIELD
           if ctrl.opts.transport == "rdma"
           else StatusCode.SGL_DESCRIPTOR_TYPE_INVALID)   # NVMe/TCP has no keyed SGLs
    still_works(ctrl)


def test_sgl_length_not_matching_the_block_count(ctrl):
    cqe = ctrl.raw(ctrl.io_queues[0], read_sqe(ctrl, nlb=0, length=8192).pack())
    expect(cqe, StatusCode.SGL_DATA_LENGTH_INVALID)
    cqe = ctrl.raw(ctrl.io_queues[0], read_sqe(ctrl, nlb=1, length=4096).pack())
    expect(cqe, StatusCode.SGL_DATA_LENGTH_INVALID)
    still_works(ctrl)


def test_in_capsule_data_rules(ctrl):
    queue = ctrl.io_queues[0]
    read = ReadWrite(IOOpcode.READ, 1, 0, 0).to_sqe(sgl=OffsetSGL(0, 4096))
    expect(ctrl.raw(queue, read.pack() + bytes(4096)), StatusCode.INVALID_FIELD)
    write = ReadWrite(IOOpcode.WRITE, 1, 0, 0).to_sqe(sgl=OffsetSGL(512, 4096))
    expect(ctrl.raw(queue, write.pack() + bytes(4096)), StatusCode.SGL_INVALID_OFFSET)
    still_works(ctrl)


def test_unknown_opcodes(ctrl):
    sqe = read_sqe(ctrl)
    sqe.opcode = 0x7E
    expect(ctrl.raw(ctrl.io_queues[0], sqe.pack()), StatusCode.INVALID_OPCODE)
    admin = SQE(opcode=0xC1)
    expect(ctrl.raw(ctrl.admin, admin.pack()), StatusCode.INVALID_OPCODE)
    still_works(ctrl)


def test_write_to_read_only_namespace(start_target):
    port = free_port()
    start_target(ram_config(port, namespaces=[
        {"nsid": 1, "backend": "ramdisk", "size": "8MiB", "read_only": True}]))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN) as ctrl:
        ns = ctrl.namespaces[1]
        assert ns.read_only
        with pytest.raises(NvmeError) as err:
            ns.write(0, bytes(4096))
        assert (err.value.status, err.value.dnr) == (StatusCode.NS_WRITE_PROTECTED, True)
        with pytest.raises(NvmeError) as err:
            ns.write_zeroes(0, 4096)
        assert err.value.status == StatusCode.NS_WRITE_PROTECTED
        assert ns.read(0, 4096) == bytes(4096)


def test_unknown_nqn_and_host_not_allowed(start_target):
    port = free_port()
    target = start_target(ram_config(port, allow_any_host=False, hosts=[OTHER_HOSTNQN]))
    with pytest.raises(NvmeError) as err:
        connect(addr_of(), NQN + "x", port, **via(), hostnqn=HOSTNQN)
    assert (err.value.status, err.value.dnr) == (StatusCode.CONNECT_INVALID_PARAM, True)
    assert (err.value.sct, err.value.sc) == (1, 0x82)      # command specific
    assert err.value.result == (1 << 16 | 256)   # IATTR data, IPO subnqn: as nvmet reports
    with pytest.raises(NvmeError) as err:
        connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN)
    assert (err.value.status, err.value.dnr) == (StatusCode.CONNECT_INVALID_HOST, True)
    with connect(addr_of(), NQN, port, **via(), hostnqn=OTHER_HOSTNQN) as ctrl:
        still_works(ctrl)
    assert "not allowed" in target.log


def test_commands_before_connect_are_refused(ram_target):
    ctrl = Controller(ConnectOptions(traddr=addr_of(), subnqn=NQN, trsvcid=ram_target.port,
                                     **via(), hostnqn=HOSTNQN))
    ctrl.reactor.start()
    try:
        queue = ctrl.open_queue(0, 32)
        ctrl.admin = queue
        ident = Identify(nsid=0, cns=IdentifyCNS.CONTROLLER).to_sqe()
        expect(ctrl.raw(queue, ident.pack()), StatusCode.INVALID_OPCODE)
        # The queue still takes the Connect afterwards.
        assert ctrl.fabrics_connect(queue, 0, 31, 0) > 0
        # Admin commands before CC.EN are a sequence error.
        expect(ctrl.raw(queue, ident.pack()), StatusCode.CMD_SEQ_ERROR)
    finally:
        ctrl.close()


def test_io_queue_connect_rules(ram_target):
    with connect(addr_of(), NQN, ram_target.port, **via(), hostnqn=HOSTNQN,
                 nr_io_queues=1) as ctrl:
        # A second Connect for a qid that is already connected: command sequence error.
        dup = ctrl.open_queue(1, 16)
        with pytest.raises(NvmeError) as err:
            ctrl.fabrics_connect(dup, 1, 15, 0)
        assert err.value.status == StatusCode.CMD_SEQ_ERROR
        dup.close()
        # A qid beyond the granted count.
        far = ctrl.open_queue(5, 16)
        with pytest.raises(NvmeError) as err:
            ctrl.fabrics_connect(far, 5, 15, 0)
        assert err.value.status == StatusCode.CONNECT_INVALID_PARAM
        far.close()
        still_works(ctrl)


def test_queue_dead_is_reported_not_hung(start_target):
    port = free_port()
    target = start_target(ram_config(port))
    with connect(addr_of(), NQN, port, **via(), hostnqn=HOSTNQN,
                 ctrl_loss_tmo=0) as ctrl:      # 0: no reconnect, fail at once
        target.stop()
        with pytest.raises((QueueDead, ConnectionError, NvmeError)):
            for _ in range(50):
                ctrl.namespaces[1].read(0, 4096)
