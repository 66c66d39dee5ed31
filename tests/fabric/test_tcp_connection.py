"""The NVMe/TCP connection's receive path over a real socket pair: PDUs cut anywhere by the
stream arrive whole and in order, through a staging buffer that grows for a large PDU (with
earlier PDUs of the same read still in it) and never for one whose header is refused."""

from __future__ import annotations

import random
import socket

from blockfabric.fabric.tcp import STAGING_START, PduConnection, local_pd, resolve
from blockfabric.protocol import tcp_pdu


class Recorder(PduConnection):
    def __init__(self, sock) -> None:
        super().__init__(sock, "test")
        self.got: list[tuple[int, bytes]] = []
        self.lost: str | None = None
        self.negotiated(False, True, 8192, 256 << 10, 0, 0)

    def on_pdu(self, ptype, flags, pdu, pdo, dlen) -> None:
        self.got.append((ptype, bytes(pdu[pdo:pdo + dlen]) if dlen else bytes(pdu[8:72])))

    def on_lost(self, reason: str) -> None:
        self.lost = reason
        self.close()


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return a, b


def h2c(payload: bytes, offset: int = 0) -> bytes:
    return bytes(tcp_pdu.data_header(tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 1, 0, offset,
                                     len(payload), False, True)) \
        + payload + tcp_pdu.pack_digest(tcp_pdu.digest(payload))


def drain(conn: Recorder, rounds: int = 1000) -> None:
    for _ in range(rounds):
        before = (len(conn.got), conn._filled)
        conn.on_readable()
        if conn.closed or (len(conn.got), conn._filled) == before:
            return


def test_pdus_cut_anywhere_arrive_whole_and_in_order():
    rng = random.Random(5)
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        stream, want = b"", []
        for i in range(40):
            if i % 3:
                sqe = bytes([i]) * 64
                stream += bytes(tcp_pdu.capsule_cmd_header(sqe, 0, False, True))
                want.append((tcp_pdu.CAPSULE_CMD, sqe))
            else:       # some small, some larger than the staging buffer's start
                data = rng.randbytes(rng.choice((16, 3000, 70000, 200000)))
                stream += h2c(data)
                want.append((tcp_pdu.H2C_DATA, data))
        pos = 0
        while pos < len(stream):
            n = rng.choice((1, 7, 23, 500, 4096, 65536))
            a.sendall(stream[pos:pos + n])
            pos += n
            drain(conn)
        assert conn.lost is None
        assert conn.got == want
        assert conn._filled == 0
    finally:
        a.close()
        conn.close()


def test_a_refused_header_never_grows_the_buffer():
    a, b = tcp_pair()
    conn = Recorder(b)
    try:
        # 1 GiB announced as in-capsule data: refused from its 8 header bytes
        a.sendall(tcp_pdu.COMMON.pack(tcp_pdu.CAPSULE_CMD, tcp_pdu.F_DDGST, 72, 72, 1 << 30)
                  + bytes(64))
        drain(conn)
        assert conn.closed and "protocol error" in conn.lost
        assert len(conn._staging) == STAGING_START
        term = a.recv(4096)
        assert term[0] == tcp_pdu.C2H_TERM
        assert tcp_pdu.unpack_term(term)[0] == tcp_pdu.Fes.INVALID_HEADER_FIELD
    finally:
        a.close()


def test_resolve_checks_the_region_bounds_and_key():
    pd = local_pd()
    buf = bytearray(8192)
    mr = pd.reg_mr(buf)
    try:
        assert bytes(resolve(pd, mr.addr + 4096, 16, mr.lkey)) == bytes(16)
        assert len(resolve(pd, mr.addr, 8192, mr.rkey)) == 8192
        for addr, length, key in ((mr.addr + 8000, 400, mr.lkey), (mr.addr - 1, 8, mr.lkey),
                                  (mr.addr, 8, mr.lkey ^ 1)):
            try:
                resolve(pd, addr, length, key)
            except ValueError:
                continue
            raise AssertionError(f"resolved {addr:#x}+{length} with key {key:#x}")
    finally:
        mr.close()
        pd.close()
