"""A stateful fuzzer of the soft provider's wire: raw peers (no QP, no checks of their own)
open connections to a live target, do all, part or none of the CM exchange, send request
frames (capsules, RDMA WRITE and READ requests), lie in ACK/NAK/READ_RESP frames about PSNs
in and out of the window, send types, flags, versions and magics no peer should, huge and
truncated lengths, and close abruptly, while a bystander host verifies its data beside them.

After every step the target is alive and logged no traceback and little else; after every
example (its peers closed) the bystander never went ``MAX_GAP`` without a completion and the
target is back to its fds.  Budget and seeds: see :mod:`tests.hostile.fuzzkit`."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 precondition, rule)

from blockfabric.protocol import (CMConnectRequest, ConnectCommand, ConnectData, Identify,
                                  IOOpcode, KeepAlive, KeyedSGL, OffsetSGL, Property,
                                  PropertySet, ReadWrite)
from blockfabric.rdma import WcStatus
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame

from tests.protocol.strategies import sqes

from .conftest import NQN
from .fuzzkit import harness, replay, run_fuzzer  # noqa: F401  (harness: a fixture)
from .rawpeer import RawPeer

pytestmark = pytest.mark.needs_transport(
    "rdma", "fuzzes the soft provider's wire frames; verbs has no wire a process can forge "
    "(tests/hostile/test_fuzz_capsules.py fuzzes capsules on verbs)")

SOURCES = ("127.0.0.2", "127.0.0.3")
MAX_PEERS = 4
ATTACKER_NQN = "nqn.2014-08.org.nvmexpress:uuid:66666666-2222-3333-4444-555555555555"
#: what a peer's fake memory region is called in its SGLs
PEER_KEY, PEER_ADDR = 0x1234, 0x7F0000001000

u32 = st.integers(0, 0xFFFFFFFF)


def connect_data(cntlid: int = 0xFFFF) -> bytes:
    return ConnectData(hostid=bytes(range(16)), cntlid=cntlid, subnqn=NQN,
                       hostnqn=ATTACKER_NQN).pack()


def _sqe(cmd, sgl=None) -> bytes:
    return cmd.to_sqe(sgl=sgl).pack() if sgl is not None else cmd.to_sqe().pack()


#: capsules that move a queue forward: Connect (admin, its data fetched from the peer by
#: RDMA READ; I/O, in the capsule), enable, Identify and a read into the peer's "memory"
CAPSULES = {
    "connect admin": _sqe(ConnectCommand(recfmt=0, qid=0, sqsize=31, kato=0),
                          KeyedSGL(PEER_ADDR, 1024, PEER_KEY)),
    "connect io": _sqe(ConnectCommand(recfmt=0, qid=1, sqsize=31, kato=0),
                       OffsetSGL(0, 1024)) + connect_data(1),
    "enable": _sqe(PropertySet(attrib=0, offset=Property.CC, value=0x460001)),
    "identify": _sqe(Identify(cns=1), KeyedSGL(PEER_ADDR, 4096, PEER_KEY)),
    "read": _sqe(ReadWrite(IOOpcode.READ, 1, 0, 0), KeyedSGL(PEER_ADDR, 4096, PEER_KEY)),
    "keep alive": _sqe(KeepAlive()),
}

#: CM requests the target accepts: an admin queue, and an I/O queue of controller 1
GOOD_CM = [CMConnectRequest(recfmt=0, qid=0, hrqsize=32, hsqsize=31, cntlid=0).pack(),
           CMConnectRequest(recfmt=0, qid=1, hrqsize=32, hsqsize=31, cntlid=1).pack()]
good_cm = st.sampled_from(GOOD_CM)
cm_private = st.one_of(
    good_cm, good_cm, good_cm,
    st.builds(lambda qid, hrq, hsq, cntlid: CMConnectRequest(
        recfmt=0, qid=qid, hrqsize=hrq, hsqsize=hsq, cntlid=cntlid).pack(),
        st.sampled_from([0, 1, 2, 0xFFFF]), st.sampled_from([0, 1, 16, 32, 33, 0xFFFF]),
        st.sampled_from([0, 15, 31, 32, 0xFFFF]), st.sampled_from([0, 1, 0xFFFF])),
    st.binary(max_size=72))
capsules = st.one_of(st.sampled_from(sorted(CAPSULES)).map(CAPSULES.get),
                     sqes.map(lambda s: s.pack()), st.binary(max_size=128))
lengths = st.one_of(st.sampled_from([0, 1, 16, 63, 64, 1024, 4096, 65536, (1 << 24) - 1,
                                     1 << 31, 0xFFFFFFFF]), u32)
deltas = st.one_of(st.integers(-3, 3), st.sampled_from([1 << 31, (1 << 31) - 1, 1 << 20]))
types = st.one_of(st.sampled_from(list(Frame)), st.integers(0, 255))


class Peer:
    """A raw peer and what it knows: how far the CM went, the next PSN it owes, and the
    highest request PSN the target sent it."""

    def __init__(self, raw: RawPeer, n: int) -> None:
        self.raw = raw
        self.n = n
        self.stage = "tcp"
        self.closed = False
        self.theirs = -1            # last request PSN seen from the target

    def __repr__(self) -> str:
        return f"peer{self.n}"

    def send_bytes(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.raw.sock.sendall(data)
        except OSError:             # the target dropped us: that is its right
            self.close(abort=False)

    def close(self, abort: bool) -> None:
        if self.closed:
            return
        self.closed = True
        if abort:
            self.raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                     struct.pack("ii", 1, 0))
        self.raw.close()


class WireMachine(RuleBasedStateMachine):
    """The rules a hostile peer on the soft wire may follow, in any order."""

    harness = None          # set by run_fuzzer
    peers = Bundle("peers")

    def __init__(self) -> None:
        super().__init__()
        self.h = type(self).harness
        self.h.begin()
        self.all: list[Peer] = []
        self.opened = 0         # open minus closed by a rule (never by the target: rule
                                # choice must not depend on timing, or hypothesis cannot replay)

    # -- connections ---------------------------------------------------------------------
    @precondition(lambda self: self.opened < MAX_PEERS)
    @rule(target=peers, source=st.sampled_from(SOURCES))
    def open(self, source: str) -> Peer:
        peer = Peer(RawPeer(("127.0.0.1", self.h.port), source=source, timeout=2.0),
                    len(self.all))
        self.all.append(peer)
        self.opened += 1
        return peer

    @rule(peer=peers, private=cm_private, qp_num=st.sampled_from([0, 0x4242, 0xFFFFFFFF]),
          rtu=st.booleans(), lie=st.one_of(st.none(), st.none(), st.none(),
                                           st.sampled_from([0, 57, 196, 0xFFFFFFFF])))
    def cm(self, peer: Peer, private: bytes, qp_num: int, rtu: bool, lie: int | None) -> None:
        """CONN_REQ with this private data (and maybe a length that lies about it); on
        CONN_REP, maybe CONN_RTU."""
        if peer.closed or peer.stage != "tcp":
            return
        length = len(private) if lie is None else lie
        peer.send_bytes(wire.pack(Frame.CONN_REQ, length=length, extra=qp_num) + private)
        peer.stage = "cm sent"
        if lie is not None and lie > len(private):
            return                              # the target waits for the rest
        reply = self._recv(peer, 2.0)
        if reply is not None and reply[0] == Frame.CONN_REP:
            peer.stage = "connected"
            if rtu:
                peer.send_bytes(wire.pack(Frame.CONN_RTU))

    @precondition(lambda self: self.opened < MAX_PEERS)
    @rule(target=peers, source=st.sampled_from(SOURCES), private=good_cm)
    def open_connected(self, source: str, private: bytes) -> Peer:
        """A peer through the CM exchange in one step (most attacks start there)."""
        peer = self.open(source)
        self.cm(peer, private, 0x4242, True, None)
        return peer

    @rule(peer=consumes(peers), abort=st.booleans())
    def close(self, peer: Peer, abort: bool) -> None:
        self.opened -= 1
        peer.close(abort)

    # -- frames --------------------------------------------------------------------------
    @rule(peer=peers, kind=st.sampled_from([Frame.SEND, Frame.WRITE, Frame.READ_REQ]),
          capsule=capsules, key=st.sampled_from([0, 1, 2, 3, PEER_KEY]), addr=st.integers(
              0, (1 << 64) - 1), length=st.sampled_from([0, 64, 4096, 1 << 20]),
          psn=st.one_of(st.just(0), deltas))
    def request(self, peer: Peer, kind: Frame, capsule: bytes, key: int, addr: int,
                length: int, psn: int) -> None:
        """A request frame at (or near) the peer's next PSN: a capsule SEND, an RDMA WRITE
        of zeros, or an RDMA READ request."""
        if kind == Frame.SEND:
            frame = wire.pack(kind, peer.raw.psn + psn, len(capsule)) + capsule
        elif kind == Frame.WRITE:
            frame = wire.pack(kind, peer.raw.psn + psn, length, key, 0, addr) + bytes(
                min(length, 65536))
        else:
            frame = wire.pack(kind, peer.raw.psn + psn, length, key, 0, addr)
        if psn == 0:
            peer.raw.psn += 1
        peer.send_bytes(frame)

    @rule(peer=peers, kind=st.sampled_from([Frame.ACK, Frame.NAK, Frame.RNR_NAK,
                                            Frame.READ_RESP]),
          delta=deltas, key=st.one_of(st.sampled_from(list(WcStatus)), u32),
          length=st.sampled_from([0, 64, 1024, 4096]))
    def respond(self, peer: Peer, kind: Frame, delta: int, key: int, length: int) -> None:
        """An acknowledgement or response for a PSN of the target's near (or far from)
        the last one it sent; NAKs with any status."""
        psn = peer.theirs + delta
        body = bytes(length) if kind == Frame.READ_RESP else b""
        peer.send_bytes(wire.pack(kind, psn, len(body), key if kind == Frame.NAK else 0)
                        + body)

    @rule(peer=peers, magic=st.one_of(st.just(wire.MAGIC), st.integers(0, 255)),
          version=st.one_of(st.just(wire.VERSION), st.integers(0, 255)), ftype=types,
          flags=st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5]), st.integers(0, 0xFF)),
          psn=u32, length=lengths, key=u32, extra=u32,
          ack=st.one_of(st.just(0), deltas.map(lambda d: d & 0xFFFFFFFF), u32),
          addr=st.integers(0, (1 << 64) - 1), sent=st.integers(0, 4096),
          cut=st.integers(0, 32))
    def frame(self, peer: Peer, magic: int, version: int, ftype: int, flags: int, psn: int,
              length: int, key: int, extra: int, ack: int, addr: int, sent: int,
              cut: int) -> None:
        """Any header at all (a piggybacked ACK too), followed by up to ``sent`` bytes of its
        payload (so a huge length is followed by little, a truncated frame by none); ``cut``
        < 32 sends only that much of the header."""
        head = wire.HEADER.pack(magic, version, ftype, flags, psn, length, key, extra, ack,
                                addr)
        if cut < wire.HEADER_SIZE:
            peer.send_bytes(head[:cut])
            return
        peer.send_bytes(head + bytes(min(sent, length)))

    @rule(peer=peers, answer=st.booleans(), fill=st.integers(0, 255))
    def pump(self, peer: Peer, answer: bool, fill: int) -> None:
        """Read what the target sent; with ``answer``, acknowledge its requests as a real
        peer would (READ requests of 1024 bytes get a Connect's data, others ``fill``)."""
        for _ in range(16):
            got = self._recv(peer, 0.05)
            if got is None:
                return
            ftype, fields, _ = got
            if ftype in wire.REQUEST_FRAMES:
                peer.theirs = fields["psn"]
                if not answer:
                    continue
                if ftype == Frame.READ_REQ:
                    n = fields["length"]
                    if n > 1 << 20:
                        continue
                    data = connect_data() if n == 1024 else bytes([fill]) * n
                    peer.send_bytes(wire.pack(Frame.READ_RESP, fields["psn"], n) + data)
                else:
                    peer.send_bytes(wire.pack(Frame.ACK, fields["psn"]))

    def _recv(self, peer: Peer, timeout: float):
        """One frame from the target, None on timeout or once it closed (then marked)."""
        if peer.closed:
            return None
        peer.raw.sock.settimeout(timeout)
        try:
            got = peer.raw.recv_frame()
        except (socket.timeout, TimeoutError):
            return None
        except OSError:
            got = None
        if got is None:
            peer.close(abort=False)
        return got

    # -- checks --------------------------------------------------------------------------
    @invariant()
    def count(self) -> None:
        self.h.step()

    def teardown(self) -> None:
        for peer in self.all:
            peer.close(abort=False)
        self.h.end()


@pytest.mark.timeout(0)
def test_fuzz_soft_wire(request, harness):
    """See the module docstring; ``make fuzz`` runs it for ``FUZZ_SECONDS``."""
    run_fuzzer(request, WireMachine, "wire", harness, examples=60, steps=20)


def _nak_outside_the_enum(m: WireMachine) -> None:
    peer = m.open_connected(SOURCES[0], GOOD_CM[0])
    m.respond(peer, Frame.NAK, 0, 22, 0)


def _empty_send_then_a_capsule(m: WireMachine) -> None:
    peer = m.open_connected(SOURCES[0], GOOD_CM[0])
    peer.send_bytes(wire.pack(Frame.SEND, 0, 0) + wire.pack(Frame.SEND, 1, 64)
                    + CAPSULES["keep alive"])


#: what the fuzzer found (shrunk by hypothesis; see docs/security.md), kept as regressions
FOUND = {
    # a NAK whose status is not a WcStatus: ValueError out of the frame decoder, into
    # whichever queue's completion handling ran the engine (a traceback per frame)
    "NAK with status 22": _nak_outside_the_enum,
    # a SEND of 0 bytes breaks the queue; the next SEND of the same read is then handled
    # on the closed queue: IndexError in TargetQueue._on_capsule
    "empty SEND, then a capsule": _empty_send_then_a_capsule,
}


@pytest.mark.timeout(120)
def test_fuzz_soft_wire_findings(harness):
    replay(WireMachine, harness, FOUND)
