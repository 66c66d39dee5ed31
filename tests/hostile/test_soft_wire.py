"""Peers that lie on the soft provider's wire: fields outside their enumerations, sequence
numbers acknowledged before they were sent, a socket nobody reads.  Each attack may cost
only the attacker's own connection; the bystander keeps its rate, the target logs a line
(not a traceback) per connection, and no byte of another subsystem reaches the attacker."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from blockfabric.initiator.host import connect
from blockfabric.rdma import get_provider
from blockfabric.protocol import CMConnectRequest, IOOpcode, KeyedSGL, ReadWrite
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame

from .conftest import (HOSTNQN, MAX_CONN, NQN, OTHER_HOSTNQN, TargetProbe,
                       assert_accepts_new_host, assert_undisturbed, free_port)
from .rawpeer import RawPeer

pytestmark = pytest.mark.needs_transport(
    "rdma", "its peers forge the soft provider's frames by hand; on verbs the NIC builds and "
    "checks them (the verbs contract suite, tests/rdma, covers the provider's side on "
    "rxe)")

QUEUE_REQ = CMConnectRequest(recfmt=0, qid=0, hrqsize=32, hsqsize=31, cntlid=0).pack()
FLOOD = 640 << 10           # bytes of bad frames per attack, as reported
MiB = 1 << 20


def send_quietly(sock: socket.socket, data: bytes) -> None:
    """sendall that stops once the target has closed the connection (the point)."""
    try:
        sock.sendall(data)
    except OSError:
        pass


def drained_to_eof(sock: socket.socket, timeout: float) -> bool:
    """Read and drop everything until the target closes (True) or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(1 << 20):
                return True
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            return True


def frames(ftype: int, count: int, **fields: int) -> bytes:
    return wire.pack(ftype, **fields) * count


#: (name, one malformed frame): each field outside what its frame type allows
BAD_FRAMES = [
    ("NAK status outside WcStatus", wire.pack(Frame.NAK, key=0xDEAD)),
    ("NAK status that is no remote error", wire.pack(Frame.NAK, key=5)),
    ("unknown frame type", wire.pack(99)),
    ("connect request on a connected queue", wire.pack(Frame.CONN_REQ)),
    ("SEND with an unknown flag", wire.pack(Frame.SEND, length=64, flags=0x80) + bytes(64)),
    ("WRITE with immediate and invalidate", wire.pack(Frame.WRITE, flags=3)),
    ("READ_REQ with a flag", wire.pack(Frame.READ_REQ, flags=1)),
    ("ACK of a sequence number never sent", wire.pack(Frame.ACK, psn=1000)),
    ("ACK with a length", wire.pack(Frame.ACK, psn=0xFFFFFFFF, length=5)),
    ("READ_RESP for a read never sent", wire.pack(Frame.READ_RESP, psn=7, length=4) + b"abcd"),
    ("RNR_NAK for a request never sent", wire.pack(Frame.RNR_NAK, psn=3)),
    ("request from the past", wire.pack(Frame.WRITE, psn=0xFFFFFF00)),
    ("payload above the largest message", wire.pack(Frame.SEND, length=0xFFFFFFFF)),
    # the edges of the receive path's inline check of SEND and WRITE (SoftQP._on_header):
    # each must fall through to wire.decode and be refused there
    ("SEND with a key", wire.pack(Frame.SEND, length=64, key=5) + bytes(64)),
    ("SEND with an address", wire.pack(Frame.SEND, length=64, addr=8) + bytes(64)),
    ("SEND with extra and no flag for it", wire.pack(Frame.SEND, length=64, extra=1)
     + bytes(64)),
    ("WRITE with extra and no flag for it", wire.pack(Frame.WRITE, length=0, extra=1)),
    ("SEND with an ACK value and no ACK flag", wire.pack(Frame.SEND, length=64, ack=1)
     + bytes(64)),
    ("WRITE above the largest message", wire.pack(Frame.WRITE, length=(1 << 31) + 1)),
]
#: cases whose connection must end for that frame itself, as wire.decode words it (taken
#: for a request, each would also end it, a frame later, for a repeated PSN)
REFUSED_BY_DECODE = {name for name, _ in BAD_FRAMES[-6:]}


@pytest.mark.timeout(120)
def test_frames_outside_their_enumerations_cost_only_their_connection(target, bystander):
    """Reported: 640 KB of such frames from a peer with no host NQN and no Fabrics Connect
    stalled every host for 7 s and logged 21 MB of tracebacks.  Now the first bad frame
    ends that connection, logged once, and nothing else notices."""
    probe = TargetProbe(target)
    addr = ("127.0.0.1", target.port)
    with bystander.attack("frames outside their enumerations"):
        for name, bad in BAD_FRAMES:
            peer = RawPeer(addr, source="127.0.0.2")
            try:
                kind, _ = peer.connect_cm(QUEUE_REQ)
                assert kind == Frame.CONN_REP, name
                sender = threading.Thread(target=send_quietly,
                                          args=(peer.sock, bad * (FLOOD // len(bad))))
                sender.start()
                assert drained_to_eof(peer.sock, 3), f"{name}: the connection was kept"
                sender.join(5)
            finally:
                peer.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    assert "Traceback" not in target.log
    violations = [line for line in target.lines if "soft RDMA" in line and "127.0.0.2" in line]
    assert len(violations) == len(BAD_FRAMES), violations     # one line per connection
    for (name, _), line in zip(BAD_FRAMES, violations):      # (one connection at a time)
        if name in REFUSED_BY_DECODE:
            assert "outside what it allows" in line, (name, line)
    probe.assert_bounded()
    assert_accepts_new_host(target.port)


# ------------------------------------------------------------------- acknowledged early

NQN_A = "nqn.2026-12.io.blockfabric:file-a"
ATTACKER = "nqn.2014-08.org.nvmexpress:uuid:aaaaaaaa-2222-3333-4444-555555555555"
SECRET = b"SUBSYSTEM-B-DATA"          # 16 bytes: what subsystem B's volume is made of
A_BYTE = 0x41                         # and subsystem A's
VOLUME = 32 * MiB


@pytest.fixture
def two_file_targets(start_target, tmp_path_factory):
    """Subsystem B (NQN: the bystander's, and HOSTNQN's) and A (the attacker's only), both
    file-backed, so that every read goes through the shared bounce buffers."""
    files = tmp_path_factory.mktemp("volumes")
    a, b = files / "a.img", files / "b.img"
    a.write_bytes(bytes([A_BYTE]) * VOLUME)
    b.write_bytes(SECRET * (VOLUME // len(SECRET)))
    port = free_port()
    config = {
        "listeners": [{"provider": "soft", "address": "127.0.0.1", "port": port}],
        "subsystems": [
            {"nqn": NQN, "hosts": [OTHER_HOSTNQN, HOSTNQN],
             "namespaces": [{"nsid": 1, "backend": "file", "path": str(b), "size": "32MiB"}]},
            {"nqn": NQN_A, "hosts": [ATTACKER],
             "namespaces": [{"nsid": 1, "backend": "file", "path": str(a), "size": "32MiB"}]},
        ],
        "limits": {"max_connections_per_host": MAX_CONN * 2},
    }
    proc = start_target(config)
    proc.port = port
    return proc


@pytest.fixture
def target(two_file_targets):
    return two_file_targets


def take_over(queue) -> tuple[socket.socket, int, int]:
    """Take a connected host queue's soft QP away from its engine, to drive its wire by
    hand: (socket, the next request PSN we send, the next PSN the target sends)."""
    qp = queue.qp
    with qp._lock:
        qp.ctx.unregister(qp, qp.sock.fileno())
        sock = qp.sock
        sock.setblocking(True)
        return sock, qp._next_psn, qp._exp_psn


def read_capsule(cid: int, slba: int, blocks: int, addr: int, rkey: int) -> bytes:
    sqe = bytearray(ReadWrite(IOOpcode.READ, 1, slba, blocks - 1).to_sqe(
        sgl=KeyedSGL(addr, blocks * 4096, rkey)).pack())
    sqe[2:4] = struct.pack("<H", cid)
    return bytes(sqe)


def parse_stream(data: bytes) -> tuple[list[bytes], int]:
    """The WRITE payloads in a byte stream of frames (a cut last frame is dropped), and
    how many frames there were."""
    out, at, count = [], 0, 0
    while at + wire.HEADER_SIZE <= len(data):
        _magic, _v, ftype, _fl, _psn, length, _key, _extra, _ack, _addr = \
            wire.HEADER.unpack_from(data, at)
        at += wire.HEADER_SIZE
        if ftype in wire.PAYLOAD_FRAMES and length and not _fl & wire.FrameFlags.SHM:
            if ftype == Frame.WRITE:
                out.append(data[at:at + length])
            at += length
        count += 1
    return out, count


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "same-host"])
def test_early_acknowledgements_get_no_other_subsystems_data(target, bystander, shm,
                                                             monkeypatch):
    """Reported: a host allowed on A only, acknowledging sequence numbers before it had
    received them and not reading its socket, got 11 MiB of B's volume: the target's bounce
    buffers went back to the pool (and to B's reads) while views of them still waited to be
    sent.  Now the early acknowledgement ends the attacker's queue, and whatever it had
    received is A's data.  Over TCP and over a same-host connection, where the data lands
    in the attacker's shared memory instead of its socket: there too only A's."""
    monkeypatch.setattr(get_provider("soft"), "shm", shm)
    probe = TargetProbe(target)
    stop = threading.Event()
    secret_reads = []

    def read_b(ctrl) -> None:          # fills the shared bounce buffers with B's data
        ns = ctrl.namespaces[1]
        offset = 8 * MiB
        while not stop.is_set():
            data = ns.read(offset, MiB)
            secret_reads.append(data[:16] == SECRET)
            offset = 8 * MiB + (offset + MiB) % (16 * MiB)

    received = bytearray()
    with connect("127.0.0.1", NQN, target.port, provider="soft", hostnqn=HOSTNQN,
                 nr_io_queues=1) as b_host, \
            connect("127.0.0.1", NQN_A, target.port, provider="soft", hostnqn=ATTACKER,
                    nr_io_queues=1, ctrl_loss_tmo=0) as attacker:
        reader = threading.Thread(target=read_b, args=(b_host,))
        reader.start()
        try:
            time.sleep(0.3)             # let the attacker's queue settle: nothing in flight
            sock, psn, target_psn = take_over(attacker.io_queues[0])
            mr = attacker.arena.mr
            blocks = 64                 # 256 KiB reads
            with bystander.attack("acknowledge early, never read"):
                deadline = time.monotonic() + 3
                cid = slba = 0
                try:
                    while time.monotonic() < deadline:
                        # a round of reads, well inside the queue depth ...
                        out = []
                        for _ in range(32):
                            capsule = read_capsule(cid, slba, blocks, mr.addr, mr.rkey)
                            out.append(wire.pack(Frame.SEND, psn, len(capsule)) + capsule)
                            psn, cid = psn + 1, (cid + 1) % 128
                            slba = (slba + blocks) % (VOLUME // 4096)
                        sock.sendall(b"".join(out))
                        time.sleep(0.1)
                        # ... then "everything you sent is placed", long before it was
                        sock.sendall(wire.pack(Frame.ACK, target_psn + (1 << 20)))
                        time.sleep(0.02)
                except OSError:
                    pass                # the target ended the connection: the point
                sock.settimeout(3)
                try:
                    while chunk := sock.recv(1 << 20):
                        received += chunk
                except OSError:
                    pass
                # what the target placed in the attacker's memory (all of it, same-host)
                arena = bytes(mr.buf[:blocks * 4096])
        finally:
            stop.set()
            reader.join(10)
    assert secret_reads and all(secret_reads)
    if shm:         # (over TCP the attacker's memory holds what it had before the take-over)
        assert arena.count(A_BYTE) == len(arena), \
            f"the attacker's memory holds {arena.count(SECRET[:8])} pieces of B's volume"
    payloads, count = parse_stream(bytes(received))
    leaked = sum(p.count(SECRET[:8]) for p in payloads)
    foreign = sum(len(p) - p.count(A_BYTE) for p in payloads)
    assert leaked == 0 and foreign == 0, (f"the attacker got {foreign} bytes that are not "
                                          f"A's ({leaked} pieces of B's volume) in "
                                          f"{len(payloads)} writes")
    assert target.wait_log("never sent", 2), target.log[-3000:]
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    probe.assert_bounded()
    assert_accepts_new_host(target.port)


# ------------------------------------------------------------------- a socket nobody reads


@pytest.mark.timeout(120)
def test_a_peer_that_never_reads_is_cut_off_at_the_unsent_bound(target, bystander):
    """Zero-length RDMA READs (allowed under any key) each get a response; a peer that asks
    for millions and never reads made the target queue them without limit.  Now the
    connection ends when its unsent frames pass ``limits.max_unsent_bytes`` (the default,
    derived from the queue depth), logged once; the target's memory stays bounded."""
    probe = TargetProbe(target)
    peer = RawPeer(("127.0.0.1", target.port), source="127.0.0.2")
    try:
        kind, _ = peer.connect_cm(QUEUE_REQ)
        assert kind == Frame.CONN_REP
        peer.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        # built beforehand: making frames in this process during the attack would take the
        # GIL from the bystander, which runs here too
        head = wire.HEADER
        flood = memoryview(b"".join(head.pack(wire.MAGIC, wire.VERSION, Frame.READ_REQ, 0, psn,
                                              0, 0, 0, 0, 0) for psn in range(1 << 20)))
        with bystander.attack("ask for responses, never read"):
            cut = False
            for start in range(0, len(flood), 1 << 20):    # 1 M requests, 32 MiB
                try:
                    peer.sock.settimeout(10)
                    peer.sock.sendall(flood[start:start + (1 << 20)])
                except OSError:
                    cut = True
                    break
            assert cut or drained_to_eof(peer.sock, 10), "the target buffered on"
    finally:
        peer.close()
    # cut by the bound, logged once (limits.connect_timeout, 10 s, would end this
    # connection too, but not one that had sent a Connect)
    assert target.wait_log("does not read", 2), target.log[-3000:]
    cut_lines = [line for line in target.lines if "does not read" in line]
    assert len(cut_lines) == 1 and "127.0.0.2" in cut_lines[0], cut_lines
    assert "no Fabrics Connect" not in target.log
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    probe.assert_bounded()
    assert_accepts_new_host(target.port)


# ------------------------------------------------------------------- the provider alone
# The same guarantees at the provider's interface, against a peer that answers by hand and
# does not read: no send WR completes (so no owner reuses its memory) while its bytes still
# wait in the unsent queue.

def _lone_requester(payload: int):
    """(provider, cmid, qp, cq, mr, the peer's socket): a soft QP connected to a hand-made
    peer that never reads, with ``payload`` bytes of registered memory."""
    from blockfabric.rdma import Access
    from blockfabric.rdma.soft import SoftProvider

    server = socket.create_server(("127.0.0.1", 0))
    provider = SoftProvider(progress="thread")
    cmid = provider.create_id()
    cmid.resolve("127.0.0.1", server.getsockname()[1])
    pd, cq = cmid.context.alloc_pd(), cmid.context.create_cq()
    qp = cmid.create_qp(pd, cq, cq)
    peer = {}

    def answer():
        conn, _ = server.accept()
        conn.recv(wire.HEADER_SIZE)
        conn.sendall(wire.pack(Frame.CONN_REP))
        peer["sock"] = conn

    t = threading.Thread(target=answer)
    t.start()
    cmid.connect(b"")
    t.join()
    server.close()
    mr = pd.reg_mr(bytearray(payload), Access.LOCAL_WRITE)
    return provider, cmid, qp, cq, mr, peer["sock"]


def _wait_wc(cq, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        wcs = cq.poll()
        if wcs:
            return wcs
        time.sleep(0.005)
    raise AssertionError("no completion")


@pytest.mark.parametrize("answer", ["ACK", "NAK"])
def test_no_send_completes_while_its_bytes_wait_to_be_sent(answer):
    """A 32 MiB RDMA WRITE to a peer that reads nothing: most of it waits in the unsent
    queue.  An ACK for it is a lie (the connection ends, the WR is flushed); a NAK is fair
    (its header went out) but fails the WR with bytes still queued, so the connection is
    cut first.  Either way: once the WR has completed, its memory is rewritten, and none of
    the new bytes ever reaches the peer."""
    from blockfabric.rdma import SGE, SendWR, WcStatus, WrOpcode

    size = 32 * MiB
    provider, cmid, qp, cq, mr, sock = _lone_requester(size)
    try:
        qp.post_send(SendWR(1, WrOpcode.RDMA_WRITE, [SGE(mr.addr, size, mr.lkey)],
                            remote_addr=0x1000, rkey=0x77))
        time.sleep(0.2)
        if answer == "ACK":
            sock.sendall(wire.pack(Frame.ACK, 0))
            want = WcStatus.WR_FLUSH_ERR
        else:
            sock.sendall(wire.pack(Frame.NAK, 0, key=WcStatus.REM_ACCESS_ERR))
            want = WcStatus.REM_ACCESS_ERR
        (wc,) = _wait_wc(cq)
        assert wc.status == want, wc
        mr.buf[:] = b"REUSED!!" * (size // 8)       # the owner has its memory back
        got = bytearray()
        sock.settimeout(5)
        while chunk := sock.recv(1 << 20):
            got += chunk
        assert len(got) < wire.HEADER_SIZE + size, "the whole WRITE went out"
        assert b"REUSED!!" not in got
    finally:
        sock.close()
        cmid.close()
        provider.close()


def test_an_ack_never_runs_ahead_of_the_data():
    """A SEND and then a WRITE whose payload is still arriving, in one segment: the
    responder may acknowledge the SEND, never the WRITE before its last byte is in place
    (the requester would free or reuse the memory it is still sending from, and a target
    that checks, rightly, cuts the connection: a legitimate host lost its queue that way
    about once in seven runs between network namespaces)."""
    from blockfabric.rdma import SGE, Access, RecvWR

    provider, cmid, qp, cq, mr, sock = _lone_requester(4096)
    try:
        target = qp.pd.reg_mr(bytearray(8192), Access.LOCAL_WRITE | Access.REMOTE_WRITE)
        qp.post_recv(RecvWR(7, [SGE(mr.addr, 4096, mr.lkey)]))
        payload = bytes(range(256)) * 32
        sock.sendall(wire.pack(Frame.SEND, 0, 16) + b"s" * 16
                     + wire.pack(Frame.WRITE, 1, len(payload), target.rkey, 0, target.addr)
                     + payload[:100])
        acked = _acks(sock, 0.5)
        assert acked and max(acked) == 0, f"acknowledged {acked} with the WRITE incomplete"
        sock.sendall(payload[100:])
        acked = _acks(sock, 2.0)
        assert 1 in acked, acked
        assert bytes(target.buf) == payload
    finally:
        sock.close()
        cmid.close()
        provider.close()


def _acks(sock, seconds: float) -> list[int]:
    """The PSNs of the ACK frames the peer gets within ``seconds`` (other frames skipped)."""
    out: list[int] = []
    sock.settimeout(seconds)
    buf = b""
    try:
        while True:
            buf += sock.recv(65536)
            while len(buf) >= wire.HEADER_SIZE:
                ftype, _flags, psn, length, *_ = wire.unpack(buf)
                size = wire.HEADER_SIZE + (length if ftype in wire.PAYLOAD_FRAMES else 0)
                if len(buf) < size:
                    break
                if ftype == Frame.ACK:
                    out.append(psn)
                buf = buf[size:]
    except (socket.timeout, TimeoutError):
        pass
    return out
