"""Malformed NVMe/TCP PDUs from a raw socket, each on its own connection, while a host
verifies its data over NVMe/TCP beside them: every fatal one gets a C2HTermReq with the FES
the spec names and then the end of only that connection; a data digest that does not match
fails only its command (Transient Transport Error) and the connection goes on; garbage
never crashes the target, and the bystander sees no error and no wrong byte."""

from __future__ import annotations

import random
import socket
import struct
import time

import pytest

from blockfabric.protocol import ConnectCommand, ConnectData, OffsetSGL
from blockfabric.protocol.fabrics import (CC_IOCQES, CC_IOSQES, Property, PropertyGet,
                                          PropertySet)
from blockfabric.protocol.rw import pack_rw_into
from blockfabric.protocol import tcp_pdu
from blockfabric.protocol.tcp_pdu import Fes

from .conftest import HOSTNQN, MAX_CONN, NQN, TargetProbe, assert_undisturbed

pytestmark = pytest.mark.needs_transport(
    "tcp", "forges NVMe/TCP PDUs; nothing of it goes over RDMA")


@pytest.fixture(params=(1, 2), ids=lambda n: f"{n}r")
def target_reactors(request) -> int:
    """Every test here with one poll group and with two (NVMe/TCP I/O queues in a
    worker process: malformed PDUs there too)."""
    return request.param


MAXH2CDATA = 128 << 10          # what the target's ICResp offers
TRANSIENT_TRANSPORT_ERROR = 0x22


class RawTcp:
    """A peer that speaks NVMe/TCP by hand."""

    def __init__(self, port: int, *, hdgst: bool = False, ddgst: bool = False,
                 icreq: bytes | None = b"", maxr2t: int = 0, rcvbuf: int = 0) -> None:
        if rcvbuf:                  # a small receive buffer (set before the handshake)
            self.sock = socket.socket()
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            self.sock.settimeout(5)
            self.sock.connect(("127.0.0.1", port))
        else:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.hdgst, self.ddgst = hdgst, ddgst
        self.buf = b""
        self.align = 4
        if icreq == b"":
            request = tcp_pdu.ICReq(hdgst=hdgst, ddgst=ddgst, maxr2t=maxr2t)
            self.sock.sendall(request.pack())
            resp = tcp_pdu.ICResp.unpack(self.read_pdu(), request)
            assert resp.maxh2cdata == MAXH2CDATA
            self.align = tcp_pdu.align_of(resp.cpda)
        elif icreq is not None:
            self.sock.sendall(icreq)

    def send(self, *parts: bytes) -> None:
        self.sock.sendall(b"".join(bytes(p) for p in parts))

    def read_pdu(self) -> bytes:
        """The next PDU, or b"" at EOF."""
        while True:
            if len(self.buf) >= 8:
                plen = struct.unpack_from("<I", self.buf, 4)[0]
                if len(self.buf) >= plen:
                    pdu, self.buf = self.buf[:plen], self.buf[plen:]
                    return pdu
            chunk = self.sock.recv(65536)
            if not chunk:
                assert not self.buf, f"{len(self.buf)} bytes of a PDU before EOF"
                return b""
            self.buf += chunk

    def terminated(self) -> tuple[int, int]:
        """Read to EOF: the last PDU must be a C2HTermReq; its (FES, FEI)."""
        last = b""
        while True:
            pdu = self.read_pdu()
            if not pdu:
                break
            last = pdu
        assert last and last[0] == tcp_pdu.C2H_TERM, f"no C2HTermReq before EOF: {last[:8]!r}"
        assert tcp_pdu.TERM_HLEN <= len(last) <= tcp_pdu.TERM_MAX_PLEN
        fes, fei = tcp_pdu.unpack_term(last)
        # FEI only where the FES gives it a meaning (01h, 06h: where the error is), reserved
        # (zero) otherwise; after the header, the offending PDU's header alone (up to 128
        # bytes): not its data, nor the PDUs after it (SPDK does the same)
        if fes not in (Fes.INVALID_HEADER_FIELD, Fes.UNSUPPORTED_PARAMETER):
            assert fei == 0, (fes, fei)
        extra = last[tcp_pdu.TERM_HLEN:]
        if len(extra) >= 8:         # (at most: a header cut short is sent as it came)
            assert len(extra) <= min(extra[2], 128), (len(extra), bytes(extra[:8]))
        return fes, fei

    def capsule(self, sqe: bytes, data: bytes = b"", *, bad_ddgst: bool = False,
                bad_hdgst: bool = False, align: int | None = None) -> None:
        """A CapsuleCmd, its data padded as the ICResp asked (or to ``align``)."""
        hdr = tcp_pdu.capsule_cmd_header(sqe, len(data), self.hdgst, self.ddgst,
                                         self.align if align is None else align)
        if bad_hdgst:
            hdr[72] ^= 0xFF
        tail = b""
        if data and self.ddgst:
            tail = struct.pack("<I", tcp_pdu.digest(data) ^ (1 if bad_ddgst else 0))
        self.send(hdr, data, tail)

    def close(self) -> None:
        self.sock.close()


def connect_sqe(transport_sgl: bool) -> bytes:
    """An admin-queue Fabrics Connect (cid 1), its data in-capsule or asked for by R2T."""
    sqe = bytearray(ConnectCommand(recfmt=0, qid=0, sqsize=31, cattr=0, kato=0).to_sqe(
        cid=1, sgl=OffsetSGL(0, 1024)).pack())
    if transport_sgl:
        struct.pack_into("<QQ", sqe, 24, 0, 1024 | tcp_pdu.SGL_TRANSPORT << 56)
    return bytes(sqe)


CONNECT_DATA = ConnectData(hostid=bytes(16), cntlid=0xFFFF, subnqn=NQN, hostnqn=HOSTNQN).pack()


def status_of(resp: bytes) -> int:
    """The status code (SCT and SC) of a CapsuleResp."""
    assert resp[0] == tcp_pdu.CAPSULE_RESP, resp[:8]
    return (struct.unpack_from("<H", resp, 22)[0] >> 1) & 0x7FF


class RawSession:
    """A controller made by hand: the admin queue connected and enabled (kept open), and
    :meth:`io_queue` connects I/O queues to it with what ICReq the caller asks."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.admin = RawTcp(port)
        self.admin.capsule(connect_sqe(False), CONNECT_DATA)
        resp = self.admin.read_pdu()
        assert status_of(resp) == 0, resp
        self.cntlid = struct.unpack_from("<H", resp, 8)[0]
        cc = 1 | CC_IOSQES << 16 | CC_IOCQES << 20       # EN, the NVM command set
        sqe = bytearray(PropertySet(attrib=0, offset=Property.CC, value=cc).to_sqe(
            cid=2).pack())
        struct.pack_into("<QQ", sqe, 24, 0, tcp_pdu.SGL_TRANSPORT << 56)     # no data
        self.admin.capsule(bytes(sqe))
        assert status_of(self.admin.read_pdu()) == 0
        deadline = time.monotonic() + 5
        while True:                         # until CSTS.RDY, as a host waits
            sqe = bytearray(PropertyGet(attrib=0, offset=Property.CSTS).to_sqe(
                cid=3).pack())
            struct.pack_into("<QQ", sqe, 24, 0, tcp_pdu.SGL_TRANSPORT << 56)
            self.admin.capsule(bytes(sqe))
            resp = self.admin.read_pdu()
            assert status_of(resp) == 0
            if resp[8] & 1 or time.monotonic() > deadline:
                break
            time.sleep(0.01)

    def io_queue(self, **kw) -> RawTcp:
        peer = RawTcp(self.port, **kw)
        sqe = ConnectCommand(recfmt=0, qid=1, sqsize=31, cattr=0, kato=0).to_sqe(
            cid=1, sgl=OffsetSGL(0, 1024)).pack()
        peer.capsule(sqe, ConnectData(hostid=bytes(16), cntlid=self.cntlid, subnqn=NQN,
                                      hostnqn=HOSTNQN).pack())
        assert status_of(peer.read_pdu()) == 0
        return peer

    def close(self) -> None:
        self.admin.close()


def write_sqe(cid: int, slba: int, length: int) -> bytes:
    """A Write of ``length`` bytes (4 KiB blocks, the default) whose data the target asks
    for."""
    sqe = bytearray(64)
    pack_rw_into(sqe, 0x01, cid, 1, slba, length // 4096 - 1, 0,
                 length | tcp_pdu.SGL_TRANSPORT << 56)
    return bytes(sqe)


def read_sqe(cid: int, slba: int, length: int) -> bytes:
    sqe = bytearray(64)
    pack_rw_into(sqe, 0x02, cid, 1, slba, length // 4096 - 1, 0,
                 length | tcp_pdu.SGL_TRANSPORT << 56)
    return bytes(sqe)


def with_r2t(port: int, **kw) -> tuple[RawTcp, int]:
    """A connection whose Connect waits for its data: the R2T's ttag."""
    peer = RawTcp(port, **kw)
    peer.capsule(connect_sqe(True))
    r2t = peer.read_pdu()
    assert r2t[0] == tcp_pdu.R2T, r2t[:8]
    cccid, ttag, offset, length = tcp_pdu.unpack_data_fields(r2t)
    assert (cccid, offset, length) == (1, 0, 1024)
    return peer, ttag


def h2c(cccid: int, ttag: int, offset: int, data: bytes, *, flags: int = tcp_pdu.F_DATA_LAST,
        length: int | None = None) -> bytes:
    return bytes(tcp_pdu.data_header(tcp_pdu.H2C_DATA, flags, cccid, ttag, offset,
                                     len(data) if length is None else length, False, False)) + data


def common(ptype, flags, hlen, pdo, plen) -> bytes:
    return tcp_pdu.COMMON.pack(ptype, flags, hlen, pdo, plen)


def _raw_header(ptype, flags, hlen, pdo, plen, size) -> bytes:
    return common(ptype, flags, hlen, pdo, plen) + bytes(size - 8)


#: (name, what the attacker does on a fresh connection, the FES of the answer)
FATAL = [
    ("capsule before ICReq", lambda p: RawTcp(p, icreq=tcp_pdu.capsule_cmd_header(
        connect_sqe(False), 0, False, False)), Fes.SEQUENCE_ERROR),
    ("ICReq with PFV 1", lambda p: RawTcp(p, icreq=tcp_pdu.ICReq(pfv=1).pack()),
     Fes.INVALID_HEADER_FIELD),
    ("ICReq HPDA 32", lambda p: RawTcp(p, icreq=tcp_pdu.ICReq(hpda=32).pack()),
     Fes.INVALID_HEADER_FIELD),
    ("ICReq with plen 64", lambda p: RawTcp(p, icreq=common(0, 0, 128, 0, 64) + bytes(56)),
     Fes.INVALID_HEADER_FIELD),
    ("a second ICReq", lambda p: _then(RawTcp(p), tcp_pdu.ICReq().pack()), Fes.SEQUENCE_ERROR),
    ("unknown PDU type 0x0f", lambda p: _then(RawTcp(p), _raw_header(0xF, 0, 24, 0, 24, 24)),
     Fes.INVALID_HEADER_FIELD),
    ("an R2T from the host", lambda p: _then(RawTcp(p), tcp_pdu.data_header(
        tcp_pdu.R2T, 0, 1, 0, 0, 4096, False, False)), Fes.INVALID_HEADER_FIELD),
    ("a C2HData from the host", lambda p: _then(RawTcp(p), tcp_pdu.data_header(
        tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST, 1, 0, 0, 4, False, False) + bytes(4)),
     Fes.INVALID_HEADER_FIELD),
    ("capsule hlen 64", lambda p: _then(RawTcp(p), _raw_header(4, 0, 64, 0, 72, 72)),
     Fes.INVALID_HEADER_FIELD),
    ("plen shorter than the header", lambda p: _then(RawTcp(p), _raw_header(
        4, 0, 72, 0, 16, 72)), Fes.INVALID_HEADER_FIELD),
    ("pdo inside the header", lambda p: _then(RawTcp(p), _raw_header(
        4, 0, 72, 40, 72 + 1024, 72 + 1024)), Fes.INVALID_HEADER_FIELD),
    ("1 GiB of in-capsule data announced", lambda p: _then(RawTcp(p), _raw_header(
        4, 0, 72, 72, 1 << 30, 72)), Fes.INVALID_HEADER_FIELD),
    ("header digest mismatch", lambda p: _do(RawTcp(p, hdgst=True), lambda r: r.capsule(
        connect_sqe(False), CONNECT_DATA, bad_hdgst=True)), Fes.HEADER_DIGEST),
    ("header digest missing", lambda p: _then(RawTcp(p, hdgst=True), tcp_pdu.capsule_cmd_header(
        connect_sqe(False), 0, False, False)), Fes.INVALID_HEADER_FIELD),
    ("H2CData without an R2T", lambda p: _then(RawTcp(p), h2c(1, 0, 0, bytes(512))),
     Fes.INVALID_HEADER_FIELD),
    ("H2CData at the wrong offset", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        1, t, 512, bytes(512))), Fes.DATA_OUT_OF_RANGE),
    ("H2CData beyond the R2T", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        1, t, 0, bytes(2048))), Fes.DATA_OUT_OF_RANGE),
    ("H2CData beyond MAXH2CDATA", lambda p: _h2c_after_r2t(p, lambda t: common(
        tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 24, 24, 24 + MAXH2CDATA + 4) + struct.pack(
        "<HHII4x", 1, t, 0, MAXH2CDATA + 4)), Fes.DATA_LIMIT_EXCEEDED),
    ("H2CData for another command", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        2, t, 0, bytes(1024))), Fes.INVALID_HEADER_FIELD),
    ("H2CData length field and plen disagree", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        1, t, 0, bytes(1024), length=1000)), Fes.INVALID_HEADER_FIELD),
    ("the last H2CData without LAST", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        1, t, 0, bytes(1024), flags=0)), Fes.INVALID_HEADER_FIELD),
    # next to the plain shapes the receive path takes without check_header's call
    # (PduConnection.negotiated): each must still be refused, by check_header
    ("capsule with pdo 72 and no data", lambda p: _then(RawTcp(p), _raw_header(
        4, 0, 72, 72, 72, 72)), Fes.INVALID_HEADER_FIELD),
    ("capsule without data, data digest flag", lambda p: _then(RawTcp(p), _raw_header(
        4, tcp_pdu.F_DDGST, 72, 0, 72, 72)), Fes.INVALID_HEADER_FIELD),
    ("capsule with the LAST flag", lambda p: _then(RawTcp(p), _raw_header(
        4, tcp_pdu.F_DATA_LAST, 72, 0, 72, 72)), Fes.INVALID_HEADER_FIELD),
    ("H2CData with pdo 24 and no data", lambda p: _h2c_after_r2t(p, lambda t: common(
        tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 24, 24, 24) + struct.pack(
        "<HHII4x", 1, t, 0, 0)), Fes.INVALID_HEADER_FIELD),
    ("H2CData with the SUCCESS flag", lambda p: _h2c_after_r2t(p, lambda t: h2c(
        1, t, 0, bytes(1024), flags=tcp_pdu.F_DATA_LAST | tcp_pdu.F_DATA_SUCCESS)),
     Fes.INVALID_HEADER_FIELD),
]


def _then(peer: RawTcp, data: bytes) -> RawTcp:
    peer.send(data)
    return peer


def _do(peer: RawTcp, action) -> RawTcp:
    action(peer)
    return peer


def _h2c_after_r2t(port: int, make) -> RawTcp:
    peer, ttag = with_r2t(port)
    peer.send(make(ttag))
    return peer


@pytest.fixture
def transport() -> str:
    """The bystander's: NVMe/TCP, beside the attacks."""
    return "tcp"


@pytest.mark.timeout(90)
def test_malformed_pdus_end_only_their_connection(target, transport, bystander):
    port = target.tcp_port
    probe = TargetProbe(target)
    with bystander.attack("malformed NVMe/TCP PDUs"):
        for _ in range(3):
            for name, attack, fes in FATAL:
                peer = attack(port)
                try:
                    got = peer.terminated()
                finally:
                    peer.close()
                assert got[0] == fes, (name, got)
        # a data digest error costs only the command: Transient Transport Error
        peer = RawTcp(port, ddgst=True)
        peer.capsule(connect_sqe(False), CONNECT_DATA, bad_ddgst=True)
        resp = peer.read_pdu()
        assert resp[0] == tcp_pdu.CAPSULE_RESP, resp[:8]
        assert (struct.unpack_from("<H", resp, 22)[0] >> 1) & 0x7FF == \
            TRANSIENT_TRANSPORT_ERROR
        peer.capsule(connect_sqe(False), CONNECT_DATA)           # the same, intact: served
        resp = peer.read_pdu()
        assert resp[0] == tcp_pdu.CAPSULE_RESP and not struct.unpack_from("<H", resp, 22)[0] >> 1
        peer.close()
        peer, ttag = with_r2t(port, ddgst=True)
        peer.send(tcp_pdu.data_header(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 1, ttag, 0, 1024,
                                      False, True),
                  CONNECT_DATA, struct.pack("<I", tcp_pdu.digest(CONNECT_DATA) ^ 0x10))
        resp = peer.read_pdu()
        assert resp[0] == tcp_pdu.CAPSULE_RESP and \
            (struct.unpack_from("<H", resp, 22)[0] >> 1) & 0x7FF == TRANSIENT_TRANSPORT_ERROR
        peer.close()
        # a host's termination request: the target just closes
        peer = RawTcp(port)
        peer.send(tcp_pdu.term_req(tcp_pdu.H2C_TERM, Fes.SEQUENCE_ERROR, 0))
        assert peer.read_pdu() == b""
        peer.close()
        # garbage after initialisation: a termination or a close, never a crash
        rng = random.Random(18)
        for _ in range(40):
            peer = RawTcp(port)
            try:
                peer.send(rng.randbytes(rng.randint(1, 300)))
                peer.sock.shutdown(socket.SHUT_WR)
                deadline = time.monotonic() + 5
                while peer.read_pdu() and time.monotonic() < deadline:
                    pass
            finally:
                peer.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive() and "Traceback" not in target.log
    probe.assert_bounded()


CONNECT_TIMEOUT = 1


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"connect_timeout": CONNECT_TIMEOUT}], indirect=True)
def test_silent_tcp_connections_are_bounded_and_dropped(target, transport, bystander):
    """Bare TCP connections from one address that never initialise: the first
    ``max_connections_per_host`` are held until ``limits.connect_timeout``, the rest closed
    at once; then the address gets its slots back.  The bystander carries on."""
    started = time.monotonic()
    socks = []
    try:
        for _ in range(MAX_CONN + 2):
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", target.tcp_port))
            socks.append(s)
            time.sleep(0.05)        # accepted in order: the last two are over the limit
        for s in socks[MAX_CONN:]:
            assert _closed_within(s, 2), "a connection over the per-host limit was kept"
        for i, s in enumerate(socks[:MAX_CONN]):
            assert _closed_within(s, CONNECT_TIMEOUT + 3), f"silent connection {i} was kept"
        waited = time.monotonic() - started
        assert CONNECT_TIMEOUT * 0.9 <= waited < CONNECT_TIMEOUT + 4, waited
    finally:
        for s in socks:
            s.close()
    assert target.wait_log("max_connections_per_host is 6", 2), target.log
    again = []                      # the slots are back: a full set is held again
    try:
        for _ in range(MAX_CONN):
            s = socket.socket()
            again.append(s)
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", target.tcp_port))
        time.sleep(0.3)             # well within connect_timeout: none may be closed yet
        closed = [i for i, s in enumerate(again) if _closed_within(s, 0.01)]
        assert not closed, closed
    finally:
        for s in again:
            s.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()


def _r2t(pdu: bytes) -> tuple[int, int, int, int]:
    assert pdu and pdu[0] == tcp_pdu.R2T, pdu[:8]
    return tcp_pdu.unpack_data_fields(pdu)


def _quiet(peer: RawTcp, seconds: float = 0.3) -> bool:
    """Nothing more arrives within ``seconds`` (the target waits for the host)."""
    if peer.buf:
        return False
    peer.sock.settimeout(seconds)
    try:
        chunk = peer.sock.recv(65536, socket.MSG_PEEK)
    except socket.timeout:
        return True
    finally:
        peer.sock.settimeout(5)
    return not chunk


@pytest.mark.timeout(60)
@pytest.mark.parametrize("maxr2t", [0, 2])
def test_r2ts_honour_maxr2t_and_maxh2cdata(target, maxr2t):
    """A 1 MiB write from a host that allows MAXR2T + 1 R2Ts per command: R2Ts of at most
    MAXH2CDATA, never more outstanding than allowed, each next one once an earlier one's
    data is in; answered with two H2CData PDUs per R2T, the data lands where it belongs."""
    session = RawSession(target.tcp_port)
    peer = session.io_queue(maxr2t=maxr2t)
    size = 8 * MAXH2CDATA
    data = random.Random(maxr2t).randbytes(size)
    try:
        peer.capsule(write_sqe(5, 2048, size))
        outstanding = [_r2t(peer.read_pdu()) for _ in range(maxr2t + 1)]
        assert [(r[0], r[2], r[3]) for r in outstanding] == \
            [(5, i * MAXH2CDATA, MAXH2CDATA) for i in range(maxr2t + 1)]
        seen = len(outstanding)
        while outstanding:
            assert _quiet(peer), "an R2T beyond MAXR2T"
            cccid, ttag, offset, length = outstanding.pop(0)
            half = length // 2
            peer.send(h2c(cccid, ttag, offset, data[offset:offset + half], flags=0),
                      h2c(cccid, ttag, offset + half, data[offset + half:offset + length]))
            if seen < 8:
                nxt = _r2t(peer.read_pdu())
                assert nxt[2:] == (seen * MAXH2CDATA, MAXH2CDATA), nxt
                outstanding.append(nxt)
                seen += 1
        assert status_of(peer.read_pdu()) == 0
        peer.capsule(read_sqe(6, 2048, size))
        got = bytearray()
        while True:
            pdu = peer.read_pdu()
            if pdu[0] != tcp_pdu.C2H_DATA:
                assert status_of(pdu) == 0
                break
            got += pdu[pdu[3]:]
        assert got == data
    finally:
        peer.close()
        session.close()


def _answer_first_r2t(peer: RawTcp, *parts) -> None:
    cccid, ttag, offset, length = _r2t(peer.read_pdu())
    _r2t(peer.read_pdu())                   # the second one (MAXR2T 1)
    peer.send(*(h2c(cccid, ttag, *p[:2], flags=p[2]) for p in parts))


#: (name, what the host sends after two R2Ts of a 512 KiB write, the FES)
MULTI_R2T_FATAL = [
    ("H2CData across the end of its R2T", ((0, bytes(4096), 0),
                                           (4096, bytes(MAXH2CDATA), 0)),
     Fes.DATA_OUT_OF_RANGE),
    ("an R2T's last H2CData without LAST", ((0, bytes(MAXH2CDATA), 0),),
     Fes.INVALID_HEADER_FIELD),
    ("LAST before the end of the R2T", ((0, bytes(4096), tcp_pdu.F_DATA_LAST),),
     Fes.INVALID_HEADER_FIELD),
    ("the second R2T's data first", ((MAXH2CDATA, bytes(MAXH2CDATA), tcp_pdu.F_DATA_LAST),),
     Fes.DATA_OUT_OF_RANGE),
    ("H2CData once the write's data is in", ((0, bytes(MAXH2CDATA), tcp_pdu.F_DATA_LAST),
                                  (MAXH2CDATA, bytes(MAXH2CDATA), tcp_pdu.F_DATA_LAST),
                                  (2 * MAXH2CDATA, bytes(MAXH2CDATA), tcp_pdu.F_DATA_LAST),
                                  (3 * MAXH2CDATA, bytes(MAXH2CDATA), tcp_pdu.F_DATA_LAST),
                                  (4 * MAXH2CDATA, bytes(4096), tcp_pdu.F_DATA_LAST)),
     Fes.INVALID_HEADER_FIELD),
]


@pytest.mark.timeout(60)
def test_malformed_h2cdata_with_several_r2ts(target, transport, bystander):
    """Several R2Ts outstanding: H2CData that crosses an R2T's end, misplaces LAST, skips
    ahead or goes past the write each end their connection with the FES the spec names;
    the bystander carries on."""
    with bystander.attack("H2CData against several R2Ts"):
        for name, parts, fes in MULTI_R2T_FATAL:
            session = RawSession(target.tcp_port)
            peer = session.io_queue(maxr2t=1)
            try:
                peer.capsule(write_sqe(7, 4096, 4 * MAXH2CDATA))   # not the bystander's blocks
                _answer_first_r2t(peer, *parts)
                assert peer.terminated()[0] == fes, name
            finally:
                peer.close()
                session.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive() and "Traceback" not in target.log


def _padded_capsule(port: int, pdo: int) -> RawTcp:
    """A Connect whose in-capsule data starts at ``pdo`` (the listener wants 80)."""
    peer = RawTcp(port)
    assert peer.align == 16
    hdr = bytearray(tcp_pdu.capsule_cmd_header(connect_sqe(False), len(CONNECT_DATA), False,
                                               False, 16))
    hdr[3] = pdo
    struct.pack_into("<I", hdr, 4, pdo + len(CONNECT_DATA))
    peer.send(bytes(hdr[:min(pdo, len(hdr))]).ljust(pdo, b"\0"), CONNECT_DATA)
    return peer


def _padded_h2c(port: int, pdo: int) -> RawTcp:
    """The R2T's H2CData with its data at ``pdo`` (the listener wants 32)."""
    peer, ttag = with_r2t(port)
    hdr = bytearray(tcp_pdu.data_header(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 1, ttag, 0, 1024,
                                        False, False, 16))
    hdr[3] = pdo
    struct.pack_into("<I", hdr, 4, pdo + 1024)
    peer.send(bytes(hdr[:min(pdo, len(hdr))]).ljust(pdo, b"\0"), CONNECT_DATA)
    return peer


#: against the listener with CPDA 3: (name, attack, FES)
PADDING_FATAL = [
    ("capsule data not padded", lambda p: _padded_capsule(p, 72), Fes.INVALID_HEADER_FIELD),
    ("capsule data padded too far", lambda p: _padded_capsule(p, 96),
     Fes.INVALID_HEADER_FIELD),
    ("capsule data at pdo 255", lambda p: _padded_capsule(p, 255), Fes.INVALID_HEADER_FIELD),
    ("capsule pdo 78, not a multiple of 4", lambda p: _padded_capsule(p, 78),
     Fes.INVALID_HEADER_FIELD),
    ("H2CData not padded", lambda p: _padded_h2c(p, 24), Fes.INVALID_HEADER_FIELD),
    ("H2CData padded to 48", lambda p: _padded_h2c(p, 48), Fes.INVALID_HEADER_FIELD),
]


@pytest.mark.timeout(60)
def test_pdo_checked_against_the_listeners_cpda(target, transport, bystander):
    """A listener with CPDA 3: capsule and H2CData data must start exactly at the header
    rounded up to 16 bytes; any other PDO ends the connection (Invalid Header Field at the
    PDO byte), correctly padded ones are served, and the bystander carries on."""
    port = target.padded_port
    with bystander.attack("PDOs against CPDA 3"):
        for name, attack, fes in PADDING_FATAL:
            peer = attack(port)
            try:
                assert peer.terminated() == (fes, tcp_pdu.FEI_PDO), name
            finally:
                peer.close()
        peer = _padded_capsule(port, 80)
        assert status_of(peer.read_pdu()) == 0
        peer.close()
        peer = _padded_h2c(port, 32)
        assert status_of(peer.read_pdu()) == 0
        peer.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive() and "Traceback" not in target.log


def _admin_answers(session: RawSession) -> None:
    sqe = bytearray(PropertyGet(attrib=0, offset=Property.CSTS).to_sqe(cid=9).pack())
    struct.pack_into("<QQ", sqe, 24, 0, tcp_pdu.SGL_TRANSPORT << 56)
    session.admin.capsule(bytes(sqe))
    assert status_of(session.admin.read_pdu()) == 0


HOLD = 2        # limits.buffer_hold_timeout of the tests that take it, seconds


def _sq_head(peer: RawTcp) -> int:
    """The SQ head of the next CapsuleResp (C2HData before it skipped)."""
    while True:
        pdu = peer.read_pdu()
        assert pdu, "the connection ended"
        if pdu[0] == tcp_pdu.CAPSULE_RESP:
            return struct.unpack_from("<H", pdu, 16)[0]


@pytest.mark.timeout(60)
def test_every_capsule_fetched_moves_the_sq_head(target):
    """With SQ flow control (the Connect's CATTR leaves it on), each CQE reports the SQ head
    past every SQE the controller fetched, the ones it refuses included: a capsule the
    NVMe/TCP layer refuses itself (an SGL that is not NVMe/TCP's) as one the command
    decoding refuses (PSDT not SGL), else the host's view of free SQ slots falls behind by
    one per refusal."""
    session = RawSession(target.tcp_port)
    try:
        peer = session.io_queue()
        sqe = bytearray(read_sqe(5, 0, 4096))
        struct.pack_into("<QQ", sqe, 24, 0, 4096 | 0x40 << 56)   # a keyed (RDMA) SGL
        peer.capsule(bytes(sqe))
        first = _sq_head(peer)
        sqe = bytearray(read_sqe(6, 0, 4096))
        sqe[1] = 0                                              # PSDT: PRPs
        peer.capsule(bytes(sqe))
        second = _sq_head(peer)
        peer.capsule(read_sqe(7, 0, 4096))
        third = _sq_head(peer)
        # (the Connect was SQE 0 of the queue: its answer said 1)
        assert (first, second, third) == (2, 3, 4)
        peer.close()
    finally:
        session.close()
    assert target.alive() and "Traceback" not in target.log


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"buffer_hold_timeout": HOLD}], indirect=True)
@pytest.mark.parametrize("holds", ["an R2T's data", "its answers"])
def test_a_host_that_holds_its_commands_in_flight_loses_the_queue(target, transport,
                                                                   bystander, holds):
    """A Write's R2T answered by nothing, or Reads whose data the host never reads off its
    socket (it waits in the target's queue as views of the volume's memory): the commands
    hold the volume's memory and their in-flight counts (a resize or a Preempt and Abort
    would wait on them for ever; nvmet has no bound).  After limits.buffer_hold_timeout
    without any of the data sent, or any of the answers read, the queue is cut and its
    commands let go; the controller's admin queue and the bystander carry on."""
    probe = TargetProbe(target)
    session = RawSession(target.tcp_port)
    try:
        if holds == "an R2T's data":
            peer = session.io_queue()
            peer.capsule(write_sqe(5, 64, 64 << 10))
            _r2t(peer.read_pdu())
            line = "the host owed an R2T's data and sent none"
        else:
            peer = session.io_queue(rcvbuf=4096)
            for cid in range(16):           # 8 MiB of reads, never read
                peer.capsule(read_sqe(cid + 10, cid * 128, 512 << 10))
            line = "the host read none of its answers"
        started = time.monotonic()
        assert not target.wait_log(line, HOLD * 0.7), "cut before the bound"
        assert target.wait_log(line, HOLD + 6), target.log
        assert time.monotonic() - started < HOLD + 6
        if holds == "an R2T's data":
            assert _closed_within(peer.sock, 2), "logged but not cut"
        peer.close()
        _admin_answers(session)             # the controller stays
    finally:
        session.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive() and "Traceback" not in target.log
    probe.assert_bounded()
