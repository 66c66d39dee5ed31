"""Golden vectors: bytes built by hand at the spec sheet's offsets, checked both ways."""

from __future__ import annotations

import struct

import pytest

from blockfabric.protocol import (
    CAP, CC, CQE, CSTS, NULL_SGL, SQE, VS, ActiveNamespaceList, AdminOpcode, AsyncEvent,
    AsyncEventConfig, AsyncEventRequest, AsyncEventType, AsyncNotice, ChangedNamespaceList,
    CMAccept, CMConnectRequest, CMReject, CMRejectStatus, ConnectCommand, ConnectData,
    DatasetManagement, DiscoveryLogEntry, DiscoveryLogHeader, DSMRange, ErrorLogEntry,
    FeatureId, FeatureSelect, Flush, GetFeatures, GetLogPage, Identify, IdentifyCNS,
    IdentifyController, IdentifyNamespace, IOOpcode, KeepAlive, KeyedSGL, LBAFormat,
    LogPageId, NamespaceIdDescriptorList, NidType, NumberOfQueues, OffsetSGL, PropertyGet,
    PropertySet, RdmaTsas, ReadWrite, SetFeatures, SmartLog, StatusCode, WriteZeroes,
    decode_status_word, encode_status, encode_status_word, pack_cqe_into, pack_discovery_log,
    unpack_sgl)
from tests.protocol.helpers import check_command, check_wire, sqe_bytes

# ------------------------------------------------------------------ CM private data (sec. 1)


def test_cm_connect_request() -> None:
    buf = bytearray(32)
    struct.pack_into("<HHHHH", buf, 0, 0, 1, 128, 127, 7)  # recfmt, qid, hrqsize, hsqsize, cntlid
    check_wire(CMConnectRequest(recfmt=0, qid=1, hrqsize=128, hsqsize=127, cntlid=7), buf)


def test_cm_accept_and_reject() -> None:
    acc = bytearray(32)
    struct.pack_into("<H", acc, 2, 32)  # crqsize @2
    check_wire(CMAccept(crqsize=32), acc)
    rej = bytearray(4)
    struct.pack_into("<H", rej, 2, 4)  # sts @2 = invalid hsqsize
    check_wire(CMReject(sts=CMRejectStatus.INVALID_HSQSIZE), rej)
    assert CMReject.unpack_from(rej).reason is CMRejectStatus.INVALID_HSQSIZE
    assert [int(s) for s in CMRejectStatus] == list(range(1, 10))


# ------------------------------------------------------------------ SQE, CQE, SGL (sec. 2, 3)


def test_sqe_read_with_keyed_invalidate_sgl() -> None:
    sgl = bytearray(16)
    struct.pack_into("<Q", sgl, 0, 0x7F00_0000_1000)  # addr @0
    sgl[8:11] = (65536).to_bytes(3, "little")  # 24-bit length @8
    struct.pack_into("<I", sgl, 11, 0xABCD1234)  # key @11
    sgl[15] = 0x4F  # keyed, remote invalidate
    raw = sqe_bytes(0x02, cid=0x1003, nsid=1, sgl=bytes(sgl),
                    dwords={40: ("Q", 0x1_0000_0020), 48: ("H", 127), 50: ("H", 0x4000),
                            52: ("I", 7), 56: ("I", 0xDEAD)})
    key = KeyedSGL(addr=0x7F00_0000_1000, length=65536, key=0xABCD1234, invalidate=True)
    sqe = SQE(opcode=2, flags=0x40, cid=0x1003, nsid=1, sgl=key, cdw10=0x20, cdw11=1,
              cdw12=127 | 0x4000 << 16, cdw13=7, cdw14=0xDEAD)
    check_wire(sqe, raw)
    rw = ReadWrite(IOOpcode.READ, nsid=1, slba=0x1_0000_0020, nlb=127, control=0x4000,
                   dsmgmt=7, reftag=0xDEAD)
    check_command(rw, raw, cid=0x1003, sgl=key)
    assert rw.blocks == 128 and rw.fua and not rw.is_write
    check_wire(key, sgl)
    assert unpack_sgl(bytes(sgl)) == key


def test_linux_partition_scan_read() -> None:
    """Section 9.8: 4 KiB reads, len 7 (8 x 512 B), ctrl 0x8000, dsmgmt 7."""
    raw = sqe_bytes(0x02, cid=5, nsid=1, dwords={48: ("H", 7), 50: ("H", 0x8000), 52: ("I", 7)})
    rw = ReadWrite(IOOpcode.READ, nsid=1, slba=0, nlb=7, control=0x8000, dsmgmt=7)
    check_command(rw, raw, cid=5)
    assert rw.blocks == 8 and not rw.fua


def test_sqe_write_with_offset_sgl() -> None:
    sgl = bytearray(16)
    struct.pack_into("<QI", sgl, 0, 0, 4096)  # offset @0, length u32 @8
    sgl[15] = 0x01
    raw = sqe_bytes(0x01, cid=9, nsid=1, sgl=bytes(sgl), dwords={48: ("H", 7)})
    check_command(ReadWrite(IOOpcode.WRITE, 1, 0, 7), raw, cid=9, sgl=OffsetSGL(0, 4096))
    check_wire(OffsetSGL(0, 4096), sgl)


def test_null_sgl_is_all_zero_keyed() -> None:
    raw = bytes(15) + b"\x40"
    check_wire(NULL_SGL, raw)
    assert NULL_SGL.is_null and unpack_sgl(raw) is NULL_SGL


def test_cqe_aer_teardown_status_0x4006() -> None:
    """Section 9.10/10: the outstanding AER completes with 0x4006 = internal error | DNR."""
    raw = bytearray(16)
    struct.pack_into("<QHHHH", raw, 0, 0, 3, 0, 0x3000, 0x4006 << 1)
    cqe = CQE(result=0, sq_head=3, sq_id=0, cid=0x3000, status=StatusCode.INTERNAL_ERROR,
              dnr=True)
    check_wire(cqe, raw)
    assert encode_status(StatusCode.INTERNAL_ERROR, dnr=True) == 0x4006
    assert encode_status_word(StatusCode.INTERNAL_ERROR, dnr=True) == 0x800C
    assert decode_status_word(0x800C) == (StatusCode.INTERNAL_ERROR, True, False, 0, 0)
    fast = bytearray(16)
    pack_cqe_into(fast, 0, 0x3000, StatusCode.INTERNAL_ERROR, sq_head=3, dnr=True)
    assert fast == raw


def test_cqe_fields_more_crd_phase() -> None:
    raw = bytearray(16)
    status = (0x182 | 2 << 11 | 1 << 13 | 1 << 14) << 1 | 1
    struct.pack_into("<QHHHH", raw, 0, 0x1_0000_002A, 0xFFFF, 2, 77, status)
    check_wire(CQE(0x1_0000_002A, 0xFFFF, 2, 77, StatusCode.CONNECT_INVALID_PARAM, True, True,
                   2, 1), raw)


def test_status_codes_match_the_sheet() -> None:
    expected = {
        "SUCCESS": 0x000, "INVALID_OPCODE": 0x001, "INVALID_FIELD": 0x002,
        "DATA_TRANSFER_ERROR": 0x004, "INTERNAL_ERROR": 0x006, "INVALID_NS": 0x00B,
        "CMD_SEQ_ERROR": 0x00C, "SGL_DATA_LENGTH_INVALID": 0x00F,
        "SGL_DESCRIPTOR_TYPE_INVALID": 0x011, "SGL_INVALID_OFFSET": 0x016,
        "KEEP_ALIVE_EXPIRED": 0x019, "KEEP_ALIVE_INVALID": 0x01A, "NS_WRITE_PROTECTED": 0x020,
        "LBA_OUT_OF_RANGE": 0x080, "CAPACITY_EXCEEDED": 0x081, "INVALID_QUEUE_SIZE": 0x102,
        "AER_LIMIT_EXCEEDED": 0x105, "INVALID_LOG_PAGE": 0x109,
        "CONNECT_INCOMPATIBLE_FORMAT": 0x180, "CONNECT_CTRL_BUSY": 0x181,
        "CONNECT_INVALID_PARAM": 0x182, "CONNECT_INVALID_HOST": 0x184, "AUTH_REQUIRED": 0x191,
        "WRITE_FAULT": 0x280, "UNRECOVERED_READ_ERROR": 0x281, "ACCESS_DENIED": 0x286,
    }
    assert {name: int(StatusCode[name]) for name in expected} == expected
    assert StatusCode(0x7C1).name == "STATUS_0x7c1"  # unnamed codes still decode


# ------------------------------------------------------------------ Fabrics (sec. 5, 9)


def test_admin_connect_command_and_data() -> None:
    """Section 9 discovery step 1: qid 0, sqsize 31, kato 0, cntlid 0xFFFF, discovery NQN."""
    raw = sqe_bytes(0x7F, cid=0, nsid=0x01, dwords={40: ("H", 0), 42: ("H", 0),
                                                   44: ("H", 31), 46: ("B", 0), 48: ("I", 0)})
    check_command(ConnectCommand(recfmt=0, qid=0, sqsize=31, cattr=0, kato=0), raw)
    io = sqe_bytes(0x7F, nsid=0x01, dwords={42: ("H", 2), 44: ("H", 127), 46: ("B", 4),
                                            48: ("I", 5000)})
    cmd = ConnectCommand(qid=2, sqsize=127, cattr=4, kato=5000)
    check_command(cmd, io)
    assert cmd.sq_flow_control_disabled

    data = bytearray(1024)
    data[0:16] = bytes(range(16))  # hostid @0
    struct.pack_into("<H", data, 16, 0xFFFF)  # cntlid @16
    subnqn = b"nqn.2014-08.org.nvmexpress.discovery"
    hostnqn = b"nqn.2014-08.org.nvmexpress:uuid:00010203-0405-0607-0809-0a0b0c0d0e0f"
    data[256:256 + len(subnqn)] = subnqn
    data[512:512 + len(hostnqn)] = hostnqn
    check_wire(ConnectData(hostid=bytes(range(16)), cntlid=0xFFFF, subnqn=subnqn.decode(),
                           hostnqn=hostnqn.decode()), data)


def test_property_get_and_set() -> None:
    raw = sqe_bytes(0x7F, nsid=0x04, dwords={40: ("B", 1), 44: ("I", 0x00)})
    get = PropertyGet(attrib=1, offset=0)
    check_command(get, raw)
    assert get.size == 8
    raw = sqe_bytes(0x7F, nsid=0x00, dwords={40: ("B", 0), 44: ("I", 0x14),
                                             48: ("Q", 0x00460061)})
    check_command(PropertySet(attrib=0, offset=0x14, value=0x00460061), raw)


@pytest.mark.parametrize("value, en, shn", [(0x00460060, False, 0), (0x00460061, True, 0),
                                            (0x00464061, True, 1)])
def test_cc_values_from_the_linux_trace(value: int, en: bool, shn: int) -> None:
    cc = CC.from_int(value)
    assert (cc.en, cc.shn, cc.css, cc.mps, cc.ams, cc.iosqes, cc.iocqes) == (en, shn, 6, 0, 0,
                                                                             6, 4)
    assert cc.to_int() == value


def test_cap_vs_csts_registers() -> None:
    cap = 127 | 1 << 16 | 15 << 24 | 1 << 37 | 1 << 43 | 2 << 52
    assert CAP.from_int(cap) == CAP(mqes=127, cqr=True, to=15, css=0x41, mpsmax=2)
    assert CAP(mqes=127, cqr=True, to=15, css=0x41, mpsmax=2).to_int() == cap
    assert VS.from_int(0x00010300) == VS(mjr=1, mnr=3, ter=0)
    assert int(VS(mjr=1, mnr=3)) == 0x00010300
    assert CSTS.from_int(0x1) == CSTS(rdy=True)
    assert CSTS.from_int(0x8) == CSTS(shst=2)  # shutdown complete
    assert CSTS(cfs=True, shst=1).to_int() == 0x6


# ------------------------------------------------------------------ Admin (sec. 6, 10)


def test_identify_commands() -> None:
    raw = sqe_bytes(0x06, cid=0x1000, dwords={40: ("B", 1)})
    check_command(Identify(nsid=0, cns=IdentifyCNS.CONTROLLER), raw, cid=0x1000)
    raw = sqe_bytes(0x06, nsid=1, dwords={40: ("B", 3), 47: ("B", 0)})
    check_command(Identify(nsid=1, cns=IdentifyCNS.NS_ID_DESCRIPTORS), raw)


def test_identify_controller_data() -> None:
    d = bytearray(4096)
    struct.pack_into("<H", d, 0, 0x1B36)  # vid
    d[4:24] = b"SN0001".ljust(20)  # sn, space padded
    d[24:64] = b"blockfabric".ljust(40)
    d[64:72] = b"0.1".ljust(8)
    d[76] = 0x08  # cmic: ANA
    d[77] = 8  # mdts
    struct.pack_into("<H", d, 78, 1)  # cntlid
    struct.pack_into("<I", d, 80, 0x00010300)  # ver
    struct.pack_into("<I", d, 92, 0x900)  # oaes
    struct.pack_into("<I", d, 96, 0x80)  # ctratt
    d[259] = 3  # aerl
    struct.pack_into("<H", d, 320, 10)  # kas
    d[512], d[513] = 0x66, 0x44  # sqes, cqes
    struct.pack_into("<H", d, 514, 128)  # maxcmd
    struct.pack_into("<I", d, 516, 1024)  # nn
    struct.pack_into("<H", d, 520, 0x0C)  # oncs: DSM + write zeroes
    d[525] = 1  # vwc
    struct.pack_into("<I", d, 536, 1 | 1 << 2 | 1 << 20)  # sgls
    d[768:768 + 13] = b"nqn.test:ram0"
    struct.pack_into("<IIH", d, 1792, 260, 1, 0)  # ioccsz, iorcsz, icdoff
    d[1803] = 1  # msdbd
    ctrl = IdentifyController(
        vid=0x1B36, sn="SN0001", mn="blockfabric", fr="0.1", cmic=0x08, mdts=8, cntlid=1,
        ver=0x00010300, oaes=0x900, ctratt=0x80, aerl=3, kas=10, sqes=0x66, cqes=0x44,
        maxcmd=128, nn=1024, oncs=0x0C, vwc=1, sgls=0x100005, subnqn="nqn.test:ram0",
        ioccsz=260, iorcsz=1, icdoff=0, msdbd=1)
    check_wire(ctrl, d)


def test_identify_namespace_data() -> None:
    d = bytearray(4096)
    struct.pack_into("<QQQ", d, 0, 262144, 262144, 262144)  # nsze, ncap, nuse
    d[25] = 1  # nlbaf: two formats
    d[26] = 1  # flbas -> lbaf[1]
    d[30] = 1  # nmic shared
    struct.pack_into("<I", d, 92, 1)  # anagrpid
    d[99] = 1  # nsattr: write protected
    d[104:120] = bytes(range(1, 17))  # nguid
    d[120:128] = bytes(range(8))  # eui64
    struct.pack_into("<HBB", d, 128, 0, 9, 0)  # lbaf0: 512 B
    struct.pack_into("<HBB", d, 132, 0, 12, 0)  # lbaf1: 4 KiB
    ns = IdentifyNamespace(nsze=262144, ncap=262144, nuse=262144, nlbaf=1, flbas=1, nmic=1,
                           anagrpid=1, nsattr=1, nguid=bytes(range(1, 17)),
                           eui64=bytes(range(8)), lbaf=(LBAFormat(ds=9), LBAFormat(ds=12)))
    check_wire(ns, d)
    assert ns.block_size == 4096
    assert IdentifyNamespace.unpack_from(bytes(4096)) == IdentifyNamespace()  # inactive


def test_active_namespace_list_and_descriptors() -> None:
    d = bytearray(4096)
    struct.pack_into("<III", d, 0, 1, 2, 7)
    check_wire(ActiveNamespaceList((1, 2, 7)), d)
    d = bytearray(4096)
    struct.pack_into("<BBxx", d, 0, 2, 16)  # NGUID
    d[4:20] = b"G" * 16
    struct.pack_into("<BBxx", d, 20, 3, 16)  # UUID
    d[24:40] = b"U" * 16
    struct.pack_into("<BBxx", d, 40, 4, 1)  # CSI
    d[44] = 0
    check_wire(NamespaceIdDescriptorList.of([(NidType.NGUID, b"G" * 16),
                                             (NidType.UUID, b"U" * 16),
                                             (NidType.CSI, b"\0")]), d)


@pytest.mark.parametrize("cdw10, rae, numd, length", [(0x00FF8070, True, 0xFF, 1024),
                                                      (0x02FF0070, False, 0x2FF, 3072)])
def test_get_log_page_discovery_from_the_trace(cdw10: int, rae: bool, numd: int,
                                               length: int) -> None:
    raw = sqe_bytes(0x02, cid=0x2000, dwords={40: ("I", cdw10), 48: ("Q", 0)})
    cmd = GetLogPage(nsid=0, lid=LogPageId.DISCOVERY, rae=rae, numd=numd)
    check_command(cmd, raw, cid=0x2000)
    assert cmd.length == length and GetLogPage.numd_for(length) == numd


def test_get_log_page_fields() -> None:
    """ANA log from section 9: nsid 0xFFFFFFFF, NUMDL 0x803; lsp/numdu/lpo at their places."""
    raw = sqe_bytes(0x02, nsid=0xFFFFFFFF, dwords={40: ("B", 0x0C), 41: ("B", 0x01),
                                                   42: ("H", 0x803), 44: ("H", 1),
                                                   48: ("Q", 4096)})
    check_command(GetLogPage(nsid=0xFFFFFFFF, lid=LogPageId.ANA, lsp=1, numd=0x10803,
                             lpo=4096), raw)


def test_discovery_log_page() -> None:
    page = bytearray(2048)
    struct.pack_into("<QQH", page, 0, 5, 1, 0)  # genctr, numrec, recfmt
    e = 1024
    struct.pack_into("<BBBBHHHH", page, e, 1, 1, 2, 0, 1, 0xFFFF, 32, 0)
    page[e + 32:e + 36] = b"4420"
    page[e + 256:e + 269] = b"nqn.test:ram0"
    page[e + 512:e + 520] = b"10.0.0.1"
    page[e + 768] = 1  # qptype RC
    page[e + 769] = 4  # prtype RoCEv2
    page[e + 770] = 1  # cms RDMA_CM
    struct.pack_into("<H", page, e + 776, 0xFFFF)  # pkey
    entry = DiscoveryLogEntry(trtype=1, adrfam=1, subtype=2, treq=0, portid=1, cntlid=0xFFFF,
                              asqsz=32, trsvcid="4420", subnqn="nqn.test:ram0",
                              traddr="10.0.0.1", tsas=RdmaTsas(qptype=1, prtype=4, cms=1,
                                                               pkey=0xFFFF))
    check_wire(DiscoveryLogHeader(genctr=5, numrec=1, recfmt=0), page[:1024])
    check_wire(entry, page[1024:])
    assert pack_discovery_log(5, [entry]) == page
    assert list(DiscoveryLogEntry.iter_from(memoryview(page), 1)) == [entry]


def test_error_log_entry() -> None:
    d = bytearray(64)
    struct.pack_into("<QHHHHQIBB", d, 0, 3, 1, 0x42, 0x4006 << 1, 0x28, 99, 1, 0, 1)
    d[31] = 0x02  # opcode
    struct.pack_into("<QH", d, 32, 7, 5)
    check_wire(ErrorLogEntry(error_count=3, sqid=1, cid=0x42, status=0x800C,
                             param_error_location=0x28, lba=99, nsid=1, trtype=1, opcode=2,
                             cs_info=7, trtype_info=5), d)


def test_smart_log() -> None:
    d = bytearray(512)
    d[0] = 0x04  # critical warning: reliability degraded
    struct.pack_into("<H", d, 1, 310)  # composite temperature, K
    d[3], d[4], d[5] = 100, 10, 1
    d[32:48] = (12345).to_bytes(16, "little")  # data units read
    d[48:64] = (2 ** 70).to_bytes(16, "little")  # data units written
    d[128:144] = (42).to_bytes(16, "little")  # power on hours
    d[144:160] = (2).to_bytes(16, "little")  # unsafe shutdowns
    struct.pack_into("<II", d, 192, 5, 6)
    struct.pack_into("<HH", d, 200, 300, 301)  # temp sensors 1, 2
    check_wire(SmartLog(critical_warning=4, temperature=310, avail_spare=100, spare_thresh=10,
                        percent_used=1, data_units_read=12345, data_units_written=2 ** 70,
                        power_on_hours=42, unsafe_shutdowns=2, warning_temp_time=5,
                        critical_comp_time=6, temp_sensor=(300, 301)), d)


def test_changed_namespace_list() -> None:
    d = bytearray(4096)
    struct.pack_into("<II", d, 0, 1, 3)
    check_wire(ChangedNamespaceList((1, 3)), d)
    struct.pack_into("<II", d, 0, 0xFFFFFFFF, 0)
    assert ChangedNamespaceList.unpack_from(d).overflowed


@pytest.mark.parametrize("fid, cdw11, value", [
    (FeatureId.NUM_QUEUES, 0x00010001, NumberOfQueues(nsqr=1, ncqr=1)),
    (FeatureId.ASYNC_EVENT, 0x80000000, AsyncEventConfig(discovery_change=True)),
    (FeatureId.ASYNC_EVENT, 0x900, AsyncEventConfig(ns_attr=True, ana_change=True)),
    (FeatureId.KATO, 5000, None)])
def test_set_features_from_the_trace(fid: FeatureId, cdw11: int, value: object) -> None:
    raw = sqe_bytes(0x09, cid=3, dwords={40: ("I", fid), 44: ("I", cdw11)})
    check_command(SetFeatures(fid=fid, value=cdw11), raw, cid=3)
    if value is not None:
        assert type(value).from_int(cdw11) == value and int(value) == cdw11


def test_set_features_save_and_get_features_select() -> None:
    raw = sqe_bytes(0x09, dwords={40: ("I", 1 << 31 | 0x0F), 44: ("I", 120000)})
    check_command(SetFeatures(fid=FeatureId.KATO, save=True, value=120000), raw)
    raw = sqe_bytes(0x0A, dwords={40: ("I", 3 << 8 | 0x07)})
    check_command(GetFeatures(fid=FeatureId.NUM_QUEUES, sel=FeatureSelect.SUPPORTED), raw)


def test_keep_alive_and_aer() -> None:
    check_command(KeepAlive(), sqe_bytes(0x18, cid=8), cid=8)
    check_command(AsyncEventRequest(), sqe_bytes(0x0C, cid=0x4000), cid=0x4000)
    assert AdminOpcode.KEEP_ALIVE == 0x18 and AdminOpcode.ASYNC_EVENT_REQUEST == 0x0C


@pytest.mark.parametrize("dword0, event", [
    (0x00040002, AsyncEvent(AsyncEventType.NOTICE, AsyncNotice.NS_ATTR_CHANGED, 0x04)),
    (0x0070F002, AsyncEvent(AsyncEventType.NOTICE, AsyncNotice.DISCOVERY_CHANGE, 0x70)),
    (0x000C0302, AsyncEvent(AsyncEventType.NOTICE, AsyncNotice.ANA_CHANGE, 0x0C))])
def test_aer_completion_dword0(dword0: int, event: AsyncEvent) -> None:
    assert AsyncEvent.from_int(dword0) == event
    assert event.to_int() == dword0


# ------------------------------------------------------------------ I/O (sec. 7, 9)


def test_flush_write_zeroes_dsm() -> None:
    check_command(Flush(nsid=1), sqe_bytes(0x00, cid=4, nsid=1), cid=4)
    raw = sqe_bytes(0x08, nsid=1, dwords={40: ("Q", 2048), 48: ("I", 15 | 1 << 25)})
    wz = WriteZeroes(nsid=1, slba=2048, nlb=15, deac=True)
    check_command(wz, raw)
    assert wz.blocks == 16
    raw = sqe_bytes(0x09, nsid=1, dwords={40: ("I", 0), 44: ("I", 4)})  # nr 0, deallocate
    dsm = DatasetManagement(nsid=1, nr=0, ad=True)
    check_command(dsm, raw)
    assert dsm.ranges == 1 and dsm.data_length == 16


def test_dsm_ranges_lazily_from_a_buffer() -> None:
    d = bytearray(48)
    struct.pack_into("<IIQ", d, 0, 0, 2048, 0)  # cattr @0, nlb @4, slba @8
    struct.pack_into("<IIQ", d, 16, 1, 8, 1 << 40)
    check_wire(DSMRange(cattr=0, nlb=2048, slba=0), d[:16])
    ranges = DSMRange.iter_from(memoryview(d), 2)
    assert next(ranges) == DSMRange(0, 2048, 0)
    assert list(ranges) == [DSMRange(1, 8, 1 << 40)]
    assert DSMRange.pack_ranges([DSMRange(0, 2048, 0), DSMRange(1, 8, 1 << 40)]) == d[:32]
