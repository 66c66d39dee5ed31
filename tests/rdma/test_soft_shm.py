"""Same-host soft connections: RDMA READ and WRITE data through shared memory, and peers
that abuse it (descriptors that are not sealed memfds, regions longer than their memory,
requests flagged for shared memory on regions never shared, shares over TCP)."""

from __future__ import annotations

import array
import fcntl
import os
import random
import socket
import threading
import time

import pytest

from blockfabric.rdma import (SGE, Access, CMEventType, QPState, SendFlags, SendWR, WcStatus,
                              WrOpcode)
from blockfabric.rdma.soft import SoftProvider, wire
from blockfabric.rdma.soft import qp as qpmod
from blockfabric.rdma.soft.cm import shm_name
from blockfabric.rdma.soft.memory import SHARE_SEALS
from blockfabric.rdma.soft.wire import Frame, FrameFlags

from .test_soft import RawPeer, _quiet, _wait

RW = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
SHM = int(FrameFlags.SHM)
MIB = 1 << 20


@pytest.fixture
def pair():
    """pair(shm=True) -> (a, b): an active and a passive end over a loopback listener of
    a provider of their own (thread progress: the engine answers while the test waits);
    everything closed at teardown."""
    made: list = []

    def make(shm: bool = True) -> tuple[dict, dict]:
        provider = SoftProvider(progress="thread", shm=shm)
        lst = provider.listen("127.0.0.1", 0)
        ctx = provider.context
        a = {"pd": ctx.alloc_pd(), "cq": ctx.create_cq()}
        b = {"pd": ctx.alloc_pd(), "cq": ctx.create_cq()}
        made.append((provider, lst, a, b))
        a["cmid"] = provider.create_id()
        a["cmid"].resolve("127.0.0.1", lst.local_address[1])
        a["qp"] = a["cmid"].create_qp(a["pd"], a["cq"], a["cq"])

        def accept():
            cmid = lst.get_request(5)
            b["cmid"] = cmid
            b["qp"] = cmid.create_qp(b["pd"], b["cq"], b["cq"])
            cmid.accept(b"ok")

        t = threading.Thread(target=accept)
        t.start()
        a["cmid"].connect(b"hi")
        t.join(5)
        assert "qp" in b, "no accept"
        return a, b

    yield make
    for provider, lst, *ends in made:
        for end in ends:
            if "cmid" in end:
                end["cmid"].close()
        lst.close()
        provider.close()


def _completions(cq, n, timeout=5.0):
    got: list = []
    assert _wait(lambda: got.extend(cq.poll()) or len(got) >= n, timeout), got
    return got


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "tcp"])
def test_rdma_write_and_read_data_go_through_shared_memory_on_the_same_host(pair, shm):
    """1 MiB written and read back byte-exact either way; on a same-host connection the
    socket carries the frames only (a few hundred bytes), over TCP the data too."""
    a, b = pair(shm)
    assert a["qp"].shm is shm and b["qp"].shm is shm
    src = a["pd"].reg_mr(a["pd"].shared_slab(MIB), RW)
    back = a["pd"].reg_mr(a["pd"].shared_slab(MIB), RW)
    dst = b["pd"].reg_mr(b["pd"].shared_slab(MIB), RW)
    data = random.Random(7).randbytes(MIB)
    src.buf[:] = data
    # B's offer crosses to A (until it has, A's requests to it use the socket)
    assert _wait(lambda: dst.rkey in a["qp"]._peer) if shm else not a["qp"]._peer
    a["qp"].post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(src.addr, MIB, src.lkey)],
                             SendFlags.SIGNALED, remote_addr=dst.addr, rkey=dst.rkey))
    a["qp"].post_send(SendWR(2, WrOpcode.RDMA_READ, [SGE(back.addr, MIB, back.lkey)],
                             SendFlags.SIGNALED, remote_addr=dst.addr, rkey=dst.rkey))
    wcs = _completions(a["cq"], 2)
    assert [(w.wr_id, w.status) for w in wcs] == [(1, WcStatus.SUCCESS),
                                                 (2, WcStatus.SUCCESS)]
    assert bytes(dst.buf) == data and bytes(back.buf) == data
    sent = a["qp"]._tx_queued + b["qp"]._tx_queued
    if shm:
        assert sent < 4096, f"{sent} bytes crossed the socket"
    else:
        assert sent > 2 * MIB


def test_a_region_registered_after_the_connection_is_shared_and_forgotten_at_close(pair):
    a, b = pair()
    src = a["pd"].reg_mr(a["pd"].shared_slab(4096), RW)
    dst = b["pd"].reg_mr(b["pd"].shared_slab(4096), RW)
    assert _wait(lambda: dst.rkey in a["qp"]._peer and src.rkey in b["qp"]._peer)
    dst.close()
    assert _wait(lambda: dst.rkey not in a["qp"]._peer)
    # the closed region's key now fails as on any provider, through the socket path
    a["qp"].post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(src.addr, 64, src.lkey)],
                             SendFlags.SIGNALED, remote_addr=dst.addr, rkey=dst.rkey))
    assert [w.status for w in _completions(a["cq"], 1)] == [WcStatus.REM_ACCESS_ERR]


# ---------------------------------------------------------------------- hand-made peers


class UnixPeer(RawPeer):
    """A same-host peer that speaks the soft wire by hand (``tcp``: over TCP instead)."""

    def __init__(self, port: int, tcp: bool = False) -> None:
        if tcp:
            super().__init__(port)
            return
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(shm_name("127.0.0.1", port))
        self.sock.sendall(wire.pack(Frame.CONN_REQ, length=3) + b"raw")

    def share(self, fd: int | None, length: int, key: int, addr: int = 0x10000,
              access: int = int(RW)) -> None:
        frame = wire.pack(Frame.SHARE, 0, length, key, access, addr)
        anc = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [fd]))]
        self.sock.sendmsg([frame], anc)


@pytest.fixture
def passive():
    """A soft provider listening on loopback (TCP and its same-host socket), accepting one
    connection at a time with a QP; its engine on its own thread."""
    p = SoftProvider(progress="thread")
    lst = p.listen("127.0.0.1", 0)
    made: list = []

    def accept():
        cmid = lst.get_request(5)
        pd = cmid.context.alloc_pd()
        cq = cmid.context.create_cq()
        side = {"cmid": cmid, "pd": pd, "cq": cq, "qp": cmid.create_qp(pd, cq, cq)}
        made.append(side)
        cmid.accept(b"ok")
        return side

    yield lst.local_address[1], accept
    lst.close()
    for side in made:
        side["cmid"].close()
    p.close()


def _memfd(length: int, seals: int = 0) -> int:
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, length)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _disconnected(side) -> bool:
    event = side["cmid"].get_event(5)
    return event is not None and event.type == CMEventType.DISCONNECTED \
        and side["qp"].state == QPState.ERR


def _bystander_works(port: int, accept) -> None:
    """Another same-host peer connects and has a region written through shared memory."""
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    fd = _memfd(4096, SHARE_SEALS)
    peer.share(fd, 4096, 0x1234)
    src = side["pd"].reg_mr(bytearray(b"B" * 64), RW)
    assert _wait(lambda: 0x1234 in side["qp"]._peer)
    side["qp"].post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(src.addr, 64, src.lkey)],
                                SendFlags.SIGNALED, remote_addr=0x10000 + 100, rkey=0x1234))
    ftype, flags, psn, length, key = peer.frame()[:5]
    assert (ftype, flags & SHM, psn, length, key) == (Frame.WRITE, SHM, 0, 64, 0x1234)
    assert os.pread(fd, 64, 100) == b"B" * 64      # placed by the provider's copy
    os.close(fd)


@pytest.mark.parametrize("case", ["unsealed", "no-descriptor", "longer-than-memfd",
                                  "not-a-memfd", "read-only-descriptor", "huge-pages"])
def test_a_share_that_could_fault_or_lie_ends_only_that_connection(passive, case, tmp_path):
    port, accept = passive
    length = 4096
    fd = None
    if case == "huge-pages":
        # hugetlbfs: a hole its owner punches (which the shrink seal allows) frees the pages
        # and their reservation, and a copy into the mapping could then die of SIGBUS
        try:
            fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
                                 | os.MFD_HUGETLB)
        except OSError as exc:
            pytest.skip(f"no hugetlbfs memfd here: {exc}")
        length = os.fstat(fd).st_blksize        # one huge page: mappable as it is
        os.ftruncate(fd, length)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARE_SEALS)
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    if case == "unsealed":
        fd = _memfd(4096)               # could be truncated under the mapping: SIGBUS
    elif case == "longer-than-memfd":
        fd = _memfd(4096, SHARE_SEALS)
    elif case == "not-a-memfd":
        path = tmp_path / "file"
        path.write_bytes(b"\0" * 8192)
        fd = os.open(path, os.O_RDWR)
    elif case == "read-only-descriptor":
        fd = _memfd(4096, SHARE_SEALS)
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.close(fd)
        fd = ro
    peer.share(fd, 8192 if case == "longer-than-memfd" else length, 0x77)
    if fd is not None:
        os.close(fd)
    assert _disconnected(side)
    assert not side["qp"]._peer and not side["qp"]._fds_in
    _bystander_works(port, accept)


def test_shared_memory_requests_for_regions_never_shared_are_nakked(passive):
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    buf = bytearray(4096)
    plain = side["pd"].reg_mr(buf, RW)        # registered, but not a shared slab
    peer.sock.sendall(wire.pack(Frame.WRITE, 0, 64, plain.rkey, 0, plain.addr, SHM))
    ftype, _fl, psn, _len, status = peer.frame()[:5]
    assert (ftype, psn, status) == (Frame.NAK, 0, WcStatus.REM_INV_REQ_ERR)
    assert _wait(lambda: side["qp"].state == QPState.ERR)

    peer2 = UnixPeer(port)
    side2 = accept()
    peer2.established()
    peer2.sock.sendall(wire.pack(Frame.READ_REQ, 0, 64, 0xDEAD, 0, 0x1000, SHM))
    ftype, _fl, psn, _len, status = peer2.frame()[:5]
    assert (ftype, psn, status) == (Frame.NAK, 0, WcStatus.REM_ACCESS_ERR)
    assert _wait(lambda: side2["qp"].state == QPState.ERR)
    _bystander_works(port, accept)


def test_shares_and_shared_memory_requests_over_tcp_end_the_connection(passive):
    port, accept = passive
    for frame in (wire.pack(Frame.SHARE, 0, 4096, 0x99, int(RW), 0x1000),
                  wire.pack(Frame.WRITE, 0, 64, 0x99, 0, 0x1000, SHM)):
        peer = UnixPeer(port, tcp=True)
        side = accept()
        peer.established()
        assert not side["qp"].shm
        peer.sock.sendall(frame)
        assert _disconnected(side)
    _bystander_works(port, accept)


def test_a_peer_cannot_make_this_side_map_without_bound(passive, monkeypatch):
    """Regions past the connection's limits are declined (requests to them use the socket),
    descriptors sent ahead of any SHARE frame end the connection."""
    from blockfabric.rdma.soft import qp as qpmod
    monkeypatch.setattr(qpmod, "MAX_SHARES", 3)
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    fd = _memfd(4096, SHARE_SEALS)
    for key in range(1, 6):
        peer.share(fd, 4096, key)
    assert _wait(lambda: len(side["qp"]._peer) == 3)
    time.sleep(0.1)
    assert sorted(side["qp"]._peer) == [1, 2, 3]
    # a declined region: the provider's WRITE to it carries its data over the socket
    src = side["pd"].reg_mr(bytearray(b"D" * 16), RW)
    side["qp"].post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(src.addr, 16, src.lkey)],
                                SendFlags.SIGNALED, remote_addr=0x10000, rkey=5))
    frame = peer.frame()
    assert (frame[0], frame[1] & SHM, frame[-1]) == (Frame.WRITE, 0, b"D" * 16)
    peer.sock.sendall(wire.pack(Frame.FORGET, key=5))       # forgetting it is no fault
    peer.sock.sendall(wire.pack(Frame.FORGET, key=1))
    assert _wait(lambda: 1 not in side["qp"]._peer)
    assert side["qp"].state == QPState.RTS
    # descriptors with no SHARE frame to take them: bounded
    for _ in range(qpmod.MAX_FDS_WAITING + 1):
        try:
            peer.sock.sendmsg([wire.pack(Frame.FORGET, key=99)],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        except OSError:
            break                       # the provider cut the connection already
    os.close(fd)
    assert _disconnected(side)
    assert not side["qp"]._peer and not side["qp"]._fds_in
    _bystander_works(port, accept)


def test_a_shared_read_copies_at_its_post_unless_a_socket_write_is_ahead(passive):
    """A same-host RDMA READ copies from the peer's region at its post: no frame, no PSN,
    completed at once when nothing is outstanding.  Behind an RDMA WRITE whose data went
    through the socket (a region not shared) and is not yet acknowledged, it must not
    overtake that data: it goes out as a READ_REQ flagged SHM, the responder answers with
    a READ_RESP flagged SHM and no payload, and the requester copies then."""
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    qp, cq = side["qp"], side["cq"]
    fd = _memfd(4096, SHARE_SEALS)
    os.pwrite(fd, b"R" * 32, 200)
    peer.share(fd, 4096, 0x4321, addr=0x20000)
    assert _wait(lambda: 0x4321 in qp._peer)
    dst = side["pd"].reg_mr(bytearray(32), RW)
    src = side["pd"].reg_mr(bytearray(b"W" * 16), RW)

    def read(wr_id):
        qp.post_send(SendWR(wr_id, WrOpcode.RDMA_READ, [SGE(dst.addr, 32, dst.lkey)],
                            SendFlags.SIGNALED, remote_addr=0x20000 + 200, rkey=0x4321))

    read(1)                             # nothing outstanding: copied and completed now
    assert [(w.wr_id, w.status) for w in _completions(cq, 1)] == [(1, WcStatus.SUCCESS)]
    assert bytes(dst.buf) == b"R" * 32
    assert _quiet(peer), "a shared READ went on the wire"
    # a WRITE to a region this side does not map: its data goes through the socket
    qp.post_send(SendWR(2, WrOpcode.RDMA_WRITE, [SGE(src.addr, 16, src.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x90000, rkey=0x9999))
    ftype, flags, psn, length, key, *_rest, body = peer.frame()
    assert (ftype, flags & SHM, psn, key, body) == (Frame.WRITE, 0, 0, 0x9999, b"W" * 16)
    read(3)                             # that WRITE unacknowledged: the READ waits its turn
    ftype, flags, psn, length, key = peer.frame()[:5]
    assert (ftype, flags & SHM, psn, length, key) == (Frame.READ_REQ, SHM, 1, 32, 0x4321)
    os.pwrite(fd, b"S" * 32, 200)       # what the region holds when the answer comes counts
    peer.sock.sendall(wire.pack(Frame.READ_RESP, 1, 32, flags=SHM))
    got = _completions(cq, 2)
    assert [(w.wr_id, w.status) for w in got] == [(2, WcStatus.SUCCESS), (3, WcStatus.SUCCESS)]
    assert bytes(dst.buf) == b"S" * 32
    # everything acknowledged: copied at the post again, and the next request is PSN 2
    read(4)
    assert [w.wr_id for w in _completions(cq, 1)] == [4]
    os.pwrite(fd, b"T" * 32, 200)
    assert bytes(dst.buf) == b"S" * 32, "the copy was not made at the post"
    qp.post_send(SendWR(5, WrOpcode.SEND, [SGE(src.addr, 16, src.lkey)], SendFlags.SIGNALED))
    assert peer.frame()[0:3:2] == (Frame.SEND, 2)
    os.close(fd)


def _sharing_peer(passive, size: int = 8192) -> tuple[UnixPeer, dict, int]:
    """A same-host peer connected to ``passive`` that shared ``size`` bytes of a sealed
    memfd as rkey 0x5151 at 0x40000, once the accepted side maps it: (peer, side, the
    memfd)."""
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    fd = _memfd(size, SHARE_SEALS)
    peer.share(fd, size, 0x5151, addr=0x40000)
    assert _wait(lambda: 0x5151 in side["qp"]._peer)
    return peer, side, fd


def _post_pair(qp, how: str, write: SendWR, send: SendWR) -> None:
    """Post ``write`` then ``send`` as one chain: with post_send, or with post_write_send
    (the WRITE's SGE and remote address given as numbers: ``write`` goes in with a dummy
    SGE, which the numbers must override)."""
    if how == "post_send":
        qp.post_send([write, send])
        return
    sge = write.sg_list[0]
    dummy = SendWR(write.wr_id, write.opcode, [SGE(0, 0, 0)], write.send_flags)
    qp.post_write_send(dummy, send, sge.addr, sge.length, sge.lkey, write.remote_addr,
                       write.rkey)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
def test_a_read_answer_through_shared_memory_is_one_frame_and_completes_in_order(passive,
                                                                                 how):
    """The target's answer to a read (an RDMA WRITE of the data, then the SEND of the
    response, in one post): on a same-host connection only the SEND goes out; the WRITE
    completes once what was posted before it has (a SEND), in order, and the data is in
    the peer's region before the SEND leaves (behind a READ answered later, the WRITE goes
    through the socket instead).  A READ of a shared
    region completes in order likewise.  The same whether posted as a chain or with
    post_write_send (the target's per-I/O call)."""
    peer, side, fd = _sharing_peer(passive)
    qp, cq = side["qp"], side["cq"]
    local = side["pd"].reg_mr(bytearray(b"L" * 4096 + b"RESP" * 16), RW)
    # nothing outstanding: the WRITE completes at once, the SEND carries its PSN 0
    _post_pair(qp, how, SendWR(1, WrOpcode.RDMA_WRITE, [SGE(local.addr, 4096, local.lkey)],
                               SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151),
               SendWR(2, WrOpcode.SEND, [SGE(local.addr + 4096, 64, local.lkey)],
                      SendFlags.SIGNALED))
    ftype, flags, psn, length = peer.frame()[:4]
    assert (ftype, psn, length) == (Frame.SEND, 0, 64)
    assert os.pread(fd, 4096, 0) == b"L" * 4096
    assert [(w.wr_id, w.status) for w in _completions(cq, 1)] == [(1, WcStatus.SUCCESS)]
    peer.sock.sendall(wire.pack(Frame.ACK, 0))
    assert [w.wr_id for w in _completions(cq, 1)] == [2]
    # behind a READ still unanswered (of a region not shared: over the socket), the WRITE
    # is not copied at its post: the peer executes that READ later, and it must not see
    # the WRITE's data (two keys may name the same memory).  It goes through the socket,
    # in order, and completes with its ACK, then the SEND
    dst = side["pd"].reg_mr(bytearray(16), RW)
    qp.post_send(SendWR(3, WrOpcode.RDMA_READ, [SGE(dst.addr, 16, dst.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x70000, rkey=0x6161))
    _post_pair(qp, how, SendWR(4, WrOpcode.RDMA_WRITE, [SGE(local.addr, 100, local.lkey)],
                               SendFlags.SIGNALED, remote_addr=0x40000 + 200, rkey=0x5151),
               SendWR(5, WrOpcode.SEND, [SGE(local.addr + 4096, 64, local.lkey)],
                      SendFlags.SIGNALED))
    assert peer.frame()[:3] == (Frame.READ_REQ, 0, 1)
    ftype, flags, psn, *_rest, body = peer.frame()
    assert (ftype, flags & SHM, psn, body) == (Frame.WRITE, 0, 2, b"L" * 100)
    assert peer.frame()[0:3:2] == (Frame.SEND, 3)
    assert os.pread(fd, 100, 200) == b"L" * 100     # (the first answer's copy, still)
    time.sleep(0.05)
    assert not cq.poll(), "completed before the READ was answered"
    peer.sock.sendall(wire.pack(Frame.READ_RESP, 1, 16) + b"Q" * 16)
    assert [w.wr_id for w in _completions(cq, 1)] == [3]
    assert bytes(dst.buf) == b"Q" * 16
    peer.sock.sendall(wire.pack(Frame.ACK, 3))
    assert [w.wr_id for w in _completions(cq, 2)] == [4, 5]
    # a READ of the shared region behind that SEND, still unacknowledged: copied at the
    # post, completed with the SEND's ACK, in order; and since the peer may be holding
    # that ACK back for traffic, an ACK frame flagged ACK_REQ asks for it, once
    os.pwrite(fd, b"P" * 16, 4096)
    qp.post_send(SendWR(6, WrOpcode.SEND, [SGE(local.addr + 4096, 64, local.lkey)],
                        SendFlags.SIGNALED))
    qp.post_send(SendWR(7, WrOpcode.RDMA_READ, [SGE(dst.addr, 16, dst.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000 + 4096, rkey=0x5151))
    qp.post_send(SendWR(8, WrOpcode.RDMA_READ, [SGE(dst.addr, 16, dst.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000 + 4096, rkey=0x5151))
    assert peer.frame()[0:3:2] == (Frame.SEND, 4)
    ftype, flags = peer.frame()[:2]
    assert ftype == Frame.ACK and flags == FrameFlags.ACK_REQ
    assert _quiet(peer)                 # asked once for both READs, and no READ_REQ
    assert bytes(dst.buf) == b"P" * 16 and not cq.poll()
    peer.sock.sendall(wire.pack(Frame.ACK, 4))
    assert [w.wr_id for w in _completions(cq, 3)] == [6, 7, 8]
    os.close(fd)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
def test_an_unsignaled_shared_write_has_nothing_left_to_complete_or_flush(passive, how):
    """An unsignaled RDMA WRITE through a shared region (the target's read data) is in the
    peer's memory at its post: behind work still outstanding it gives no completion when
    that work completes, and when the connection then fails only the work that was really
    outstanding is flushed, not that WRITE (whose effect cannot be undone).  A bad WRITE
    (beyond the shared region) still fails the chain as post_send's checks say."""
    peer, side, fd = _sharing_peer(passive)
    qp, cq = side["qp"], side["cq"]
    local = side["pd"].reg_mr(bytearray(b"D" * 4096 + b"RESP" * 16), RW)
    dst = side["pd"].reg_mr(bytearray(16), RW)
    quiet = SendFlags(0)

    def answer(write_id: int, send_id: int, at: int) -> None:
        _post_pair(qp, how, SendWR(write_id, WrOpcode.RDMA_WRITE,
                                   [SGE(local.addr, 4096, local.lkey)], quiet,
                                   remote_addr=0x40000 + at, rkey=0x5151),
                   SendWR(send_id, WrOpcode.SEND, [SGE(local.addr + 4096, 64, local.lkey)],
                          SendFlags.SIGNALED))

    def send(wr_id: int) -> None:
        qp.post_send(SendWR(wr_id, WrOpcode.SEND, [SGE(dst.addr, 16, dst.lkey)],
                            SendFlags.SIGNALED))

    send(1)
    answer(2, 3, 0)
    assert peer.frame()[0:3:2] == (Frame.SEND, 0)
    assert peer.frame()[0:3:2] == (Frame.SEND, 1)       # the WRITE took no PSN
    assert os.pread(fd, 4096, 0) == b"D" * 4096        # placed at the post
    peer.sock.sendall(wire.pack(Frame.ACK, 0))
    assert [w.wr_id for w in _completions(cq, 1)] == [1]
    peer.sock.sendall(wire.pack(Frame.ACK, 1))
    assert [w.wr_id for w in _completions(cq, 1)] == [3]
    time.sleep(0.05)
    assert not cq.poll(), "the unsignaled WRITE completed"
    # behind another SEND: the connection fails, and only the two SENDs flush
    os.pwrite(fd, b"\0" * 4096, 4096)
    send(4)
    answer(5, 6, 4096)
    assert os.pread(fd, 4096, 4096) == b"D" * 4096
    peer.sock.close()
    got = _completions(cq, 2)
    assert [(w.wr_id, w.status) for w in got] == [(4, WcStatus.WR_FLUSH_ERR),
                                                   (6, WcStatus.WR_FLUSH_ERR)]
    time.sleep(0.05)
    assert not cq.poll()
    os.close(fd)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
def test_a_shared_write_beyond_the_region_fails_as_posted(passive, how):
    """post_write_send checks what post_send checks: a WRITE past the end of the peer's
    shared region is not copied there; it goes to the peer, which refuses it."""
    peer, side, fd = _sharing_peer(passive)
    qp = side["qp"]
    local = side["pd"].reg_mr(bytearray(b"E" * 4096 + b"RESP" * 16), RW)
    _post_pair(qp, how, SendWR(1, WrOpcode.RDMA_WRITE, [SGE(local.addr, 4096, local.lkey)],
                               SendFlags(0), remote_addr=0x40000 + 8192 - 100, rkey=0x5151),
               SendWR(2, WrOpcode.SEND, [SGE(local.addr + 4096, 64, local.lkey)],
                      SendFlags.SIGNALED))
    ftype, _flags, psn, length = peer.frame()[:4]
    assert (ftype, psn, length) == (Frame.WRITE, 0, 4096)     # over the socket, to be refused
    assert os.pread(fd, 100, 8192 - 100) == b"\0" * 100
    os.close(fd)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
def test_a_shared_write_then_a_send_of_no_bytes(passive, how):
    """A SEND with no SGE after a shared WRITE (legal: a message of 0 bytes) is no case
    for the per-I/O path: it goes the general way, and both arrive."""
    peer, side, fd = _sharing_peer(passive)
    local = side["pd"].reg_mr(bytearray(b"Z" * 4096), RW)
    _post_pair(side["qp"], how, SendWR(1, WrOpcode.RDMA_WRITE,
                                       [SGE(local.addr, 4096, local.lkey)], SendFlags(0),
                                       remote_addr=0x40000, rkey=0x5151),
               SendWR(2, WrOpcode.SEND, [], SendFlags.SIGNALED))
    got = [peer.frame()[:4] for _ in range(2)]
    assert [(f[0], f[3]) for f in got] == [(Frame.WRITE, 4096), (Frame.SEND, 0)]
    assert os.pread(fd, 4096, 0) == b"Z" * 4096
    os.close(fd)


def _post_with_the_peer_gone(qp, peer, post) -> None:
    """In one pass: a SEND (wr 1, signaled) queued, the peer's socket closed, then
    ``post()``, whose long shared copy first sends what the pass queued and finds the peer
    gone, the QP going to ERR in the middle of that post."""
    ctx, tid = qp.ctx, threading.get_ident()
    local = qp.pd.reg_mr(bytearray(64), RW)
    assert ctx.begin_pass(tid)
    try:
        with qp._lock:      # (the engine's thread must not see the close first)
            qp.post_send(SendWR(1, WrOpcode.SEND, [SGE(local.addr, 64, local.lkey)],
                                SendFlags.SIGNALED))
            peer.sock.close()
            time.sleep(0.05)
            post()
    finally:
        ctx.end_pass(tid)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
@pytest.mark.parametrize("signaled", [False, True])
def test_a_peer_gone_during_a_long_shared_write_flushes_what_was_posted(passive, how,
                                                                         signaled):
    """A shared WRITE of 32 KiB or more first sends what the pass queued; when that send
    finds the peer gone, the QP goes to ERR in the middle of the post.  The post then
    raises nothing (the shared region's mapping is gone with the connection) and its SEND
    is flushed, not left on a send queue nothing will ever complete; a signaled WRITE is
    flushed with the rest, in order, not completed with SUCCESS between two flushed WRs
    (an HCA never reports that)."""
    size = 64 << 10
    peer, side, fd = _sharing_peer(passive, size)
    qp, cq = side["qp"], side["cq"]
    local = side["pd"].reg_mr(bytearray(b"L" * size + b"RESP" * 16), RW)
    _post_with_the_peer_gone(qp, peer, lambda: _post_pair(
        qp, how, SendWR(2, WrOpcode.RDMA_WRITE, [SGE(local.addr, size, local.lkey)],
                        SendFlags.SIGNALED if signaled else SendFlags(0),
                        remote_addr=0x40000, rkey=0x5151),
        SendWR(3, WrOpcode.SEND, [SGE(local.addr + size, 64, local.lkey)],
               SendFlags.SIGNALED)))
    assert qp.state == QPState.ERR and not qp._sq
    # (posted to a QP in ERR, the WRITE is flushed signaled or not, as verbs flushes)
    got = [(w.wr_id, w.status) for w in _completions(cq, 3)]
    assert got == [(i, WcStatus.WR_FLUSH_ERR) for i in (1, 2, 3)]
    time.sleep(0.05)
    assert not cq.poll()
    os.close(fd)


def test_a_long_shared_read_with_the_peer_gone_mid_post_is_flushed(passive):
    """The same for an RDMA READ through a shared region of 32 KiB or more."""
    size = 64 << 10
    peer, side, fd = _sharing_peer(passive, size)
    qp, cq = side["qp"], side["cq"]
    local = side["pd"].reg_mr(bytearray(size), RW)
    _post_with_the_peer_gone(qp, peer, lambda: qp.post_send(SendWR(
        2, WrOpcode.RDMA_READ, [SGE(local.addr, size, local.lkey)], SendFlags.SIGNALED,
        remote_addr=0x40000, rkey=0x5151)))
    assert qp.state == QPState.ERR and not qp._sq
    got = [(w.wr_id, w.status) for w in _completions(cq, 2)]
    assert got == [(1, WcStatus.WR_FLUSH_ERR), (2, WcStatus.WR_FLUSH_ERR)]
    os.close(fd)


@pytest.mark.parametrize("how", ["post_send", "post_write_send"])
def test_a_shared_write_waits_behind_a_socket_write_still_in_flight(passive, how,
                                                                     monkeypatch):
    """Write after write: an RDMA WRITE whose data went through the socket (posted while
    held behind an RNR NAK) and is not acknowledged yet has still to be placed by the
    peer.  A WRITE posted after it, to the same bytes of a shared region, must not be
    copied at its post (the peer would then place the older data last): it goes through
    the socket too, in order.  Once all is acknowledged, a WRITE copies at its post
    again."""
    monkeypatch.setattr(qpmod, "RNR_FIRST", 0.3)
    monkeypatch.setattr(qpmod, "RNR_MAX", 0.3)
    peer, side, fd = _sharing_peer(passive)
    qp, cq = side["qp"], side["cq"]
    local = side["pd"].reg_mr(bytearray(b"A" * 64 + b"B" * 64 + b"R" * 64 + b"C" * 64), RW)
    qp.post_send(SendWR(1, WrOpcode.SEND, [SGE(local.addr + 128, 64, local.lkey)],
                        SendFlags.SIGNALED))
    assert peer.frame()[0:3:2] == (Frame.SEND, 0)
    peer.sock.sendall(wire.pack(Frame.RNR_NAK, 0))          # no receive: back to PSN 0
    assert _wait(lambda: qp._hold)
    qp.post_send(SendWR(2, WrOpcode.RDMA_WRITE, [SGE(local.addr, 64, local.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151))
    assert peer.frame()[0:3:2] == (Frame.SEND, 0)            # replayed
    ftype, flags, psn, *_rest, body = peer.frame()
    assert (ftype, flags & SHM, psn, body) == (Frame.WRITE, 0, 1, b"A" * 64)
    _post_pair(qp, how, SendWR(3, WrOpcode.RDMA_WRITE, [SGE(local.addr + 64, 64, local.lkey)],
                               SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151),
               SendWR(4, WrOpcode.SEND, [SGE(local.addr + 128, 64, local.lkey)],
                      SendFlags.SIGNALED))
    assert os.pread(fd, 64, 0) == bytes(64), "copied ahead of the WRITE still in flight"
    ftype, flags, psn, *_rest, body = peer.frame()
    assert (ftype, flags & SHM, psn, body) == (Frame.WRITE, 0, 2, b"B" * 64)
    assert peer.frame()[0:3:2] == (Frame.SEND, 3)
    peer.sock.sendall(wire.pack(Frame.ACK, 3))
    assert [w.wr_id for w in _completions(cq, 4)] == [1, 2, 3, 4]
    qp.post_send(SendWR(5, WrOpcode.RDMA_WRITE, [SGE(local.addr + 192, 64, local.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151))
    assert os.pread(fd, 64, 0) == b"C" * 64, "not copied at its post once all was answered"
    ftype, flags, psn = peer.frame()[:3]
    assert (ftype, flags & SHM, psn) == (Frame.WRITE, SHM, 4)
    os.close(fd)


def test_a_shared_write_waits_behind_a_read_answered_later(passive):
    """Write after read: a READ that went out as a READ_REQ (behind a socket WRITE) reads
    the region when its answer comes.  A WRITE to the same bytes posted after it must not
    be copied before then, or the READ would see it: it goes through the socket, as the
    responder would execute it, after the READ."""
    peer, side, fd = _sharing_peer(passive)
    qp, cq = side["qp"], side["cq"]
    os.pwrite(fd, b"O" * 32, 0)
    src = side["pd"].reg_mr(bytearray(b"W" * 16 + b"N" * 32), RW)
    dst = side["pd"].reg_mr(bytearray(32), RW)
    qp.post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(src.addr, 16, src.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x90000, rkey=0x9999))
    assert peer.frame()[0:3:2] == (Frame.WRITE, 0)           # not a shared region
    qp.post_send(SendWR(2, WrOpcode.RDMA_READ, [SGE(dst.addr, 32, dst.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151))
    ftype, flags, psn = peer.frame()[:3]
    assert (ftype, flags & SHM, psn) == (Frame.READ_REQ, SHM, 1)
    peer.sock.sendall(wire.pack(Frame.ACK, 0))              # the socket WRITE is placed
    assert [w.wr_id for w in _completions(cq, 1)] == [1]
    qp.post_send(SendWR(3, WrOpcode.RDMA_WRITE, [SGE(src.addr + 16, 32, src.lkey)],
                        SendFlags.SIGNALED, remote_addr=0x40000, rkey=0x5151))
    assert os.pread(fd, 32, 0) == b"O" * 32, "copied before the READ ahead of it read"
    ftype, flags, psn, *_rest, body = peer.frame()
    assert (ftype, flags & SHM, psn, body) == (Frame.WRITE, 0, 2, b"N" * 32)
    peer.sock.sendall(wire.pack(Frame.READ_RESP, 1, 32, flags=SHM))
    assert [w.wr_id for w in _completions(cq, 1)] == [2]
    assert bytes(dst.buf) == b"O" * 32
    os.close(fd)


def test_a_write_with_a_stray_ack_value_ends_the_connection(passive):
    """A shared WRITE's header with a non-zero ack field and no ACK flag: wire.decode
    refuses it, and so does the receive path's inline check (it falls through to decode)."""
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    slab = side["pd"].shared_slab(4096)
    mr = side["pd"].reg_mr(slab, RW)
    while peer.frame()[0] != Frame.SHARE:       # this side's SHARE of the region
        pass
    peer.sock.sendall(wire.pack(Frame.WRITE, 0, 16, mr.rkey, 0, mr.addr, flags=SHM, ack=5))
    assert _disconnected(side)
    with pytest.raises(wire.WireError):
        wire.decode(wire.pack(Frame.WRITE, 0, 16, mr.rkey, 0, mr.addr, flags=SHM, ack=5))


def test_without_memfds_buffer_pools_are_plain_memory(monkeypatch):
    """A machine whose memfd_create fails (a seccomp filter, an old kernel) still registers
    its pools; they are only not shared."""
    from blockfabric.fabric.buffers import BufferPool
    p = SoftProvider(progress="thread")
    pd = p.context.alloc_pd()
    try:
        shared = BufferPool(pd, 2, 4096, RW)
        assert shared.mr.slab is not None and shared.mr in pd.shared()

        def no_memfd(*_args, **_kw):
            raise OSError(38, "memfd_create: Function not implemented")
        monkeypatch.setattr(os, "memfd_create", no_memfd)
        plain = BufferPool(pd, 2, 4096, RW)
        assert plain.mr.slab is None and plain.mr not in pd.shared()
        plain.views[1][:4] = b"ok!!"
        assert bytes(plain.mr.buf[4096:4100]) == b"ok!!"
        for pool in (shared, plain):
            pool.close()
    finally:
        p.close()


@pytest.mark.parametrize("op", ["write", "read"])
def test_a_long_shared_copy_lets_what_the_pass_queued_leave_first(passive, op):
    """Inside a pass (sends corked until its end), an RDMA WRITE or READ through a shared
    region of CORK_BYTES or more copies at its post: what the pass queued before it (here
    a SEND, the answer to an earlier command) goes out first, not after the copy and the
    rest of the pass."""
    from blockfabric.rdma.soft import qp as qpmod
    port, accept = passive
    peer = UnixPeer(port)
    side = accept()
    peer.established()
    qp, ctx = side["qp"], side["pd"].ctx
    size = qpmod.CORK_BYTES
    fd = _memfd(size, SHARE_SEALS)
    peer.share(fd, size, 0x7070, addr=0x80000)
    assert _wait(lambda: 0x7070 in qp._peer)
    local = side["pd"].reg_mr(bytearray(size + 64), RW)
    tid = threading.get_ident()
    assert ctx.begin_pass(tid)
    try:
        qp.post_send(SendWR(1, WrOpcode.SEND, [SGE(local.addr + size, 64, local.lkey)],
                            SendFlags.SIGNALED))
        assert _quiet(peer), "a SEND left before the end of its pass"
        opcode = WrOpcode.RDMA_WRITE if op == "write" else WrOpcode.RDMA_READ
        qp.post_send(SendWR(2, opcode, [SGE(local.addr, size, local.lkey)],
                            SendFlags.SIGNALED, remote_addr=0x80000, rkey=0x7070))
        assert peer.frame()[0:3:2] == (Frame.SEND, 0), "the SEND waited for the pass's end"
    finally:
        ctx.end_pass(tid)
    if op == "write":
        assert peer.frame()[:3] == (Frame.WRITE, SHM, 1)
    else:   # the READ copied at its post and waits for the SEND's ACK, which it asks for
        assert peer.frame()[:2] == (Frame.ACK, FrameFlags.ACK_REQ)
        assert _quiet(peer)
    os.close(fd)
