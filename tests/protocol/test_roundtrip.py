"""decode(encode(x)) == x for every structure, over hypothesis-chosen field values."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, strategies as st

from blockfabric.protocol import (
    CAP, CC, CQE, CSTS, SQE, VS, ActiveNamespaceList, AsyncEvent, AsyncEventConfig,
    AsyncEventRequest, ChangedNamespaceList, CMAccept, CMConnectRequest, CMReject,
    ConnectCommand, ConnectData, DatasetManagement, DiscoveryLogEntry, DiscoveryLogHeader,
    DSMRange, ErrorLogEntry, Flush, GetFeatures, GetLogPage, Identify, IdentifyController,
    IdentifyNamespace, KeepAlive, LBAFormat, NamespaceIdDescriptorList, NumberOfQueues,
    PropertyGet, PropertySet, RdmaTsas, ReadWrite, SetFeatures, SmartLog, WriteZeroes,
    decode_status_word, encode_status_word, pack_discovery_log, unpack_sgl)
from tests.protocol.helpers import FAST
from tests.protocol.strategies import (
    bits_strategy, command_strategy, cqes, dsm_ranges, nid_lists, packed_strategy,
    read_writes, sgls, sqes, statuses)

PACKED = [CMConnectRequest, CMAccept, CMReject, ConnectData, IdentifyController,
          IdentifyNamespace, ActiveNamespaceList, DiscoveryLogHeader, DiscoveryLogEntry,
          RdmaTsas, ErrorLogEntry, SmartLog, ChangedNamespaceList]
BITS = [CAP, VS, CC, CSTS, LBAFormat, NumberOfQueues, AsyncEventConfig, AsyncEvent]
COMMANDS = [ConnectCommand, PropertyGet, PropertySet, Identify, GetLogPage, SetFeatures,
            GetFeatures, KeepAlive, AsyncEventRequest, Flush, WriteZeroes, DatasetManagement]


def _roundtrip_bytes(obj: Any) -> None:
    raw = obj.pack()
    assert len(raw) == obj.SIZE
    assert type(obj).unpack_from(raw) == obj
    buf = bytearray(obj.SIZE + 5)
    obj.pack_into(memoryview(buf), 5)
    assert type(obj).unpack_from(memoryview(buf), 5) == obj


@pytest.mark.parametrize("cls", PACKED, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_packed_roundtrip(cls: Any, data: st.DataObject) -> None:
    _roundtrip_bytes(data.draw(packed_strategy(cls)))


@pytest.mark.parametrize("cls", BITS, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_bits_roundtrip(cls: Any, data: st.DataObject) -> None:
    value = data.draw(bits_strategy(cls))
    assert cls.from_int(value.to_int()) == value
    assert cls.from_int(value.to_int()).to_int() == int(value)


@pytest.mark.parametrize("cls", COMMANDS, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_command_roundtrip(cls: Any, data: st.DataObject) -> None:
    cmd = data.draw(command_strategy(cls))
    cid = data.draw(st.integers(0, 0xFFFF))
    sqe = SQE.unpack_from(cmd.to_sqe(cid=cid, sgl=data.draw(sgls)).pack())
    assert sqe.cid == cid and cls.from_sqe(sqe) == cmd


@FAST
@given(read_writes, sgls, st.integers(0, 0xFFFF))
def test_read_write_roundtrip(rw: ReadWrite, sgl: Any, cid: int) -> None:
    sqe = SQE.unpack_from(rw.to_sqe(cid=cid, sgl=sgl).pack())
    assert ReadWrite.from_sqe(sqe) == rw and sqe.sgl == sgl


@FAST
@given(sqes)
def test_sqe_roundtrip(sqe: SQE) -> None:
    _roundtrip_bytes(sqe)


@FAST
@given(cqes)
def test_cqe_roundtrip(cqe: CQE) -> None:
    _roundtrip_bytes(cqe)


@FAST
@given(sgls)
def test_sgl_roundtrip(sgl: Any) -> None:
    _roundtrip_bytes(sgl)
    assert unpack_sgl(sgl.pack()) == sgl


@FAST
@given(statuses, st.booleans(), st.booleans(), st.integers(0, 3), st.integers(0, 1))
def test_status_word_roundtrip(status: Any, dnr: bool, more: bool, crd: int, phase: int
                               ) -> None:
    word = encode_status_word(status, dnr=dnr, more=more, crd=crd, phase=phase)
    assert decode_status_word(word) == (status, dnr, more, crd, phase)


@FAST
@given(st.lists(dsm_ranges, max_size=256))
def test_dsm_ranges_roundtrip(ranges: list[DSMRange]) -> None:
    raw = DSMRange.pack_ranges(ranges)
    assert list(DSMRange.iter_from(memoryview(raw), len(ranges))) == ranges
    for r in ranges[:3]:
        _roundtrip_bytes(r)


@FAST
@given(nid_lists)
def test_namespace_id_descriptors_roundtrip(value: NamespaceIdDescriptorList) -> None:
    _roundtrip_bytes(value)


@FAST
@given(st.integers(0, (1 << 64) - 1), st.lists(packed_strategy(DiscoveryLogEntry), max_size=3))
def test_discovery_log_roundtrip(genctr: int, entries: list[DiscoveryLogEntry]) -> None:
    page = pack_discovery_log(genctr, entries)
    header = DiscoveryLogHeader.unpack_from(page)
    assert (header.genctr, header.numrec) == (genctr, len(entries))
    assert list(DiscoveryLogEntry.iter_from(memoryview(page), header.numrec)) == entries
