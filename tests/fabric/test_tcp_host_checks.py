"""The host's NVMe/TCP queue against a hand-made controller on a loopback socket: what a
real controller sends lands where the command said; what no controller may send (data for a
command that moves none, past its length, SUCCESS without LAST, an R2T for a read, a
termination request) fails the queue's commands instead of landing anywhere; a data digest
that does not match fails only its command."""

from __future__ import annotations

import concurrent.futures
import socket
import struct
import threading

import pytest

from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_host import TcpHostQueue, open_connection
from blockfabric.protocol import IOOpcode, KeyedSGL, ReadWrite, StatusCode
from blockfabric.protocol import tcp_pdu as tp

CQE = struct.Struct("<QHHHH")


class FakeController:
    """Accepts one connection, answers the ICReq (``icresp``), then runs ``script(conn,
    cid)`` for the first CapsuleCmd."""

    def __init__(self, script, icresp=None, ddgst=False) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.script, self.ddgst = script, ddgst
        self.icresp = icresp or tp.ICResp(ddgst=ddgst, maxh2cdata=65536).pack()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def recv_pdu(self, conn) -> bytes:
        buf = b""
        while len(buf) < 8 or len(buf) < struct.unpack_from("<I", buf, 4)[0]:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            buf += chunk
        return buf

    def run(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(10)
            assert self.recv_pdu(conn)[0] == tp.ICREQ
            conn.sendall(self.icresp)
            try:
                for _ in range(2):      # this test's commands, each answered by the script
                    pdu = self.recv_pdu(conn)
                    if not pdu:
                        return
                    self.script(conn, struct.unpack_from("<H", pdu, 8 + 2)[0])
                conn.recv(1)            # until the host closes
            except OSError:             # the host ended the connection first: its right
                pass


def resp(cid: int, status: int = 0) -> bytes:
    return bytes(tp.capsule_resp(CQE.pack(0, 1, 1, cid, status << 1), False))


def c2h(cid: int, data: bytes, flags: int = tp.F_DATA_LAST, offset: int = 0,
        ddgst: bool = False, bad: bool = False) -> bytes:
    out = bytes(tp.data_header(tp.C2H_DATA, flags, cid, 0, offset, len(data), False, ddgst))
    out += data
    if ddgst:
        out += struct.pack("<I", tp.digest(data) ^ (1 if bad else 0))
    return out


@pytest.fixture
def reactor():
    r = Reactor("test-host")
    r.start()
    yield r
    r.stop()
    r.join(5)
    r.close()


def read_through(fake: FakeController, reactor, reads: int = 1, ddgst: bool = False):
    """Connect, send ``reads`` 4 KiB reads into registered memory; (results, memory)."""
    pd = local_pd()
    mem = bytearray(8192)
    mr = pd.reg_mr(mem)
    sock, icresp = open_connection("127.0.0.1", fake.port, hdgst=False, ddgst=ddgst,
                                   timeout=5)
    queue = TcpHostQueue(sock, pd, icresp, qid=1, depth=4, inline_size=0, name="t")
    queue.attach(reactor)
    results = []
    try:
        for _ in range(reads):
            fut: concurrent.futures.Future = concurrent.futures.Future()
            sqe = ReadWrite(IOOpcode.READ, 1, 0, 0).to_sqe(
                sgl=KeyedSGL(mr.addr, 4096, mr.rkey))
            queue.submit(sqe, lambda cqe, err, f=fut: f.set_result((cqe, err)))
            results.append(fut.result(10))
        return results, bytes(mem[:4096]), queue
    finally:
        queue.close()
        mr.close()
        pd.close()


def test_read_data_lands_where_the_command_said(reactor):
    fake = FakeController(lambda c, cid: c.sendall(c2h(cid, b"\xab" * 4096) + resp(cid)))
    (result,), data, _ = read_through(fake, reactor)
    assert result[1] is None and result[0].status == StatusCode.SUCCESS
    assert data == b"\xab" * 4096


def test_success_flag_completes_without_a_response_capsule(reactor):
    fake = FakeController(lambda c, cid: c.sendall(
        c2h(cid, b"\x5a" * 4096, tp.F_DATA_LAST | tp.F_DATA_SUCCESS)))
    (result,), data, _ = read_through(fake, reactor)
    assert result[0].status == StatusCode.SUCCESS and data == b"\x5a" * 4096


def test_a_data_digest_mismatch_fails_only_its_command(reactor):
    answers = iter([lambda c, cid: c.sendall(c2h(cid, b"\x01" * 4096, ddgst=True, bad=True)
                                             + resp(cid)),
                    lambda c, cid: c.sendall(c2h(cid, b"\x02" * 4096, ddgst=True)
                                             + resp(cid))])
    fake = FakeController(lambda c, cid: next(answers)(c, cid), ddgst=True)
    (bad, good), data, queue = read_through(fake, reactor, reads=2, ddgst=True)
    assert bad[1] is None and bad[0].status == StatusCode.DATA_TRANSFER_ERROR
    assert good[1] is None and good[0].status == StatusCode.SUCCESS
    assert data == b"\x02" * 4096


@pytest.mark.parametrize("name, answer, reason", [
    ("data for another cid", lambda cid: c2h(cid ^ 1, bytes(4096)), "moves no data"),
    ("data past the command's length", lambda cid: c2h(cid, bytes(8192)), "expected offset"),
    ("data out of order", lambda cid: c2h(cid, bytes(1024), offset=1024), "expected offset"),
    ("SUCCESS without LAST", lambda cid: c2h(cid, bytes(4096), tp.F_DATA_SUCCESS),
     "SUCCESS without LAST"),
    ("SUCCESS on a short read", lambda cid: c2h(cid, bytes(1024), tp.F_DATA_LAST |
                                                tp.F_DATA_SUCCESS), "no short reads"),
    ("an R2T for a read", lambda cid: bytes(tp.data_header(tp.R2T, 0, cid, 0, 0, 4096, False,
                                                          False)), "a read"),
    ("a CapsuleCmd from the controller", lambda cid: bytes(tp.capsule_cmd_header(
        bytes(64), 0, False, False)), "is not one a host receives"),
    ("a termination request", lambda cid: tp.term_req(tp.C2H_TERM, 2, 0),
     "terminated the connection (FES 0x2"),
])
def test_what_no_controller_may_send_fails_the_queue(reactor, name, answer, reason):
    fake = FakeController(lambda c, cid: c.sendall(answer(cid)))
    (result,), data, queue = read_through(fake, reactor)
    assert result[0] is None and reason in result[1], (name, result)
    assert queue.dead_reason and data == bytes(4096), name   # nothing landed


def test_an_icresp_that_differs_from_the_request_is_refused():
    fake = FakeController(lambda c, cid: None,
                          icresp=tp.ICResp(hdgst=True, maxh2cdata=65536).pack())
    with pytest.raises(ConnectionError, match="bad ICResp"):
        open_connection("127.0.0.1", fake.port, hdgst=False, ddgst=False, timeout=5)
