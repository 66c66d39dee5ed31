"""The NVMe/TCP PDU codec: the spec sheet's worked values, and every malformed header a
receiver must refuse with the right FES (spec sheet nvmeof-tcp-ana-resv.md, section 1)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockfabric.protocol import tcp_pdu
from blockfabric.protocol.tcp_pdu import Fes, Limits, PduError

OPEN = Limits(max_capsule_data=8192, max_data=128 << 10)
DIGESTS = Limits(True, True, 8192, 128 << 10)


def check(buf, *, to_controller=True, initialized=True, limits=OPEN) -> int:
    return tcp_pdu.check_header(*tcp_pdu.header(buf), to_controller=to_controller,
                                initialized=initialized, limits=limits)


def refused(buf, fes, fei=None, **kw) -> PduError:
    with pytest.raises(PduError) as info:
        check(buf, **kw)
    assert info.value.fes == fes, info.value
    if fei is not None:
        assert info.value.fei == fei, info.value
    return info.value


def common(ptype, flags, hlen, pdo, plen) -> bytes:
    return tcp_pdu.COMMON.pack(ptype, flags, hlen, pdo, plen)


def test_crc32c_check_value_and_the_sheets_worked_header_digest():
    assert tcp_pdu.digest(b"123456789") == 0xE3069283
    resp = tcp_pdu.capsule_resp(bytes(16), hdgst=True)
    assert bytes(resp[:8]) == bytes.fromhex("050118001c000000")
    assert bytes(resp[24:28]) == bytes.fromhex("9b120389")


def test_icreq_round_trip_and_what_a_controller_refuses():
    req = tcp_pdu.ICReq(hdgst=True, ddgst=False, maxr2t=3)
    raw = req.pack()
    assert len(raw) == 128 and raw[:8] == common(tcp_pdu.ICREQ, 0, 128, 0, 128)
    assert check(raw, initialized=False) == 0
    assert tcp_pdu.ICReq.unpack(raw) == req
    bad = bytearray(raw)
    struct.pack_into("<H", bad, 8, 1)
    with pytest.raises(PduError) as info:
        tcp_pdu.ICReq.unpack(bad)
    assert info.value.fes == Fes.INVALID_HEADER_FIELD and info.value.fei == 8
    bad = bytearray(raw)
    bad[10] = 31                                 # HPDA: 128-byte alignment, the most
    assert tcp_pdu.ICReq.unpack(bad).hpda == 31
    bad[10] = 32
    with pytest.raises(PduError) as info:
        tcp_pdu.ICReq.unpack(bad)
    assert info.value.fes == Fes.INVALID_HEADER_FIELD and info.value.fei == 10
    refused(raw, Fes.SEQUENCE_ERROR, initialized=True)      # a second ICReq


@pytest.mark.parametrize("field, value, fei", [("flags", 1, 1), ("pdo", 4, 3),
                                               ("plen", 132, 4), ("hlen", 24, 2)])
def test_icreq_header_fields(field, value, fei):
    raw = bytearray(tcp_pdu.ICReq().pack())
    raw[{"flags": 1, "hlen": 2, "pdo": 3}.get(field, 4)] = value
    if field == "plen":
        struct.pack_into("<I", raw, 4, value)
    refused(raw, Fes.INVALID_HEADER_FIELD, fei, initialized=False)


def test_icresp_checked_as_the_linux_host_checks_it():
    req = tcp_pdu.ICReq(hdgst=True, ddgst=True)
    ok = tcp_pdu.ICResp(hdgst=True, ddgst=True, maxh2cdata=131072)
    assert tcp_pdu.ICResp.unpack(ok.pack(), req) == ok
    for bad in (tcp_pdu.ICResp(hdgst=False, ddgst=True, maxh2cdata=131072),   # digests differ
                tcp_pdu.ICResp(hdgst=True, ddgst=True, maxh2cdata=4094),      # < 4096
                tcp_pdu.ICResp(hdgst=True, ddgst=True, maxh2cdata=4098),      # not % 4
                tcp_pdu.ICResp(cpda=32, hdgst=True, ddgst=True, maxh2cdata=8192)):
        with pytest.raises(PduError):
            tcp_pdu.ICResp.unpack(bad.pack(), req)
    padded = tcp_pdu.ICResp(cpda=31, hdgst=True, ddgst=True, maxh2cdata=8192)
    assert tcp_pdu.ICResp.unpack(padded.pack(), req) == padded


@pytest.mark.parametrize("pda, hdgst, pdo", [(0, False, 24), (0, True, 28), (1, False, 24),
                                             (3, True, 32), (7, False, 32), (31, True, 128)])
def test_data_padded_to_the_receivers_alignment(pda, hdgst, pdo):
    """PDO: the header and its digest rounded up to (PDA + 1) dwords, zero padding between;
    a receiver takes exactly that PDO and no other."""
    align = tcp_pdu.align_of(pda)
    limits = tcp_pdu.Limits(hdgst=hdgst, ddgst=True, max_data=1 << 20, max_capsule_data=8192,
                            align=align)
    hdr = tcp_pdu.data_header(tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST, 1, 0, 0, 512, hdgst, True,
                              align)
    assert len(hdr) == hdr[3] == pdo and not any(hdr[24 + 4 * hdgst:])
    assert struct.unpack_from("<I", hdr, 4)[0] == pdo + 512 + 4
    ptype, flags, hlen, got_pdo, plen = tcp_pdu.header(hdr)
    assert tcp_pdu.check_header(ptype, flags, hlen, got_pdo, plen, to_controller=False,
                                initialized=True, limits=limits) == 512
    cap = tcp_pdu.capsule_cmd_header(bytes(64), 100, hdgst, True, align)
    assert cap[3] == len(cap) == -(-(72 + 4 * hdgst) // align) * align
    assert tcp_pdu.check_header(*tcp_pdu.header(cap), to_controller=True, initialized=True,
                                limits=limits) == 100
    for wrong in {24 + 4 * hdgst, pdo - 4, pdo + 4, pdo + align} - {pdo}:
        with pytest.raises(PduError) as info:
            tcp_pdu.check_header(ptype, flags, hlen, wrong, plen, to_controller=False,
                                 initialized=True, limits=limits)
        assert (info.value.fes, info.value.fei) == (Fes.INVALID_HEADER_FIELD, tcp_pdu.FEI_PDO)


def test_capsule_cmd_with_and_without_data_and_digests():
    sqe = bytes(range(64))
    hdr = tcp_pdu.capsule_cmd_header(sqe, 0, False, False)
    assert bytes(hdr[:8]) == common(tcp_pdu.CAPSULE_CMD, 0, 72, 0, 72)
    assert check(hdr) == 0
    hdr = tcp_pdu.capsule_cmd_header(sqe, 1024, True, True)
    flags, hlen, pdo, plen = hdr[1], hdr[2], hdr[3], struct.unpack_from("<I", hdr, 4)[0]
    assert (flags, hlen, pdo, plen) == (3, 72, 76, 72 + 4 + 1024 + 4)
    assert check(hdr, limits=DIGESTS) == 1024
    assert struct.unpack_from("<I", hdr, 72)[0] == tcp_pdu.digest(bytes(hdr[:72]))


def test_data_pdus_and_r2t():
    hdr = tcp_pdu.data_header(tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST | tcp_pdu.F_DATA_SUCCESS, 7,
                              0, 0, 4096, True, True)
    assert check(hdr, to_controller=False, limits=DIGESTS) == 4096
    assert tcp_pdu.unpack_data_fields(hdr) == (7, 0, 0, 4096)
    r2t = tcp_pdu.data_header(tcp_pdu.R2T, 0, 9, 3, 0, 1 << 20, False, False)
    assert bytes(r2t[:8]) == common(tcp_pdu.R2T, 0, 24, 0, 24)
    assert check(r2t, to_controller=False) == 0
    assert tcp_pdu.unpack_data_fields(r2t) == (9, 3, 0, 1 << 20)


def test_term_req_layout():
    raw = tcp_pdu.term_req(tcp_pdu.C2H_TERM, Fes.HEADER_DIGEST, 72, b"\x04" * 200)
    assert len(raw) == tcp_pdu.TERM_MAX_PLEN
    assert raw[:8] == common(tcp_pdu.C2H_TERM, 0, 24, 0, 152)
    # FEI is reserved for a header digest error (only 01h and 06h say where): zero
    assert tcp_pdu.unpack_term(raw) == (Fes.HEADER_DIGEST, 0)
    assert check(raw, to_controller=False, limits=DIGESTS) == 128   # never digests
    for fes in (Fes.INVALID_HEADER_FIELD, Fes.UNSUPPORTED_PARAMETER):
        assert tcp_pdu.unpack_term(tcp_pdu.term_req(tcp_pdu.C2H_TERM, fes, 10)) == (fes, 10)
    for fes in (Fes.SEQUENCE_ERROR, Fes.DATA_OUT_OF_RANGE, Fes.DATA_LIMIT_EXCEEDED):
        assert tcp_pdu.unpack_term(tcp_pdu.term_req(tcp_pdu.C2H_TERM, fes, 12)) == (fes, 0)


@pytest.mark.parametrize("name, raw, fes, fei, kw", [
    # a type a controller never receives, and an unknown one
    ("C2HData to a controller", common(tcp_pdu.C2H_DATA, 0, 24, 24, 28), Fes.INVALID_HEADER_FIELD,
     0, {}),
    ("type 0x8", common(0x8, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0, {}),
    ("type 0xff", common(0xFF, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 0, {}),
    ("CapsuleCmd before ICReq", common(tcp_pdu.CAPSULE_CMD, 0, 72, 0, 72), Fes.SEQUENCE_ERROR, 0,
     {"initialized": False}),
    ("CapsuleCmd hlen", common(tcp_pdu.CAPSULE_CMD, 0, 64, 0, 72), Fes.INVALID_HEADER_FIELD, 2,
     {}),
    ("plen shorter than header", common(tcp_pdu.CAPSULE_CMD, 0, 72, 0, 40),
     Fes.INVALID_HEADER_FIELD, 4, {}),
    ("pdo without data", common(tcp_pdu.CAPSULE_CMD, 0, 72, 72, 72), Fes.INVALID_HEADER_FIELD, 3,
     {}),
    ("pdo inside the header", common(tcp_pdu.CAPSULE_CMD, 0, 72, 8, 72 + 512),
     Fes.INVALID_HEADER_FIELD, 3, {}),
    ("pdo past the start", common(tcp_pdu.CAPSULE_CMD, 0, 72, 80, 72 + 512),
     Fes.INVALID_HEADER_FIELD, 3, {}),
    ("in-capsule data too long", common(tcp_pdu.CAPSULE_CMD, 0, 72, 72, 72 + 8193),
     Fes.INVALID_HEADER_FIELD, 4, {}),
    ("H2CData beyond MAXH2CDATA", common(tcp_pdu.H2C_DATA, 0, 24, 24, 24 + (128 << 10) + 1),
     Fes.DATA_LIMIT_EXCEEDED, 4, {}),
    ("H2CData without data", common(tcp_pdu.H2C_DATA, 0, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 4,
     {}),
    ("header digest flag not negotiated", common(tcp_pdu.CAPSULE_CMD, tcp_pdu.F_HDGST, 72, 0, 76),
     Fes.INVALID_HEADER_FIELD, 1, {}),
    ("header digest flag missing",
     common(tcp_pdu.CAPSULE_CMD, tcp_pdu.F_DDGST, 72, 76, 76 + 16 + 4),
     Fes.INVALID_HEADER_FIELD, 1, {"limits": DIGESTS}),
    ("data digest flag missing", common(tcp_pdu.H2C_DATA, tcp_pdu.F_HDGST, 24, 28, 28 + 16),
     Fes.INVALID_HEADER_FIELD, 1, {"limits": DIGESTS}),
    ("SUCCESS on an H2CData", common(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_SUCCESS, 24, 24, 24 + 16),
     Fes.INVALID_HEADER_FIELD, 1, {}),
    ("data digest on a capsule without data", common(tcp_pdu.CAPSULE_CMD, 3, 72, 0, 76),
     Fes.INVALID_HEADER_FIELD, 1, {"limits": DIGESTS}),
    ("term request with a digest flag", common(tcp_pdu.H2C_TERM, tcp_pdu.F_HDGST, 24, 0, 24),
     Fes.INVALID_HEADER_FIELD, 1, {}),
    ("term request too long", common(tcp_pdu.H2C_TERM, 0, 24, 0, 153), Fes.INVALID_HEADER_FIELD,
     4, {}),
])
def test_malformed_headers_refused_with_their_fes(name, raw, fes, fei, kw):
    refused(raw, fes, fei, **kw)


def test_host_refuses_what_only_a_controller_receives():
    refused(common(tcp_pdu.CAPSULE_CMD, 0, 72, 0, 72), Fes.INVALID_HEADER_FIELD, 0,
            to_controller=False)
    refused(common(tcp_pdu.H2C_DATA, 0, 24, 24, 40), Fes.INVALID_HEADER_FIELD, 0,
            to_controller=False)
    refused(common(tcp_pdu.R2T, tcp_pdu.F_DATA_LAST, 24, 0, 24), Fes.INVALID_HEADER_FIELD, 1,
            to_controller=False)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=8, max_size=8), st.booleans(), st.booleans(), st.booleans())
def test_any_header_is_accepted_with_a_bounded_length_or_refused_with_a_fes(
        raw, to_controller, initialized, digests):
    limits = DIGESTS if digests else OPEN
    try:
        n = check(raw, to_controller=to_controller, initialized=initialized, limits=limits)
    except PduError as exc:
        assert exc.fes in set(Fes) and 0 <= exc.fei < 8
        return
    ptype, _f, hlen, pdo, plen = tcp_pdu.header(raw)
    assert 0 <= n <= max(limits.max_capsule_data, limits.max_data, 128)
    assert plen >= hlen and (n == 0 or pdo >= hlen)
