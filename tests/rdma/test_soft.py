"""What only the soft provider has: its wire, its progress modes, and peers that speak its
wire by hand (a malicious or silent peer, a peer process killed outright)."""

from __future__ import annotations

import errno
import os
import random
import select
import socket
import threading
import time

import pytest

from blockfabric.errors import RdmaError
from blockfabric.rdma import (SGE, Access, CMEventType, QPState, RecvWR, SendFlags, SendWR,
                              WcFlags, WcStatus, WrOpcode)
from blockfabric.rdma.soft import SoftProvider, wire
from blockfabric.rdma.soft.wire import Frame

from .agent import AgentCore, LocalAgent, RemoteAgent
from .harness import LOCAL, recv_wr, wr

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ


# ---------------------------------------------------------------------- wire


def test_header_is_32_bytes_and_round_trips():
    raw = wire.pack(Frame.WRITE, psn=0x1_0000_0005, length=7, key=0xAABBCCDD, extra=9,
                    addr=0x7F00_0000_1234, flags=5, ack=0x1234)
    assert len(raw) == wire.HEADER_SIZE == 32
    assert raw[0] == 0xBF and raw[1] == 3
    assert wire.unpack(raw) == (Frame.WRITE, 5, 5, 7, 0xAABBCCDD, 9, 0x7F00_0000_1234)
    assert wire.decode(raw) == (Frame.WRITE, 5, 5, 7, 0xAABBCCDD, 9, 0x7F00_0000_1234, 0x1234)
    assert wire.unpack_ack(raw) == 0x1234 and wire.unpack_ack(wire.pack(Frame.SEND)) is None


@pytest.mark.parametrize("offset,value", [(0, b"X"), (1, b"\x04"), (1, b"\x02"), (1, b"\x01")])
def test_foreign_or_future_headers_are_refused(offset, value):
    raw = bytearray(wire.pack(Frame.ACK))
    raw[offset:offset + len(value)] = value
    with pytest.raises(wire.WireError):
        wire.unpack(raw)
    with pytest.raises(wire.WireError):
        wire.decode(raw)


def test_a_version_1_header_is_named_as_such():
    with pytest.raises(wire.VersionError, match="version 1") as info:
        wire.decode(wire.pack_v1(Frame.CONN_REQ))
    assert info.value.version == 1


def test_a_version_2_header_is_named_as_such():
    """Version 2 had no ACK_REQ: such a peer would end the connection at the first one, so
    it is refused by name instead."""
    raw = bytearray(wire.pack(Frame.CONN_REQ))
    raw[1] = 2
    with pytest.raises(wire.VersionError, match="version 2") as info:
        wire.decode(raw)
    assert info.value.version == 2


@pytest.mark.parametrize("header", [
    wire.pack(Frame.SEND, ack=5),                               # an ack without its flag
    wire.pack(Frame.ACK, 3, flags=int(wire.FrameFlags.ACK)),    # only requests carry one
    wire.pack(Frame.SEND, flags=int(wire.FrameFlags.ACK_REQ)),  # only an ACK frame asks
    wire.pack(Frame.NAK, 1, key=9, flags=int(wire.FrameFlags.ACK_REQ)),
    wire.pack(Frame.READ_RESP, flags=int(wire.FrameFlags.ACK)),
    wire.pack(Frame.SEND, extra=7, flags=int(wire.FrameFlags.ACK)),  # ACK gives extra no meaning
])
def test_piggybacked_ack_fields_are_checked(header):
    with pytest.raises(wire.WireError):
        wire.decode(header)


def test_psn_comparison_wraps():
    assert wire.psn_le(0xFFFFFFFF, 0) and wire.psn_le(5, 5) and not wire.psn_le(6, 5)


# ---------------------------------------------------------------------- provider basics


def test_progress_mode_from_argument_and_environment(monkeypatch):
    monkeypatch.setenv("BLOCKFABRIC_SOFT_PROGRESS", "poll")
    assert SoftProvider().progress == "poll"
    assert SoftProvider(progress="thread").progress == "thread"
    monkeypatch.delenv("BLOCKFABRIC_SOFT_PROGRESS")
    assert SoftProvider().progress == "poll"
    with pytest.raises(ValueError):
        SoftProvider(progress="spin")


def test_devices_and_owned_addresses():
    p = SoftProvider()
    assert [d.name for d in p.devices()] == ["soft0"]
    assert p.owns_address("127.0.0.1") and p.owns_address("::1")
    assert not p.owns_address("192.0.2.1")        # TEST-NET-1: not on this host


def test_reg_mr_rules():
    p = SoftProvider()
    pd = p.context.alloc_pd()
    with pytest.raises(RdmaError) as exc:
        pd.reg_mr(b"read only", Access.LOCAL_WRITE)
    assert exc.value.errno == errno.EACCES
    with pytest.raises(RdmaError) as exc:
        pd.reg_mr(bytearray(8), Access.REMOTE_WRITE)
    assert exc.value.errno == errno.EINVAL
    buf = bytearray(b"0123456789")
    mr = pd.reg_mr(memoryview(buf)[2:], RW)
    assert mr.length == 8 and bytes(mr.buf) == b"23456789"
    import ctypes
    assert ctypes.string_at(mr.addr, 8) == b"23456789"    # the real virtual address
    with pytest.raises(BufferError):
        buf.extend(b"x")                                 # pinned while registered
    mr.close()
    buf.extend(b"x")
    p.close()


@pytest.mark.parametrize("progress", ["thread", "poll"])
def test_cq_channel_fd(progress):
    """The fd becomes readable for a completion after req_notify, in both progress modes."""
    p = SoftProvider(progress=progress)
    a, b = LocalAgent(AgentCore(p)), LocalAgent(AgentCore(p))
    lst = b.call("listen", address="127.0.0.1")
    token = a.call("connect_start", address="127.0.0.1", port=lst["port"])["token"]
    b.call("accept", lid=lst["lid"])
    cid = a.call("connect_wait", token=token)["cid"]
    conn = a.core.conns[cid]
    assert (conn.scq.fileno() == p.context.fileno()) == (progress == "poll")
    mr = conn.pd.reg_mr(bytearray(64), RW)
    conn.scq.req_notify()
    conn.qp.post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(mr.addr, 8, mr.lkey)],
                             remote_addr=mr.addr, rkey=0x999))    # fails remotely
    readable, _, _ = select.select([conn.scq.fileno()], [], [], 5)
    assert readable
    deadline = time.monotonic() + 5
    wcs = []
    while not wcs and time.monotonic() < deadline:
        conn.scq.ack_events()
        wcs = conn.scq.poll()
    assert [w.status for w in wcs] == [WcStatus.REM_ACCESS_ERR]
    a.close(), b.close()
    p.close()


# ---------------------------------------------------------------------- stricter than the contract
# The contract accepts what real devices do; here soft's own, precise choices are pinned.


@pytest.mark.parametrize("req_len,rep_len", [(0, 0), (1, 7), (56, 196)])
def test_private_data_is_exact(soft_world, req_len, rep_len):
    rng = random.Random(req_len + rep_len)
    req, rep = rng.randbytes(req_len), rng.randbytes(rep_len)
    assert not isinstance(soft_world.connect(private_data=req, accept_data=rep), dict)
    assert bytes.fromhex(soft_world.last_request["private_data"]) == req
    assert soft_world.last_reply == rep
    result = soft_world.connect(private_data=req, reject=True, accept_data=rep[:148])
    assert result == {"rejected": rep[:148].hex()}


def test_too_long_send_is_invalid_request_and_length_error(soft_world):
    a, b = soft_world.connect()
    src, dst = a.reg(200, LOCAL, seed=4), b.reg(200, LOCAL)
    b.recv(recv_wr(1, dst.sge(0, 100)), recv_wr(2, dst.sge(100, 100)))
    a.send(wr(WrOpcode.SEND, 3, [src.sge(0, 200)]))
    assert [w["status"] for w in a.poll()] == [WcStatus.REM_INV_REQ_ERR]
    assert [w["status"] for w in b.poll("recv", n=2)] == [WcStatus.LOC_LEN_ERR,
                                                          WcStatus.WR_FLUSH_ERR]


def test_unknown_lkey_is_a_protection_error(soft_world):
    a, b = soft_world.connect()
    src, dst = a.reg(64, LOCAL, seed=5), b.reg(64, int(RW))
    b.recv({"wr_id": 1, "sges": [{"addr": dst.addr, "length": 64, "lkey": dst.lkey ^ 0x5A5A00}]})
    a.send(wr(WrOpcode.SEND, 2, [src.sge()]))
    assert [w["status"] for w in b.poll("recv")] == [WcStatus.LOC_PROT_ERR]
    a2, b2 = soft_world.connect()
    src2, dst2 = a2.reg(64, LOCAL, seed=6), b2.reg(64, int(RW))
    bad = {"addr": src2.addr, "length": 64, "lkey": src2.lkey ^ 0x100}
    a2.send(wr(WrOpcode.RDMA_WRITE, 1, [bad], dst2))
    assert [w["status"] for w in a2.poll()] == [WcStatus.LOC_PROT_ERR]


def test_send_with_invalidate_reports_the_rkey_and_keeps_the_mr(soft_world):
    a, b = soft_world.connect()
    src, dst = a.reg(64, LOCAL, seed=3), b.reg(256, int(RW))
    b.recv(recv_wr(1, dst.sge(0, 128)))
    a.send(wr(WrOpcode.SEND_WITH_INV, 10, [src.sge(0, 16)], invalidate_rkey=dst.rkey))
    assert [w["status"] for w in a.poll()] == [WcStatus.SUCCESS]
    (inv,) = b.poll("recv")
    assert (inv["status"], inv["wc_flags"], inv["invalidated_rkey"], inv["byte_len"]) == \
        (WcStatus.SUCCESS, WcFlags.WITH_INV, dst.rkey, 16)
    a.send(wr(WrOpcode.RDMA_WRITE, 11, [src.sge()], dst, off=128))   # the rkey still works
    assert [w["status"] for w in a.poll()] == [WcStatus.SUCCESS]
    assert b.read(dst, 128, 64) == a.read(src, 0, 64)


# ---------------------------------------------------------------------- hand-made peers


class RawPeer:
    """A peer that speaks the soft wire by hand, to do what no honest provider would."""

    def __init__(self, port: int, private_data: bytes = b"raw") -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.sock.sendall(wire.pack(Frame.CONN_REQ, length=len(private_data)) + private_data)

    def established(self) -> None:
        ftype = self.frame()[0]
        assert ftype == Frame.CONN_REP
        self.sock.sendall(wire.pack(Frame.CONN_RTU))

    def frame(self) -> tuple:
        hdr = self._exact(wire.HEADER_SIZE)
        fields = wire.unpack(hdr)
        body = (self._exact(fields[3]) if fields[0] in wire.PAYLOAD_FRAMES and fields[3]
                and not fields[1] & wire.FrameFlags.SHM else b"")   # (SHM: no payload)
        return (*fields, body)

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "the provider closed the connection"
            out += chunk
        return out


@pytest.fixture
def passive():
    """A soft provider listening on loopback, accepting one connection with a QP.  Its engine
    runs on its own thread: these tests watch what the NIC does with no owner polling."""
    p = SoftProvider(progress="thread")
    lst = p.listen("127.0.0.1", 0)
    made = {}

    def accept():
        cmid = lst.get_request(5)
        pd = cmid.context.alloc_pd()
        cq = cmid.context.create_cq()
        made.update(cmid=cmid, pd=pd, cq=cq, qp=cmid.create_qp(pd, cq, cq))
        cmid.accept(b"ok")
        return made

    yield lst.local_address[1], accept
    lst.close()
    if made:
        made["cmid"].close()
    p.close()


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_raw_peer_forged_rkey_is_nakked_and_memory_untouched(passive):
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    peer.established()
    buf = bytearray(random.Random(1).randbytes(4096))
    keep = bytes(buf)
    mr = side["pd"].reg_mr(buf, RW)
    side["qp"].post_recv(RecvWR(5, [SGE(mr.addr, 64, mr.lkey)]))
    # an honest write first: it lands and is ACKed, so the raw peer is a fair test
    peer.sock.sendall(wire.pack(Frame.WRITE, 0, 4, mr.rkey, 0, mr.addr) + b"GOOD")
    assert peer.frame()[:3] == (Frame.ACK, 0, 0)
    assert bytes(buf[:4]) == b"GOOD"
    keep = b"GOOD" + keep[4:]
    peer.sock.sendall(wire.pack(Frame.WRITE, 1, 64, mr.rkey ^ 0x4000, 0, mr.addr) + b"E" * 64)
    ftype, _fl, psn, _len, status = peer.frame()[:5]
    assert (ftype, psn, status) == (Frame.NAK, 1, WcStatus.REM_ACCESS_ERR)
    # the QP is in ERR now: a further write (past the end, valid key) is dropped unanswered
    peer.sock.sendall(wire.pack(Frame.WRITE, 2, 64, mr.rkey, 0, mr.addr + 4090) + b"E" * 64)
    assert _wait(lambda: side["qp"].state == QPState.ERR)
    # the flush completion follows the state (the engine thread may be between the two)
    wcs: list = []
    assert _wait(lambda: wcs.extend(side["cq"].poll()) or wcs), "no flush completion"
    assert [(w.wr_id, w.status) for w in wcs] == [(5, WcStatus.WR_FLUSH_ERR)]
    time.sleep(0.05)
    assert bytes(buf) == keep


def test_raw_peer_sending_garbage_is_disconnected(passive):
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    peer.established()
    peer.sock.sendall(b"\x00" * 64)
    assert side["cmid"].get_event(5).type == CMEventType.DISCONNECTED
    assert side["qp"].state == QPState.ERR


def test_a_request_before_the_peers_rtu_ends_the_connection(passive):
    """CONN_RTU is the passive side's first frame: a SEND before it is a violation, not a
    message (the receive it would have taken is flushed, never completed with data)."""
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    assert peer.frame()[0] == Frame.CONN_REP
    mr = side["pd"].reg_mr(bytearray(64), RW)
    side["qp"].post_recv(RecvWR(7, [SGE(mr.addr, 64, mr.lkey)]))
    peer.sock.sendall(wire.pack(Frame.SEND, 0, 4) + b"abcd")     # no CONN_RTU first
    assert side["cmid"].get_event(5).type == CMEventType.DISCONNECTED
    wcs: list = []
    assert _wait(lambda: wcs.extend(side["cq"].poll()) or wcs)
    assert [(w.wr_id, w.status) for w in wcs] == [(7, WcStatus.WR_FLUSH_ERR)]
    assert bytes(mr.buf[:4]) == bytes(4)


def test_a_chain_refused_for_its_inline_size_posts_nothing(passive):
    """EINVAL for a chain whose later WR is inline past max_inline_data: nothing of the
    chain is posted (no PSN taken, nothing queued), so the next post is PSN 0."""
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    peer.established()
    qp = side["qp"]
    mr = side["pd"].reg_mr(bytearray(b"x" * 64), RW)
    ok = SendWR(1, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)], SendFlags.SIGNALED)
    big = qp.cap.max_inline_data + 1
    bad = SendWR(2, WrOpcode.SEND, [SGE(mr.addr, big, mr.lkey)],
                 SendFlags.SIGNALED | SendFlags.INLINE)
    with pytest.raises(RdmaError) as exc:
        qp.post_send([ok, bad])
    assert exc.value.errno == errno.EINVAL
    assert not qp._sq
    qp.post_send(SendWR(3, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)], SendFlags.SIGNALED))
    assert peer.frame()[0:3:2] == (Frame.SEND, 0)


def test_a_write_with_immediate_gives_a_raw_cq_its_tuple(passive):
    """An owner of raw completions (set_raw) gets (wr_id, status, byte_len) for the receive
    a WRITE_WITH_IMM consumes, as for a SEND: never a WC object it cannot unpack."""
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    peer.established()
    cq = side["cq"]
    cq.set_raw()
    mr = side["pd"].reg_mr(bytearray(64), RW)
    side["qp"].post_recv(RecvWR(7, [SGE(mr.addr, 64, mr.lkey)]))
    peer.sock.sendall(wire.pack(Frame.WRITE, 0, 4, mr.rkey, 0x55, mr.addr,
                                flags=int(wire.FrameFlags.WITH_IMM)) + b"abcd")
    got: list = []
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got == [(7, 0, 4)]
    assert bytes(mr.buf[:4]) == b"abcd"


def _quiet(peer, seconds: float = 0.1) -> bool:
    """Nothing came from the provider for ``seconds``."""
    peer.sock.settimeout(seconds)
    try:
        return not peer.sock.recv(1, socket.MSG_PEEK)  # (b"": it closed; not quiet either)
    except TimeoutError:
        return True
    finally:
        peer.sock.settimeout(5)


@pytest.mark.parametrize("fence", [False, True])
def test_a_fenced_wr_waits_for_the_reads_before_it(passive, fence):
    """SendFlags.FENCE (verbs' IBV_SEND_FENCE): a SEND posted behind an RDMA READ that
    has not got its data waits for it, and the WRs posted after it wait with it, then
    all go out in order.  Without the flag the SEND goes at once (the responder executes
    requests in order anyway); with nothing to wait for, the fence holds nothing."""
    port, accept = passive
    peer = RawPeer(port)
    side = accept()
    peer.established()
    qp, cq = side["qp"], side["cq"]
    mr = side["pd"].reg_mr(bytearray(b"S" * 64 + bytes(16)), RW)
    flags = SendFlags.SIGNALED | (SendFlags.FENCE if fence else SendFlags(0))

    def send(wr_id: int, how: SendFlags = SendFlags.SIGNALED) -> None:
        qp.post_send(SendWR(wr_id, WrOpcode.SEND, [SGE(mr.addr, 8, mr.lkey)], how))

    send(1, flags)                      # nothing outstanding: the fence holds nothing
    assert peer.frame()[0:3:2] == (Frame.SEND, 0)
    qp.post_send(SendWR(2, WrOpcode.RDMA_READ, [SGE(mr.addr + 64, 16, mr.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x5000, rkey=0x77))
    assert peer.frame()[0:3:2] == (Frame.READ_REQ, 1)
    send(3, flags)
    send(4)                             # behind it: in order
    if fence:
        assert _quiet(peer, 0.2), "a fenced SEND went before the READ ahead of it had its data"
        peer.sock.sendall(wire.pack(Frame.READ_RESP, 1, 16) + b"R" * 16)
    assert peer.frame()[0:3:2] == (Frame.SEND, 2)
    assert peer.frame()[0:3:2] == (Frame.SEND, 3)
    if not fence:
        peer.sock.sendall(wire.pack(Frame.READ_RESP, 1, 16) + b"R" * 16)
    peer.sock.sendall(wire.pack(Frame.ACK, 3))
    wcs: list = []
    assert _wait(lambda: wcs.extend(cq.poll()) or len(wcs) >= 4)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WcStatus.SUCCESS) for i in (1, 2, 3, 4)]
    assert bytes(mr.buf[64:80]) == b"R" * 16


@pytest.fixture
def hand_peer(request):
    """A QP connected (retry_count 1, ack_timeout 0.1 s, or the test's indirect parameter)
    to a peer that answers only what the test sends by hand on ``conn``: (qp, pd, cq,
    conn)."""
    ack_timeout = getattr(request, "param", 0.1)
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    p = SoftProvider(progress="thread")     # nobody polls: the engine's own timer must fire
    cmid = p.create_id()
    cmid.resolve("127.0.0.1", port)
    pd, cq = cmid.context.alloc_pd(), cmid.context.create_cq()
    qp = cmid.create_qp(pd, cq, cq)
    took: list = []

    def answer():
        conn, _ = server.accept()
        conn.recv(wire.HEADER_SIZE)
        conn.sendall(wire.pack(Frame.CONN_REP))
        took.append(conn)           # kept open; it answers what the test sends

    t = threading.Thread(target=answer)
    t.start()
    cmid.connect(b"", retry_count=1, ack_timeout=ack_timeout)
    t.join()
    yield qp, pd, cq, took[0]
    cmid.close()
    took[0].close()
    server.close()
    p.close()


def test_a_slow_but_steady_responder_is_not_timed_out(hand_peer):
    """The transport timer counts from the last request the peer answered, not from the
    oldest one posted: six SENDs posted at once, acknowledged one at a time every 0.1 s,
    take 0.6 s in all against a 0.2 s timeout, and every one succeeds."""
    qp, pd, cq, conn = hand_peer
    mr = pd.reg_mr(bytearray(16), RW)
    for i in range(6):
        qp.post_send(SendWR(i, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)]))
    wcs: list = []
    for psn in range(6):
        time.sleep(0.1)
        conn.sendall(wire.pack(Frame.ACK, psn))
    assert _wait(lambda: wcs.extend(cq.poll()) or len(wcs) >= 6, 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(i, WcStatus.SUCCESS) for i in range(6)]
    assert qp.state != QPState.ERR


@pytest.mark.parametrize("hand_peer", [0.3], indirect=True)
def test_a_read_whose_answer_is_arriving_is_not_timed_out(hand_peer):
    """An answer is progress even before it completes anything, as every response packet
    restarts an HCA's transport timer: a READ answered 0.45 s after its post, whose data
    takes another 0.4 s, succeeds against a 0.6 s timeout (it would fail mid-answer if
    only completed requests counted)."""
    qp, pd, cq, conn = hand_peer
    dst = pd.reg_mr(bytearray(4096), RW)
    qp.post_send(SendWR(1, WrOpcode.RDMA_READ, [SGE(dst.addr, 4096, dst.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x1000, rkey=0x77))
    conn.settimeout(5)
    got = b""
    while len(got) < wire.HEADER_SIZE or wire.unpack(got[-wire.HEADER_SIZE:])[0] != \
            Frame.READ_REQ:
        got += conn.recv(wire.HEADER_SIZE)          # (the CONN_RTU, then the READ_REQ)
    time.sleep(0.45)
    conn.sendall(wire.pack(Frame.READ_RESP, 0, 4096) + b"D" * 1024)
    time.sleep(0.4)
    conn.sendall(b"D" * 3072)
    wcs: list = []
    assert _wait(lambda: wcs.extend(cq.poll()) or wcs, 3)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WcStatus.SUCCESS)]
    assert bytes(dst.buf) == b"D" * 4096 and qp.state != QPState.ERR


def test_silent_responder_gives_retry_exceeded(hand_peer):
    """A peer whose QP never answers: RETRY_EXC_ERR after ack_timeout x (retry_count+1)."""
    qp, pd, cq, _conn = hand_peer
    mr = pd.reg_mr(bytearray(16), RW)
    t0 = time.monotonic()
    qp.post_send(SendWR(1, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)]))
    assert _wait(lambda: qp.state == QPState.ERR, 5)
    assert [w.status for w in cq.poll()] == [WcStatus.RETRY_EXC_ERR]
    assert 0.15 < time.monotonic() - t0 < 2


def test_killed_peer_process_is_a_disconnect():
    """kill -9 of the peer: the socket resets and the survivor sees DISCONNECTED + flushes."""
    p = SoftProvider()
    local = LocalAgent(AgentCore(p))
    remote = RemoteAgent("soft", "thread")
    try:
        lst = local.call("listen", address="127.0.0.1")
        token = remote.call("connect_start", address="127.0.0.1", port=lst["port"])["token"]
        cid = local.call("accept", lid=lst["lid"])["cid"]
        assert "cid" in remote.call("connect_wait", token=token)
        mr = local.call("reg", cid=cid, size=64, access=int(RW))
        local.call("post_recv", cid=cid, wrs=[{"wr_id": 3, "sges": [[mr["mid"], 0, 64]]}])
        os.kill(remote.proc.pid, 9)
        assert local.call("event", cid=cid, timeout=5) == CMEventType.DISCONNECTED
        assert local.call("state", cid=cid) == QPState.ERR
        assert [w["status"] for w in local.call("poll", cid=cid, cq="recv")] == \
            [WcStatus.WR_FLUSH_ERR]
    finally:
        remote.close()
        local.close()
        p.close()


# ---------------------------------------------------------------------- other wire versions


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_host_is_refused_with_a_rejection_of_its_version(caplog, version):
    """A version-1 or version-2 CONN_REQ gets a CONN_REJ the old peer can read (it reports a
    rejection, not a reset), logged once per listener.  (Version 2 had this header, without
    ACK_REQ.)"""
    p = SoftProvider(progress="poll")
    lst = p.listen("127.0.0.1", 0)
    request = wire.pack_v1(Frame.CONN_REQ, 4) if version == 1 else \
        wire.pack(Frame.CONN_REQ, length=4, version=2)
    try:
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", lst.local_address[1]), 5) as old:
                old.sendall(request + b"vNvN")
                assert lst.get_request(0.5) is None
                old.settimeout(5)
                answer = b""
                while len(answer) < wire.HEADER_SIZE:
                    chunk = old.recv(64)
                    assert chunk, f"closed without the version-{version} rejection"
                    answer += chunk
                if version == 1:
                    assert wire.V1_HEADER.unpack(answer[:32])[:4] == \
                        (b"BFRD", 1, Frame.CONN_REJ, 0)
                else:
                    assert wire.HEADER.unpack(answer[:32])[:3] == (wire.MAGIC, 2, Frame.CONN_REJ)
                assert old.recv(64) == b""      # and then closed
    finally:
        lst.close()
        p.close()
    assert sum(f"wire version {version}" in r.getMessage() for r in caplog.records) == 1


def test_connecting_to_a_version_1_target_names_the_version():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def old_target():
        conn, _ = server.accept()
        conn.recv(wire.HEADER_SIZE)
        conn.sendall(wire.pack_v1(Frame.CONN_REP))
        old_target.conn = conn

    t = threading.Thread(target=old_target)
    t.start()
    p = SoftProvider(progress="poll")
    cmid = p.create_id()
    cmid.resolve("127.0.0.1", port)
    pd, cq = cmid.context.alloc_pd(), cmid.context.create_cq()
    cmid.create_qp(pd, cq, cq)
    try:
        with pytest.raises(RdmaError, match="wire version 1"):
            cmid.connect(b"", timeout=5)
    finally:
        t.join()
        old_target.conn.close()
        server.close()
        cmid.close()
        p.close()


@pytest.fixture
def reactor_side():
    """A poll-mode provider whose accepted queue is serviced by a Reactor, as a target's:
    ``answer(n)`` decides whether the owner answers each SEND with a SEND of its own."""
    from blockfabric.fabric.reactor import Reactor

    p = SoftProvider(progress="poll")
    lst = p.listen("127.0.0.1", 0)
    reactor = Reactor("soft-test")
    state = {"answer": True, "seen": 0, "reactor": reactor}
    made = {}

    def accept():
        cmid = lst.get_request(5)
        pd = cmid.context.alloc_pd()
        cq = cmid.context.create_cq()
        qp = cmid.create_qp(pd, cq, cq, )
        buf = bytearray(64 * 64)
        mr = pd.reg_mr(buf, RW)
        qp.post_recv([RecvWR(i, [SGE(mr.addr + 64 * i, 64, mr.lkey)]) for i in range(32)])
        made.update(cmid=cmid, pd=pd, cq=cq, qp=qp, mr=mr)

        def service():
            for wc in cq.poll(64):
                if wc.opcode == 128:                    # RECV: answer it in the same pass
                    state["seen"] += 1
                    if state["answer"]:
                        qp.post_send(SendWR(wc.wr_id, WrOpcode.SEND,
                                            [SGE(mr.addr + 64 * wc.wr_id, 16, mr.lkey)]))
                        if state.get("answered"):
                            state["answered"](qp)       # (still in the pass)
        cmid.accept(b"ok")
        reactor.call_sync(lambda: reactor.add_cq(cq, service))
        return made

    reactor.start()
    yield lst.local_address[1], accept, state
    reactor.stop()
    reactor.join(5)
    lst.close()
    if made:
        made["cmid"].close()
    reactor.close()
    p.close()


def _answered_peer(port: int, accept, sends: int) -> RawPeer:
    """A RawPeer connected to ``reactor_side``, which has sent ``sends`` SENDs of 16 bytes
    (PSN 0 on) in one segment."""
    peer = RawPeer(port)
    accept()
    peer.established()
    peer.sock.sendall(b"".join(wire.pack(Frame.SEND, i, 16) + bytes(16) for i in range(sends)))
    return peer


def _frames(peer: RawPeer, want: int, timeout: float = 5.0) -> list:
    """Every frame the provider sent, until ``want`` of them (headers decoded with ack)."""
    peer.sock.settimeout(timeout)
    out = []
    while len(out) < want:
        hdr = peer._exact(wire.HEADER_SIZE)
        fields = wire.decode(hdr)
        if fields[0] in wire.PAYLOAD_FRAMES and fields[3]:
            peer._exact(fields[3])
        out.append(fields)
    return out


@pytest.mark.parametrize("depth", [1, 8])
def test_acks_ride_on_the_answers(reactor_side, depth):
    """QD-N: N SENDs in, N SENDs out, and no ACK frame: the first answer of each pass carries
    the cumulative ACK in its header."""
    port, accept, state = reactor_side
    peer = RawPeer(port)
    accept()
    peer.established()
    psn = 0
    for _round in range(3):
        peer.sock.sendall(b"".join(wire.pack(Frame.SEND, psn + i, 16) + bytes(16)
                                   for i in range(depth)))
        frames = _frames(peer, depth)
        assert [f[0] for f in frames] == [Frame.SEND] * depth, frames
        acks = [f[7] for f in frames if f[1] & wire.FrameFlags.ACK]
        assert acks and max(acks) == psn + depth - 1
        # the peer's own ACK for the answers (explicit: it has nothing else to send)
        peer.sock.sendall(wire.pack(Frame.ACK, frames[-1][2]))
        psn += depth
    peer.sock.settimeout(0.2)
    with pytest.raises(socket.timeout):
        peer.sock.recv(64)                  # nothing more: no stray ACK frames


@pytest.mark.parametrize("push", [True, False])
def test_push_sends_what_the_pass_queued_so_far(reactor_side, push):
    """An owner answering 8 SENDs in one pass pushes after the first 4: the peer has those
    4 answers while the pass still runs (it waits in the middle for them, up to 1 s); the
    other 4 leave at the end of the pass.  Without the push, nothing leaves before."""

    port, accept, state = reactor_side
    early = threading.Event()
    seen_early: list[bool] = []
    answers = []

    def answered(qp) -> None:
        answers.append(1)
        if len(answers) == 4:
            if push:
                qp.push()
            seen_early.append(early.wait(1.0))

    state["answered"] = answered
    peer = _answered_peer(port, accept, 8)
    first = _frames(peer, 4)
    early.set()
    rest = _frames(peer, 4)
    assert [f[0] for f in first + rest] == [Frame.SEND] * 8
    assert _wait(lambda: seen_early)
    # with the push, the first 4 came while the pass waited; without it, only once the
    # pass gave up waiting and sent all 8 at its end
    assert seen_early == [push]


def test_an_owner_that_does_not_answer_still_acknowledges(reactor_side):
    port, accept, state = reactor_side
    state["answer"] = False
    peer = _answered_peer(port, accept, 4)
    frames = _frames(peer, 1)
    while frames[-1][2] != 3:               # passes may have split the batch: ACKs coalesce
        frames += _frames(peer, 1)
    assert {f[0] for f in frames} == {Frame.ACK}
    assert _wait(lambda: state["seen"] == 4)


def _warm_up(peer, state) -> None:
    """The owner answers one SEND (psn 0), so it has posted lately (defer_ack's condition);
    the peer acknowledges the answer; from then on the owner does not answer."""
    peer.sock.sendall(wire.pack(Frame.SEND, 0, 16) + bytes(16))
    (ftype, flags, psn, *_rest, ack) = _frames(peer, 1)[0]
    assert (ftype, psn, ack) == (Frame.SEND, 0, 0) and flags & wire.FrameFlags.ACK
    peer.sock.sendall(wire.pack(Frame.ACK, 0))
    state["answer"] = False


def test_an_ack_with_nothing_to_ride_on_waits_for_traffic(reactor_side, monkeypatch):
    """Delayed ACK: an owner that posted lately and does not answer in the pass leaves the
    ACK owed (no frame of its own within ACK_DELAY); the owner's next request carries it, and
    takes the timer with it; a disconnect sends one still owed before the DREQ, so what was
    executed never completes flushed at the peer."""
    from blockfabric.rdma.soft import device
    monkeypatch.setattr(device, "ACK_DELAY", 30.0)
    port, accept, state = reactor_side
    peer = RawPeer(port)
    made = accept()
    peer.established()
    _warm_up(peer, state)
    peer.sock.sendall(wire.pack(Frame.SEND, 1, 16) + bytes(16))
    assert _wait(lambda: state["seen"] == 2)
    peer.sock.settimeout(0.3)
    with pytest.raises(socket.timeout):
        peer.sock.recv(64)                  # no ACK frame: it waits for traffic
    qp, mr, reactor = made["qp"], made["mr"], state["reactor"]
    reactor.call_soon_threadsafe(lambda: qp.post_send(
        SendWR(1, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)])))
    (ftype, flags, psn, *_rest, ack) = _frames(peer, 1)[0]
    assert (ftype, psn, ack) == (Frame.SEND, 1, 1) and flags & wire.FrameFlags.ACK
    live: list = []                         # carried: its timer will not wake the loop
    reactor.call_sync(lambda: live.extend(t for t in reactor._timers if not t[2].cancelled))
    # (nor the time a group that does the loop's waiting keeps for it instead of a timer)
    reactor.call_sync(lambda: live.extend(g for g in qp.ctx._groups.values() if g._ack_at))
    assert live == []
    peer.sock.sendall(wire.pack(Frame.ACK, 1))
    peer.sock.sendall(wire.pack(Frame.SEND, 2, 16) + bytes(16))
    assert _wait(lambda: state["seen"] == 3)
    reactor.call_sync(made["cmid"].disconnect)
    assert [f[:3] for f in _frames(peer, 2)] == [(Frame.ACK, 0, 2), (Frame.DREQ, 0, 0)]


def _warm_peer(reactor_side, monkeypatch, delay: float) -> RawPeer:
    """A RawPeer on ``reactor_side`` after :func:`_warm_up`, ACK_DELAY set to ``delay``."""
    from blockfabric.rdma.soft import device
    monkeypatch.setattr(device, "ACK_DELAY", delay)
    port, accept, state = reactor_side
    peer = RawPeer(port)
    accept()
    peer.established()
    _warm_up(peer, state)
    return peer


def test_a_deferred_ack_goes_out_after_ack_delay(reactor_side, monkeypatch):
    peer = _warm_peer(reactor_side, monkeypatch, 0.5)
    start = time.monotonic()
    peer.sock.sendall(wire.pack(Frame.SEND, 1, 16) + bytes(16))
    assert _frames(peer, 1)[0][:3] == (Frame.ACK, 0, 1)
    assert time.monotonic() - start >= 0.4


def test_an_ack_request_sends_the_deferred_ack_at_once(reactor_side, monkeypatch):
    """An ACK frame flagged ACK_REQ (the peer waits on this side's acknowledgement, as
    IB's AckReq asks) ends the wait for traffic: the ACK owed goes out in that pass, long
    before ACK_DELAY.  With nothing owed, it asks for nothing."""
    peer = _warm_peer(reactor_side, monkeypatch, 30.0)
    state = reactor_side[2]
    peer.sock.sendall(wire.pack(Frame.SEND, 1, 16) + bytes(16))
    assert _wait(lambda: state["seen"] == 2)
    peer.sock.settimeout(0.3)
    with pytest.raises(socket.timeout):
        peer.sock.recv(64)                  # deferred: it waits for traffic
    ask = wire.pack(Frame.ACK, 0, flags=int(wire.FrameFlags.ACK_REQ))
    peer.sock.sendall(ask)
    assert _frames(peer, 1, timeout=5)[0][:3] == (Frame.ACK, 0, 1)
    peer.sock.sendall(ask)                  # nothing owed now: no answer
    peer.sock.settimeout(0.3)
    with pytest.raises(socket.timeout):
        peer.sock.recv(64)


def test_an_owner_that_has_not_posted_lately_is_acknowledged_at_once(reactor_side,
                                                                      monkeypatch):
    """No deferral for an owner whose requests come further apart than ACK_DELAY: the timer
    would only add a wake-up to the ACK frame it sends anyway."""
    from blockfabric.rdma.soft import device
    monkeypatch.setattr(device, "ACK_DELAY", 30.0)
    port, accept, state = reactor_side
    state["answer"] = False
    peer = RawPeer(port)
    accept()
    peer.established()
    peer.sock.sendall(wire.pack(Frame.SEND, 0, 16) + bytes(16))
    assert _frames(peer, 1, timeout=5)[0][:3] == (Frame.ACK, 0, 0)


def _raw_owner(passive) -> tuple:
    """A RawPeer connected to the passive side, whose CQ hands out raw completions (as the
    reactor's queues do)."""
    port, accept = passive
    peer = RawPeer(port)
    made = accept()
    peer.established()
    made["cq"].set_raw()
    return peer, made


def test_a_reposted_receive_follows_its_sge_and_region_and_raw_completions(passive):
    """The fast path of the reactor's queues: a RecvWR posted with ``resolved=False`` keeps
    the views it resolved to, and a raw CQ hands out (wr_id, status, byte_len).  An SGE
    changed as RecvWR.resolved says (the note set back to False, or a new list) lands the
    next SEND in the new place; a closed region fails it (LOC_PROT_ERR), never writes
    through an old view."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    bufs = [bytearray(64), bytearray(64)]
    mrs = [pd.reg_mr(b, RW) for b in bufs]
    sge = SGE(mrs[0].addr, 64, mrs[0].lkey)
    rwr = RecvWR(7, [sge], False)
    got = []

    def one_send(psn: int, fill: int) -> tuple:
        qp.post_recv(rwr)
        peer.sock.sendall(wire.pack(Frame.SEND, psn, 16) + bytes([fill]) * 16)
        assert _wait(lambda: got.extend(cq.poll()) or got)
        return got.pop()

    assert one_send(0, 1) == (7, WcStatus.SUCCESS, 16) and bufs[0][:16] == b"\x01" * 16
    assert rwr.resolved                                     # noted: reused on the next post
    assert one_send(1, 2) == (7, WcStatus.SUCCESS, 16) and bufs[0][:16] == b"\x02" * 16
    rwr.resolved = False                                    # the same SGE, pointed elsewhere
    sge.addr, sge.lkey = mrs[1].addr, mrs[1].lkey
    assert one_send(2, 3) == (7, WcStatus.SUCCESS, 16)
    assert bufs[1][:16] == b"\x03" * 16 and bufs[0][:16] == b"\x02" * 16
    rwr.sg_list = [SGE(mrs[0].addr, 64, mrs[0].lkey)]       # a new list: back to the first
    assert one_send(3, 4) == (7, WcStatus.SUCCESS, 16)
    assert bufs[0][:16] == b"\x04" * 16 and bufs[1][:16] == b"\x03" * 16
    mrs[0].close()                                          # deregistered: no old view used
    assert one_send(4, 5) == (7, WcStatus.LOC_PROT_ERR, 0)
    assert bufs[0][:16] == b"\x04" * 16
    mrs[1].close()


def test_a_noted_send_reads_what_may_change_and_nothing_else(passive):
    """A SendWR posted with ``resolved=False`` is noted at its first post (its region's
    bytes from its address on) and its later posts read only what SendWR.resolved says an
    owner may change: the SGE's length, the opcode, the flags.  A length past its region,
    another opcode or a closed region each take the general path and get what it gives;
    the note set back to False points the WR elsewhere."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    bufs = [bytearray(b"a" * 64), bytearray(b"b" * 64)]
    mrs = [pd.reg_mr(b, RW) for b in bufs]
    sge = SGE(mrs[0].addr + 8, 16, mrs[0].lkey)
    wr = SendWR(5, WrOpcode.SEND, [sge], resolved=False)
    psn = 0
    got: list = []

    def post_and_see() -> tuple:
        nonlocal psn
        qp.post_send(wr)
        while (f := peer.frame())[0] == Frame.ACK:
            pass
        assert f[2] == psn, f
        peer.sock.sendall(wire.pack(Frame.ACK, psn))
        psn += 1
        assert _wait(lambda: got.extend(cq.poll()) or got)
        assert got.pop() == (5, WcStatus.SUCCESS, sge.length)
        return f

    f = post_and_see()
    assert f[0] == Frame.SEND and f[-1] == b"a" * 16 and wr.resolved     # noted
    bufs[0][8:12] = b"AAAA"
    sge.length = 40                                         # a length the owner may change
    assert post_and_see()[-1] == b"AAAA" + b"a" * 36
    wr.opcode, wr.imm_data = WrOpcode.SEND_WITH_IMM, 0x1234  # another opcode: read again
    f = post_and_see()
    assert f[1] & wire.FrameFlags.WITH_IMM and f[-1] == b"AAAA" + b"a" * 36
    wr.opcode = WrOpcode.SEND
    wr.resolved = False                                     # pointed elsewhere, as it says
    sge.addr, sge.lkey, sge.length = mrs[1].addr, mrs[1].lkey, 16
    assert post_and_see()[-1] == b"b" * 16
    sge.length = 65                                         # past its region: as any WR
    qp.post_send(wr)
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got.pop()[:2] == (5, WcStatus.LOC_PROT_ERR) and qp.state == QPState.ERR
    for mr in mrs:
        mr.close()


def test_a_noted_send_given_a_second_sge_sends_both(passive):
    """The number of SGEs is read at every post of a noted SEND (SendWR.resolved): a second
    SGE appended to the same list goes out with the first, as any provider sends it."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    buf = bytearray(b"a" * 16 + b"b" * 16)
    mr = pd.reg_mr(buf, RW)
    wr = SendWR(5, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)], resolved=False)
    qp.post_send(wr)
    while (f := peer.frame())[0] != Frame.SEND:
        pass
    assert f[-1] == b"a" * 16 and wr.resolved
    peer.sock.sendall(wire.pack(Frame.ACK, 0))
    got: list = []
    assert _wait(lambda: got.extend(cq.poll()) or got)
    wr.sg_list.append(SGE(mr.addr + 16, 16, mr.lkey))      # a second SGE, the same list
    qp.post_send(wr)
    while (f := peer.frame())[0] != Frame.SEND:
        pass
    assert (f[3], f[-1]) == (32, b"a" * 16 + b"b" * 16)
    mr.close()


def test_a_noted_receive_given_a_second_sge_is_checked_as_any(passive):
    """As a noted SEND's, a noted receive's SGE count is read at every post: a second SGE
    appended to the same list is refused as any receive of two SGEs is on this QP
    (max_recv_sge 1), not posted from the note of one."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    bufs = [bytearray(16), bytearray(16)]
    mrs = [pd.reg_mr(b, RW) for b in bufs]
    rwr = RecvWR(7, [SGE(mrs[0].addr, 16, mrs[0].lkey)], False)
    got: list = []
    qp.post_recv(rwr)
    peer.sock.sendall(wire.pack(Frame.SEND, 0, 16) + b"A" * 16)
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got.pop() == (7, WcStatus.SUCCESS, 16) and rwr.resolved
    rwr.sg_list.append(SGE(mrs[1].addr, 16, mrs[1].lkey))     # a second SGE, same list
    with pytest.raises(RdmaError) as exc:
        qp.post_recv(rwr)
    assert exc.value.errno == errno.EINVAL
    for mr in mrs:
        mr.close()


def test_a_noted_send_of_a_closed_region_fails_as_any(passive):
    """A noted SEND whose region was deregistered is never sent from the old view: it
    fails LOC_PROT_ERR, as a WR naming an unknown lkey does."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    buf = bytearray(b"z" * 64)
    mr = pd.reg_mr(buf, RW)
    wr = SendWR(9, WrOpcode.SEND, [SGE(mr.addr, 16, mr.lkey)], resolved=False)
    qp.post_send(wr)
    while (f := peer.frame())[0] == Frame.ACK:
        pass
    assert f[0] == Frame.SEND and f[-1] == b"z" * 16 and wr.resolved
    peer.sock.sendall(wire.pack(Frame.ACK, 0))
    got: list = []
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got.pop() == (9, WcStatus.SUCCESS, 16)
    mr.close()
    qp.post_send(wr)
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got.pop()[:2] == (9, WcStatus.LOC_PROT_ERR)


@pytest.mark.parametrize("case", ["ahead", "behind", "acks-unsent", "ack-without-flag",
                                  "too-long", "no-receive"])
def test_raw_receives_check_each_send_as_any(passive, case):
    """A SEND for an owner of raw completions is placed and completed straight from staging
    (the per-I/O path): the same checks hold there as on the general path.  An out-of-order
    PSN or an acknowledgement of what was never sent ends the connection; a SEND longer than
    its receive is NAKed REM_INV_REQ_ERR with the receive failed LOC_LEN_ERR; one with no
    receive posted gets an RNR NAK; the honest SEND before each lands whole."""
    peer, made = _raw_owner(passive)
    qp, cq, pd = made["qp"], made["cq"], made["pd"]
    buf = bytearray(64)
    mr = pd.reg_mr(buf, RW)
    rwr = RecvWR(7, [SGE(mr.addr, 32, mr.lkey)], False)
    qp.post_recv(rwr)
    qp.post_recv(rwr)
    peer.sock.sendall(wire.pack(Frame.SEND, 0, 16) + b"A" * 16)
    got: list = []
    assert _wait(lambda: got.extend(cq.poll()) or got)
    assert got == [(7, WcStatus.SUCCESS, 16)] and buf[:16] == b"A" * 16
    if case == "no-receive":
        peer.sock.sendall(wire.pack(Frame.SEND, 1, 16) + b"B" * 16)
        assert _wait(lambda: got.extend(cq.poll()) or len(got) > 1)
        peer.sock.sendall(wire.pack(Frame.SEND, 2, 16) + b"C" * 16)
        while (frame := peer.frame())[0] == Frame.ACK:
            pass
        assert frame[:3] == (Frame.RNR_NAK, 0, 2)
        assert qp.state != QPState.ERR and buf[:16] == b"B" * 16
        return
    frames = {
        "ahead": wire.pack(Frame.SEND, 2, 16) + b"X" * 16,
        "behind": wire.pack(Frame.SEND, 0, 16) + b"X" * 16,
        "acks-unsent": wire.pack(Frame.SEND, 1, 16, flags=wire.FrameFlags.ACK, ack=5)
        + b"X" * 16,
        "ack-without-flag": wire.pack(Frame.SEND, 1, 16, ack=5) + b"X" * 16,
        "too-long": wire.pack(Frame.SEND, 1, 48) + b"X" * 48,
    }
    peer.sock.sendall(frames[case])
    if case == "too-long":
        while (frame := peer.frame())[0] == Frame.ACK:
            pass
        assert frame[:5] == (Frame.NAK, 0, 1, 0, WcStatus.REM_INV_REQ_ERR)
        assert _wait(lambda: got.extend(cq.poll()) or len(got) > 1)
        assert got[1] == (7, WcStatus.LOC_LEN_ERR, 0)
    else:
        assert made["cmid"].get_event(5).type == CMEventType.DISCONNECTED
    assert qp.state == QPState.ERR
    assert buf[:16] == b"A" * 16 and b"X" not in buf


@pytest.mark.parametrize("fields", [
    {"flags": int(wire.FrameFlags.ACK)}, {"length": 4}, {"key": 1}, {"extra": 1},
    {"addr": 8}, {"ack": 5}, {"flags": int(wire.FrameFlags.ACK_REQ | wire.FrameFlags.SHM)},
], ids=["ack-flag", "length", "key", "extra", "addr", "ack", "flags"])
def test_a_bare_ack_outside_its_fields_ends_the_connection(passive, fields):
    """A bare ACK frame is checked inline on the receive path (the per-I/O case): every
    field it may not use still ends the connection, as wire.decode would."""
    peer, made = _raw_owner(passive)
    qp = made["qp"]
    peer.sock.sendall(wire.pack(Frame.ACK, wire.PSN_MASK, **fields))   # ("none yet")
    assert made["cmid"].get_event(5).type == CMEventType.DISCONNECTED
    assert qp.state == QPState.ERR


def test_a_bare_ack_of_nothing_sent_ends_the_connection_and_a_good_one_does_not(passive):
    """An ACK of what was acknowledged already passes (asking or not); one of a request
    never sent ends the connection."""
    peer, made = _raw_owner(passive)
    qp = made["qp"]
    peer.sock.sendall(wire.pack(Frame.ACK, wire.PSN_MASK))  # "none yet": allowed
    peer.sock.sendall(wire.pack(Frame.ACK, wire.PSN_MASK, flags=int(wire.FrameFlags.ACK_REQ)))
    assert made["cmid"].get_event(0.3) is None and qp.state != QPState.ERR
    peer.sock.sendall(wire.pack(Frame.ACK, 0))              # PSN 0 was never sent
    assert made["cmid"].get_event(5).type == CMEventType.DISCONNECTED
    assert qp.state == QPState.ERR
