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
from blockfabric.protocol import CMConnectRequest, IOOpcode, KeyedSGL, ReadWrite
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame

from .conftest import (HOSTNQN, MAX_CONN, NQN, OTHER_HOSTNQN, TargetProbe,
                       assert_accepts_new_host, assert_undisturbed, free_port)
from .rawpeer import RawPeer

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
]


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
        _magic, _v, ftype, _fl, _psn, length, _key, _extra, _addr = \
            wire.HEADER.unpack_from(data, at)
        at += wire.HEADER_SIZE
        if ftype in wire.PAYLOAD_FRAMES and length:
            if ftype == Frame.WRITE:
                out.append(data[at:at + length])
            at += length
        count += 1
    return out, count


@pytest.mark.timeout(120)
def test_early_acknowledgements_get_no_other_subsystems_data(target, bystander):
    """Reported: a host allowed on A only, acknowledging sequence numbers before it had
    received them and not reading its socket, got 11 MiB of B's volume: the target's bounce
    buffers went back to the pool (and to B's reads) while views of them still waited to be
    sent.  Now the early acknowledgement ends the attacker's queue, and whatever it had
    received is A's data."""
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
        finally:
            stop.set()
            reader.join(10)
    assert secret_reads and all(secret_reads)
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
        with bystander.attack("ask for responses, never read"):
            batch = 1 << 15
            head = struct.Struct("<4sBBHIIIIQ")
            cut = False
            t0 = time.monotonic()
            for start in range(0, 1 << 21, batch):     # up to 2 M requests, 64 MiB
                chunk = b"".join(head.pack(wire.MAGIC, wire.VERSION, Frame.READ_REQ, 0, psn,
                                           0, 0, 0, 0) for psn in range(start, start + batch))
                try:
                    peer.sock.settimeout(10)
                    peer.sock.sendall(chunk)
                except OSError:
                    cut = True
                    break
            assert cut or drained_to_eof(peer.sock, 10), "the target buffered on"
            took = time.monotonic() - t0
        # (limits.connect_timeout, 10 s, would end this connection too: the bound must first)
        assert took < 8, f"the connection lasted {took:.1f} s"
    finally:
        peer.close()
    assert target.wait_log("unsent", 2), target.log[-3000:]
    cut_lines = [line for line in target.lines if "unsent" in line]
    assert len(cut_lines) == 1, cut_lines
    assert_undisturbed(bystander.finish(), bystander)
    assert target.alive()
    probe.assert_bounded()
    assert_accepts_new_host(target.port)
