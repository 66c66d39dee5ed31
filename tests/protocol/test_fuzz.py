"""Arbitrary bytes into every decoder: only ProtocolError escapes, always with a status."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import given, strategies as st

from blockfabric.protocol import (
    SQE, ActiveNamespaceList, AsyncEvent, AsyncEventRequest, ChangedNamespaceList, CMAccept,
    CMConnectRequest, CMReject, ConnectCommand, ConnectData, CQE, DatasetManagement,
    DiscoveryLogEntry, DiscoveryLogHeader, DSMRange, ErrorLogEntry, Flush, GetFeatures,
    GetLogPage, Identify, IdentifyController, IdentifyNamespace, KeepAlive, KeyedSGL,
    NamespaceIdDescriptorList, OffsetSGL, PropertyGet, PropertySet, ProtocolError, RdmaTsas,
    ReadWrite, SetFeatures, SmartLog, StatusCode, WriteZeroes, unpack_sgl)
from tests.protocol.helpers import FUZZ


def _sized(size: int) -> st.SearchStrategy[bytes]:
    """Short buffers of any length, and ones around the structure's own size."""
    return st.one_of(st.binary(max_size=min(size, 80)),
                     st.binary(min_size=max(size - 4, 0), max_size=size + 8))


DECODERS: dict[str, tuple[Callable[[bytes], Any], int]] = {
    "SQE": (SQE.unpack_from, 64),
    "CQE": (CQE.unpack_from, 16),
    "SGL": (unpack_sgl, 16),
    "KeyedSGL": (KeyedSGL.unpack_from, 16),
    "OffsetSGL": (OffsetSGL.unpack_from, 16),
    "ConnectData": (ConnectData.unpack_from, 1024),
    "IdentifyController": (IdentifyController.unpack_from, 4096),
    "IdentifyNamespace": (IdentifyNamespace.unpack_from, 4096),
    "IdentifyNamespace.block_size": (lambda b: IdentifyNamespace.unpack_from(b).block_size,
                                     4096),
    "ActiveNamespaceList": (ActiveNamespaceList.unpack_from, 4096),
    "NamespaceIdDescriptorList": (NamespaceIdDescriptorList.unpack_from, 4096),
    "DiscoveryLogHeader": (DiscoveryLogHeader.unpack_from, 1024),
    "DiscoveryLogEntry": (DiscoveryLogEntry.unpack_from, 1024),
    "DiscoveryLogEntry.iter_from": (lambda b: list(DiscoveryLogEntry.iter_from(b, 3, 0)),
                                    2048),
    "RdmaTsas": (RdmaTsas.unpack_from, 256),
    "ErrorLogEntry": (ErrorLogEntry.unpack_from, 64),
    "SmartLog": (SmartLog.unpack_from, 512),
    "ChangedNamespaceList": (ChangedNamespaceList.unpack_from, 4096),
    "DSMRange": (DSMRange.unpack_from, 16),
    "DSMRange.iter_from": (lambda b: list(DSMRange.iter_from(b, 4)), 64),
    "AsyncEvent": (lambda b: AsyncEvent.from_int(int.from_bytes(b[:4], "little")), 4),
}
for _cls in (ReadWrite, ConnectCommand, PropertyGet, PropertySet, Identify, GetLogPage,
             SetFeatures, GetFeatures, KeepAlive, AsyncEventRequest, Flush, WriteZeroes,
             DatasetManagement):
    DECODERS[f"{_cls.__name__}.from_sqe"] = (
        lambda b, c=_cls: c.from_sqe(SQE.unpack_from(b)), 64)
CM_DECODERS = {"CMConnectRequest": (CMConnectRequest.unpack_from, 32),
               "CMAccept": (CMAccept.unpack_from, 32), "CMReject": (CMReject.unpack_from, 4)}


@pytest.mark.parametrize("name", sorted(DECODERS))
@FUZZ
@given(data=st.data())
def test_only_protocol_errors_escape(name: str, data: st.DataObject) -> None:
    decode, size = DECODERS[name]
    raw = data.draw(_sized(size))
    for buf in (raw, bytearray(raw), memoryview(raw)):
        try:
            decode(buf)
        except ProtocolError as exc:
            assert isinstance(exc.status, StatusCode) and exc.status != StatusCode.SUCCESS


@pytest.mark.parametrize("name", sorted(CM_DECODERS))
@FUZZ
@given(data=st.data())
def test_cm_decoders_always_say_how_to_reject(name: str, data: st.DataObject) -> None:
    decode, size = CM_DECODERS[name]
    try:
        decode(data.draw(_sized(size)))
    except ProtocolError as exc:
        assert exc.cm_reject is not None and isinstance(exc.status, StatusCode)


@pytest.mark.parametrize("length", range(0, 64, 7))
def test_short_sqe_is_refused_with_a_status(length: int) -> None:
    with pytest.raises(ProtocolError) as info:
        SQE.unpack_from(bytes(length))
    assert info.value.status == StatusCode.INVALID_FIELD


@pytest.mark.parametrize("type_byte, status", [
    (0x41, StatusCode.INVALID_FIELD),  # keyed, bad subtype
    (0x00, StatusCode.INVALID_FIELD),  # data block, address subtype: not accepted by nvmet
    (0x50, StatusCode.SGL_DESCRIPTOR_TYPE_INVALID),  # unknown type
    (0x20, StatusCode.SGL_DESCRIPTOR_TYPE_INVALID),  # segment
    (0x30, StatusCode.SGL_DESCRIPTOR_TYPE_INVALID),  # last segment
])
def test_bad_sgl_statuses_carry_the_cid(type_byte: int, status: StatusCode) -> None:
    raw = bytearray(SQE(opcode=2, cid=0x1234).pack())
    raw[39] = type_byte
    with pytest.raises(ProtocolError) as info:
        SQE.unpack_from(raw)
    assert (info.value.status, info.value.dnr, info.value.cid) == (status, True, 0x1234)


def test_sqe_flags_must_say_sgl_and_not_fused() -> None:
    for flags in (0x00, 0x41, 0x80, 0xC0):
        with pytest.raises(ProtocolError) as info:
            SQE.unpack_from(SQE(opcode=2, flags=flags, cid=7).pack())
        assert (info.value.status, info.value.cid) == (StatusCode.INVALID_FIELD, 7)


@pytest.mark.parametrize("cls, status", [(ConnectData, StatusCode.SGL_DATA_LENGTH_INVALID),
                                         (IdentifyController, StatusCode.SGL_DATA_LENGTH_INVALID),
                                         (CQE, StatusCode.DATA_TRANSFER_ERROR)])
def test_short_buffers_get_the_structures_own_status(cls: Any, status: StatusCode) -> None:
    with pytest.raises(ProtocolError) as info:
        cls.unpack_from(bytes(cls.SIZE - 1))
    assert info.value.status == status


def test_cm_private_data_errors() -> None:
    from blockfabric.protocol import CMRejectStatus

    with pytest.raises(ProtocolError) as info:
        CMConnectRequest.unpack_from(bytes(31))
    assert info.value.cm_reject is CMRejectStatus.INVALID_PRIVATE_DATA_LENGTH
    with pytest.raises(ProtocolError) as info:
        CMConnectRequest.unpack_from(b"\x01" + bytes(31))
    assert info.value.cm_reject is CMRejectStatus.INVALID_RECFMT
    req = CMConnectRequest(qid=0, hrqsize=32, hsqsize=32)
    with pytest.raises(ProtocolError) as info:
        req.check_limits()  # admin receive queue of 33 > 32
    assert info.value.cm_reject is CMRejectStatus.INVALID_HSQSIZE
    CMConnectRequest(qid=0, hrqsize=32, hsqsize=31).check_limits()


@pytest.mark.parametrize("cmd_cls, sqe, status", [
    (Identify, SQE(0x06, cdw10=0x06), StatusCode.INVALID_FIELD),  # CNS 6 unsupported
    (GetLogPage, SQE(0x02, cdw10=0x7F), StatusCode.INVALID_LOG_PAGE),
    (GetLogPage, SQE(0x02, cdw10=0x70, cdw12=2), StatusCode.INVALID_FIELD),  # lpo unaligned
    (SetFeatures, SQE(0x09, cdw10=0x03), StatusCode.INVALID_FIELD),  # unknown FID
    (ConnectCommand, SQE(0x7F, nsid=1, cdw10=1), StatusCode.CONNECT_INCOMPATIBLE_FORMAT),
    (ReadWrite, SQE(0x09), StatusCode.INVALID_OPCODE),
    (Flush, SQE(0x01), StatusCode.INVALID_OPCODE),
    (PropertyGet, SQE(0x7F, nsid=0), StatusCode.INVALID_OPCODE),  # fctype is property set
])
def test_typed_commands_refuse_with_specific_status(cmd_cls: Any, sqe: SQE,
                                                    status: StatusCode) -> None:
    sqe.cid = 0x55
    with pytest.raises(ProtocolError) as info:
        cmd_cls.from_sqe(sqe)
    assert (info.value.status, info.value.dnr, info.value.cid) == (status, True, 0x55)
