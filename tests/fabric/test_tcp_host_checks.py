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
import time

import pytest

from blockfabric.errors import QueueDead
from blockfabric.fabric.reactor import Reactor
from blockfabric.fabric.tcp import local_pd
from blockfabric.fabric.tcp_host import TcpHostQueue, open_connection
from blockfabric.protocol import IOOpcode, KeyedSGL, ReadWrite, StatusCode
from blockfabric.protocol import tcp_pdu

CQE = struct.Struct("<QHHHH")


class FakeController:
    """Accepts one connection, answers the ICReq (``icresp``), then runs ``script(conn,
    cid)`` for the first CapsuleCmd."""

    def __init__(self, script, icresp=None, ddgst=False, rounds: int = 2) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.script, self.ddgst, self.rounds = script, ddgst, rounds
        self.icresp = icresp or tcp_pdu.ICResp(ddgst=ddgst, maxh2cdata=65536).pack()
        self.pdus: list[bytes] = []     # every PDU after the ICReq, as received
        self.rest = b""
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def recv_pdu(self, conn) -> bytes:
        buf = self.rest
        while len(buf) < 8 or len(buf) < struct.unpack_from("<I", buf, 4)[0]:
            chunk = conn.recv(65536)
            if not chunk:
                return b""
            buf += chunk
        plen = struct.unpack_from("<I", buf, 4)[0]
        self.rest = buf[plen:]          # the next PDU's first bytes, if they came along
        return buf[:plen]

    def run(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(10)
            assert self.recv_pdu(conn)[0] == tcp_pdu.ICREQ
            conn.sendall(self.icresp)
            try:
                for _ in range(self.rounds):    # the PDUs this test answers by the script
                    pdu = self.recv_pdu(conn)
                    if not pdu:
                        return
                    self.pdus.append(pdu)
                    self.script(conn, struct.unpack_from("<H", pdu, 8 + 2)[0])
                conn.recv(1)            # until the host closes
            except OSError:             # the host ended the connection first: its right
                pass


def resp(cid: int, status: int = 0) -> bytes:
    return bytes(tcp_pdu.capsule_resp(CQE.pack(0, 1, 1, cid, status << 1), False))


def _reshape(pdu: bytes, **fields: int) -> bytes:
    """``pdu`` with some of its common header's fields (flags, pdo, plen) replaced."""
    ptype, flags, hlen, pdo, plen = tcp_pdu.COMMON.unpack_from(pdu)
    values = {"flags": flags, "pdo": pdo, "plen": plen, **fields}
    return tcp_pdu.COMMON.pack(ptype, values["flags"], hlen, values["pdo"],
                               values["plen"]) + pdu[8:]


def c2h(cid: int, data: bytes, flags: int = tcp_pdu.F_DATA_LAST, offset: int = 0,
        ddgst: bool = False, bad: bool = False) -> bytes:
    out = bytes(tcp_pdu.data_header(tcp_pdu.C2H_DATA, flags, cid, 0, offset, len(data), False,
                                    ddgst))
    out += data
    if ddgst:
        out += struct.pack("<I", tcp_pdu.digest(data) ^ (1 if bad else 0))
    return out


@pytest.fixture
def reactor():
    r = Reactor("test-host")
    r.start()
    yield r
    r.stop()
    r.join(5)
    r.close()


def queue_on(port: int, reactor, mem: bytearray):
    """A queue to the controller at ``port`` (no digests), ``mem`` registered:
    (queue, pd, mr)."""
    pd = local_pd()
    mr = pd.reg_mr(mem)
    sock, icresp = open_connection("127.0.0.1", port, hdgst=False, ddgst=False, timeout=5)
    queue = TcpHostQueue(sock, pd, icresp, qid=1, depth=4, inline_size=0, name="t")
    queue.attach(reactor)
    return queue, pd, mr


def read_through(fake: FakeController, reactor, reads: int = 1, ddgst: bool = False,
                 hpda: int = 0):
    """Connect, send ``reads`` 4 KiB reads into registered memory; (results, memory)."""
    pd = local_pd()
    mem = bytearray(8192)
    mr = pd.reg_mr(mem)
    sock, icresp = open_connection("127.0.0.1", fake.port, hdgst=False, ddgst=ddgst,
                                   timeout=5, hpda=hpda)
    queue = TcpHostQueue(sock, pd, icresp, qid=1, depth=4, inline_size=0, name="t",
                         hpda=hpda)
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
        c2h(cid, b"\x5a" * 4096, tcp_pdu.F_DATA_LAST | tcp_pdu.F_DATA_SUCCESS)))
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
    ("SUCCESS without LAST", lambda cid: c2h(cid, bytes(4096), tcp_pdu.F_DATA_SUCCESS),
     "SUCCESS without LAST"),
    ("SUCCESS on a short read", lambda cid: c2h(cid, bytes(1024), tcp_pdu.F_DATA_LAST |
                                                tcp_pdu.F_DATA_SUCCESS), "no short reads"),
    ("an R2T for a read", lambda cid: bytes(tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, 0, 0, 4096,
                                                               False, False)), "a read"),
    ("a CapsuleCmd from the controller", lambda cid: bytes(tcp_pdu.capsule_cmd_header(
        bytes(64), 0, False, False)), "is not one a host receives"),
    ("a termination request", lambda cid: tcp_pdu.term_req(tcp_pdu.C2H_TERM, 2, 0),
     "terminated the connection (FES 0x2"),
    # next to the plain shapes the receive path takes without check_header's call
    # (PduConnection.negotiated): each must still be refused, by check_header
    ("a response with the LAST flag", lambda cid: _reshape(resp(cid), flags=tcp_pdu.F_DATA_LAST),
     "flags 0x4"),
    ("a response with pdo 24", lambda cid: _reshape(resp(cid), pdo=24), "carries no data"),
    ("a response with data", lambda cid: _reshape(resp(cid) + bytes(4), plen=28),
     "carries no data"),
    ("an R2T with data", lambda cid: _reshape(bytes(tcp_pdu.data_header(
        tcp_pdu.R2T, 0, cid, 0, 0, 4096, False, False)) + bytes(4), pdo=24, plen=28),
     "carries no data"),
    ("C2HData with pdo 24 and no data", lambda cid: _reshape(c2h(cid, b""), pdo=24),
     "a data PDU without data"),
    ("C2HData with pdo 0", lambda cid: _reshape(c2h(cid, bytes(4096)), pdo=0),
     "the data must start at 24"),
    ("C2HData with a data digest flag", lambda cid: _reshape(c2h(cid, bytes(4096)), flags=(
        tcp_pdu.F_DATA_LAST | tcp_pdu.F_DDGST)), "data digest flag set"),
])
def test_what_no_controller_may_send_fails_the_queue(reactor, name, answer, reason):
    fake = FakeController(lambda c, cid: c.sendall(answer(cid)))
    (result,), data, queue = read_through(fake, reactor)
    assert result[0] is None and isinstance(result[1], QueueDead), (name, result)
    assert reason in str(result[1]), (name, result)
    assert queue.dead_reason and data == bytes(4096), name   # nothing landed


def test_a_success_without_the_reads_data_is_a_transfer_error(reactor):
    """A CapsuleResp with status 0 for a read no C2HData (or not all of it) answered: the
    buffer holds what it held before, which is no answer."""
    answers = iter([lambda c, cid: c.sendall(resp(cid)),
                    lambda c, cid: c.sendall(c2h(cid, b"\x03" * 1024) + resp(cid))])
    fake = FakeController(lambda c, cid: next(answers)(c, cid))
    (none, short), _, queue = read_through(fake, reactor, reads=2)
    assert none[1] is None and none[0].status == StatusCode.DATA_TRANSFER_ERROR
    assert short[1] is None and short[0].status == StatusCode.DATA_TRANSFER_ERROR


def test_a_write_answered_before_its_data_went_does_not_send_reused_memory(reactor):
    """A controller asks (R2T) for all of a 12 MiB write, answers it at once and reads
    nothing for a while: the command completes, its owner writes other data into the
    buffer, and what the host still had queued for the write must be the write's data, not
    the buffer's new contents (the queue held views of it)."""
    size, got, go = 12 << 20, bytearray(), threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    def controller() -> None:
        conn, _ = server.accept()
        with conn:
            fake = FakeController.__new__(FakeController)
            fake.rest = b""
            fake.recv_pdu(conn)                                     # ICReq
            conn.sendall(tcp_pdu.ICResp(maxh2cdata=1 << 20).pack())
            cid = struct.unpack_from("<H", fake.recv_pdu(conn), 10)[0]
            conn.sendall(bytes(tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, 1, 0, size, False,
                                                   False)) + resp(cid))
            go.wait(10)
            while len(got) < size:
                pdu = fake.recv_pdu(conn)
                if not pdu:
                    break
                got.extend(pdu[24:])

    thread = threading.Thread(target=controller, daemon=True)
    thread.start()
    pd = local_pd()
    mem = bytearray(b"A" * size)
    mr = pd.reg_mr(mem)
    sock, icresp = open_connection("127.0.0.1", server.getsockname()[1], hdgst=False,
                                   ddgst=False, timeout=5)
    queue = TcpHostQueue(sock, pd, icresp, qid=1, depth=4, inline_size=0, name="t")
    queue.attach(reactor)
    try:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        sqe = ReadWrite(IOOpcode.WRITE, 1, 0, size // 4096 - 1).to_sqe(
            sgl=KeyedSGL(mr.addr, size, mr.rkey))
        queue.submit(sqe, lambda cqe, err: fut.set_result((cqe, err)))
        cqe, err = fut.result(10)
        assert err is None and cqe.status == StatusCode.SUCCESS
        assert queue.unsent > 0                  # the case under test: data still queued
        mem[:] = b"S" * size                     # the owner reuses its memory
        go.set()
        thread.join(20)
        assert len(got) == size and got.count(b"S") == 0
    finally:
        queue.close()
        mr.close()
        pd.close()
        server.close()


def test_nothing_lands_in_a_failed_reads_memory(reactor):
    """The queue is failed (keep-alive, recovery) while a read's C2HData is half in: its
    owner has the memory back at once, so the rest of that PDU must land nowhere."""
    half, sent_rest, rest = 32 << 10, threading.Event(), threading.Event()

    def script(conn, cid: int) -> None:
        whole = c2h(cid, b"\xab" * (2 * half))
        conn.sendall(whole[:len(whole) - half])         # the header and half the data
        rest.wait(10)
        try:
            conn.sendall(whole[len(whole) - half:] + resp(cid))
        except OSError:
            pass                                        # the host closed: its right
        sent_rest.set()

    fake = FakeController(script, rounds=1)
    mem = bytearray(2 * half)
    queue, pd, mr = queue_on(fake.port, reactor, mem)
    try:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        sqe = ReadWrite(IOOpcode.READ, 1, 0, 2 * half // 4096 - 1).to_sqe(
            sgl=KeyedSGL(mr.addr, 2 * half, mr.rkey))
        queue.submit(sqe, lambda cqe, err: fut.set_result((cqe, err)))
        deadline = time.monotonic() + 5
        while mem[half - 1] != 0xAB and time.monotonic() < deadline:   # half of it landed
            time.sleep(0.01)
        assert mem[:half] == b"\xab" * half
        reactor.call_sync(lambda: queue.fail("keep-alive timed out", expected=True))
        cqe, err = fut.result(5)
        assert isinstance(err, QueueDead)
        mem[:] = bytes(2 * half)                        # the owner reuses its memory
        rest.set()
        sent_rest.wait(10)
        time.sleep(0.3)                                 # the reactor's next reads
        assert mem == bytes(2 * half), "the failed read's data kept landing"
    finally:
        queue.close()
        mr.close()
        pd.close()


def test_an_icresp_that_differs_from_the_request_is_refused():
    fake = FakeController(lambda c, cid: None,
                          icresp=tcp_pdu.ICResp(hdgst=True, maxh2cdata=65536).pack())
    with pytest.raises(ConnectionError, match="bad ICResp"):
        open_connection("127.0.0.1", fake.port, hdgst=False, ddgst=False, timeout=5)


# -- where a write's data travels: the layout Linux nvmet-tcp depends on -----------------

NVMET_INLINE = 16384        # NVMET_TCP_DEF_INLINE_DATA_SIZE: nvmet's default port setting


def nvmet_like(fake_pdus: list, inline: int = NVMET_INLINE, hdgst: bool = False):
    """A script that answers a CapsuleCmd as Linux nvmet-tcp 6.1 does: a write of at most
    ``inline`` bytes is answered only once its data came in the capsule (nvmet waits for
    in-capsule data and drops the R2T otherwise), a larger one gets one R2T for all of it
    (ttag 0xFFFF, as for a Connect) and its answer once the H2CData came."""
    def answer(conn, cid: int) -> None:
        conn.sendall(tcp_pdu.capsule_resp(CQE.pack(0, 1, 1, cid, 0), hdgst))

    def script(conn, cid: int) -> None:
        pdu = fake_pdus[-1]
        if pdu[0] == tcp_pdu.H2C_DATA:
            answer(conn, struct.unpack_from("<H", pdu, 8)[0])
            return
        length = struct.unpack_from("<I", pdu, 8 + 32)[0]
        if pdu[8 + 39] == tcp_pdu.SGL_INCAPSULE or not length:
            answer(conn, cid)
        elif length > inline:
            conn.sendall(tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, 0xFFFF, 0, length, hdgst, False))
    return script


def send_through(reactor, sqe_for, data: bytes, *, qid: int, inline_size: int,
                 digests: bool = False, inline: int = NVMET_INLINE):
    """One command with ``data`` (registered memory, named by a keyed SGL) through a host
    queue against :func:`nvmet_like`; (result, the PDUs the controller received)."""
    fake = FakeController(None, icresp=tcp_pdu.ICResp(hdgst=digests, ddgst=digests,
                                                      maxh2cdata=65536).pack())
    fake.script = nvmet_like(fake.pdus, inline, digests)
    pd = local_pd()
    mem = bytearray(data)
    mr = pd.reg_mr(mem)
    sock, icresp = open_connection("127.0.0.1", fake.port, hdgst=digests, ddgst=digests,
                                   timeout=5)
    queue = TcpHostQueue(sock, pd, icresp, qid=qid, depth=4, inline_size=inline_size,
                         name="t")
    queue.attach(reactor)
    try:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        queue.submit(sqe_for(KeyedSGL(mr.addr, len(data), mr.rkey)),
                     lambda cqe, err: fut.set_result((cqe, err)))
        return fut.result(10), fake.pdus
    finally:
        queue.close()
        mr.close()
        pd.close()


def check_incapsule(pdu: bytes, data: bytes, digests: bool) -> None:
    """The CapsuleCmd as nvmet parses it: hlen 72, the data right after the header (and
    its digest), plen covering the data (and its digest), the digest flags set, and an
    SGL of type 0x01 (data block, offset) at offset 0 whose length is the data's."""
    hd = 4 if digests else 0
    ptype, flags, hlen, pdo, plen = tcp_pdu.header(pdu)
    assert (ptype, hlen, pdo) == (tcp_pdu.CAPSULE_CMD, 72, 72 + hd)
    assert plen == 72 + hd + len(data) + hd == len(pdu)
    assert flags == (tcp_pdu.F_HDGST | tcp_pdu.F_DDGST if digests else 0)
    addr, length, _rsvd, sgl_type = struct.unpack_from("<QI3sB", pdu, 8 + 24)
    assert (sgl_type, addr, length) == (tcp_pdu.SGL_INCAPSULE, 0, len(data))
    assert pdu[pdo:pdo + len(data)] == data
    if digests:
        assert tcp_pdu.unpack_digest(pdu, 72)[0] == tcp_pdu.digest(pdu[:72])
        assert tcp_pdu.unpack_digest(pdu, plen - 4)[0] == tcp_pdu.digest(data)


@pytest.mark.parametrize("digests", [False, True], ids=["plain", "digests"])
def test_admin_connect_carries_its_data_in_the_capsule(reactor, digests):
    """The admin queue's Connect: its 1024 bytes in the CapsuleCmd (the Linux host's
    NVME_TCP_ADMIN_CCSZ), never behind a transport SGL waiting for an R2T that nvmet
    does not send."""
    from blockfabric.protocol import ConnectCommand
    data = bytes(range(256)) * 4
    (cqe, err), pdus = send_through(
        reactor, lambda sgl: ConnectCommand(recfmt=0, qid=0, sqsize=31).to_sqe(sgl=sgl),
        data, qid=0, inline_size=0, digests=digests)
    assert err is None and cqe.status == StatusCode.SUCCESS
    assert len(pdus) == 1
    check_incapsule(pdus[0], data, digests)


def write_sqe(sgl):
    return ReadWrite(IOOpcode.WRITE, 1, 0, sgl.length // 512 - 1).to_sqe(sgl=sgl)


def test_an_io_write_that_fits_ioccsz_goes_in_the_capsule(reactor):
    data = b"\x77" * 4096
    (cqe, err), pdus = send_through(reactor, write_sqe, data, qid=1, inline_size=16320)
    assert err is None and cqe.status == StatusCode.SUCCESS
    check_incapsule(pdus[0], data, False)


def test_a_write_larger_than_the_capsule_waits_for_the_r2t(reactor):
    """Past IOCCSZ (here 4 KiB) the data goes behind a transport SGL (0x5A, no address)
    and moves as H2CData for the controller's R2T, echoing its ttag."""
    data = bytes(range(256)) * 96          # 24 KiB: past nvmet's inline size too
    (cqe, err), pdus = send_through(reactor, write_sqe, data, qid=1, inline_size=4032)
    assert err is None and cqe.status == StatusCode.SUCCESS
    cmd, h2c = pdus
    assert tcp_pdu.header(cmd) == (tcp_pdu.CAPSULE_CMD, 0, 72, 0, 72)
    assert struct.unpack_from("<QI3sB", cmd, 8 + 24)[::3] == (0, tcp_pdu.SGL_TRANSPORT)
    assert struct.unpack_from("<I", cmd, 8 + 32)[0] == len(data)
    assert h2c[0] == tcp_pdu.H2C_DATA
    assert tcp_pdu.unpack_data_fields(h2c)[1:] == (0xFFFF, 0, len(data))
    assert h2c[24:] == data


def padded_c2h(cid: int, data: bytes, pdo: int) -> bytes:
    """C2HData with its data at ``pdo`` (zero padding before it)."""
    hdr = bytearray(tcp_pdu.data_header(tcp_pdu.C2H_DATA, tcp_pdu.F_DATA_LAST, cid, 0, 0,
                                        len(data), False, False))
    hdr[3] = pdo
    struct.pack_into("<I", hdr, 4, pdo + len(data))
    return bytes(hdr).ljust(pdo, b"\0")[:pdo] + data


@pytest.mark.parametrize("pdo", [24, 28, 36, 48, 255])
def test_c2h_data_must_be_padded_as_the_host_asked(reactor, pdo):
    """HPDA 3 (16 bytes): C2HData whose data starts anywhere but at 32 ends the queue and
    lands nowhere; at 32 it lands."""
    fake = FakeController(lambda c, cid: c.sendall(padded_c2h(cid, b"\xcd" * 4096, pdo)
                                                   + resp(cid)))
    (result,), data, queue = read_through(fake, reactor, hpda=3)
    assert result[0] is None and isinstance(result[1], QueueDead), result
    assert "pdo" in str(result[1]), result
    assert queue.dead_reason and data == bytes(4096)
    fake = FakeController(lambda c, cid: c.sendall(padded_c2h(cid, b"\xcd" * 4096, 32)
                                                   + resp(cid)))
    (result,), data, _ = read_through(fake, reactor, hpda=3)
    assert result[1] is None and result[0].status == StatusCode.SUCCESS
    assert data == b"\xcd" * 4096


def r2t(cid: int, offset: int, length: int) -> bytes:
    return bytes(tcp_pdu.data_header(tcp_pdu.R2T, 0, cid, 7, offset, length, False, False))


def write_with_r2ts(reactor, r2ts, cpda: int = 0):
    """A 24 KiB write against a controller that sends ``r2ts(cid)`` at once (CPDA
    ``cpda``) and answers after two H2CData; (result, the PDUs it received)."""
    data = bytes(range(256)) * 96
    holder: dict = {}

    def script(conn, cid):
        if "cid" not in holder:
            holder["cid"] = cid
            conn.sendall(r2ts(cid))
        elif len(fake.pdus) == 3:
            conn.sendall(resp(holder["cid"]))
    fake = FakeController(script, icresp=tcp_pdu.ICResp(cpda=cpda, maxh2cdata=65536).pack(),
                          rounds=3)
    mem = bytearray(data)
    queue, pd, mr = queue_on(fake.port, reactor, mem)
    try:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        queue.submit(write_sqe(KeyedSGL(mr.addr, len(data), mr.rkey)),
                     lambda cqe, err: fut.set_result((cqe, err)))
        return fut.result(10), fake.pdus, data
    finally:
        queue.close()
        mr.close()
        pd.close()


def test_several_r2ts_answered_in_order_with_padding(reactor):
    """Two R2Ts outstanding for one write (as MAXR2T allows), CPDA 7 (32 bytes): each is
    answered by its own H2CData, with the controller's ttag, LAST, and data at PDO 32."""
    (cqe, err), pdus, data = write_with_r2ts(
        reactor, lambda cid: r2t(cid, 0, 12288) + r2t(cid, 12288, 12288), cpda=7)
    assert err is None and cqe.status == StatusCode.SUCCESS
    for pdu, offset in zip(pdus[1:], (0, 12288)):
        assert tcp_pdu.header(pdu) == (tcp_pdu.H2C_DATA, tcp_pdu.F_DATA_LAST, 24, 32, 32 + 12288)
        assert tcp_pdu.unpack_data_fields(pdu)[1:] == (7, offset, 12288)
        assert pdu[24:32] == bytes(8) and pdu[32:] == data[offset:offset + 12288]


@pytest.mark.parametrize("name, r2ts", [
    ("the second R2T first", lambda cid: r2t(cid, 12288, 12288) + r2t(cid, 0, 12288)),
    ("an R2T for bytes already asked for", lambda cid: r2t(cid, 0, 12288) + r2t(cid, 4096,
                                                                               8192)),
    ("an R2T past the write", lambda cid: r2t(cid, 0, 12288) + r2t(cid, 12288, 16384)),
])
def test_r2ts_out_of_order_end_the_queue(reactor, name, r2ts):
    (cqe, err), _pdus, _data = write_with_r2ts(reactor, r2ts)
    assert cqe is None and isinstance(err, QueueDead) and "R2T" in str(err), (name, err)
