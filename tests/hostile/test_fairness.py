"""Fair shares: a host that takes every shared bounce buffer of a file-backed volume and never
lets the transfers finish (a raw soft-wire peer that never acknowledges the target's RDMA
WRITE and SEND of its reads, and never answers the RDMA READ of its writes) gets only its
share of the pool while another host verifies its data beside it, and is disconnected after
``limits.buffer_hold_timeout``: logged once, counted in ``status`` and in
``blockfabric_buffer_hold_disconnects_total``; a new host connects afterwards.

With two poll groups the hoarder hoards on its queue that a worker serves: the worker's
hold watch ends it, the coordinator counts and logs it once and ends the controller (its
queues in both groups)."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request

import pytest

from blockfabric.protocol import (CQE, CMConnectRequest, KeyedSGL, OffsetSGL, IOOpcode,
                                  ReadWrite)
from blockfabric.protocol.admin import NumberOfQueues, SetFeatures
from blockfabric.protocol.fabrics import CC, ConnectCommand, ConnectData, PropertySet
from blockfabric.protocol.opcodes import FeatureId
from blockfabric.rdma.soft.wire import Frame
from blockfabric.target import control

from e2e.conftest import BIN
from .conftest import (NQN, TargetProbe, assert_accepts_new_host,
                       assert_undisturbed)
from .rawpeer import RawPeer

pytestmark = pytest.mark.needs_transport(
    "rdma", "the hoarder is a raw soft-wire peer that never acknowledges RDMA READ/WRITE; an RC "
    "NIC acknowledges them itself, so on verbs a host cannot hold bounce buffers this way")

MiB = 1 << 20
BS = 4096
HOLD = 2                        # limits.buffer_hold_timeout in these tests, seconds
HOARDER = "nqn.2014-08.org.nvmexpress:uuid:66666666-2222-3333-4444-555555555555"
DEPTH = 128                     # the target's default limits.queue_size
SHARE = 64 // 2                 # its share of the 64 bounce buffers beside one other host


def expect(peer: RawPeer, want: Frame) -> tuple[dict[str, int], bytes]:
    """The next frame of type ``want`` (the target's ACKs of our requests are skipped)."""
    while True:
        frame = peer.recv_frame()
        assert frame is not None, f"the target closed the connection (waiting for {want!r})"
        ftype, fields, payload = frame
        if ftype == want:
            return fields, payload
        assert ftype == Frame.ACK, (want, frame)


def command(peer: RawPeer, capsule: bytes, data: bytes | None = None) -> CQE:
    """Send a command capsule, serve the target's RDMA READ of ``data`` if it asks, take
    the answer and acknowledge it like a well-behaved host."""
    peer.request(Frame.SEND, capsule)
    if data is not None:
        fields, _ = expect(peer, Frame.READ_REQ)
        peer.send(Frame.READ_RESP, data[:fields["length"]], psn=fields["psn"])
    fields, payload = expect(peer, Frame.SEND)
    peer.send(Frame.ACK, psn=fields["psn"])
    cqe = CQE.unpack_from(payload)
    assert cqe.status == 0, cqe
    return cqe


class Hoarder:
    """A controller spoken by hand: a raw admin queue, then raw I/O queues that each send
    ``DEPTH`` one-MiB commands and never let one finish (no ACK, no READ_RESP)."""

    def __init__(self, port: int, hostnqn: str = HOARDER, queues: int = 2) -> None:
        self.addr = ("127.0.0.1", port)
        self.hostnqn = hostnqn
        self.hostid = os.urandom(16)
        self.admin = self._queue(0, 32, 0xFFFF)
        # Connect: its data is fetched by RDMA READ (the admin queue takes no inline data)
        cqe = command(self.admin, ConnectCommand(recfmt=0, qid=0, sqsize=31, cattr=0,
                                                 kato=0).to_sqe(
            cid=1, sgl=KeyedSGL(0x10000, 1024, 0x77)).pack(), self._connect_data(0xFFFF))
        self.cntlid = cqe.result & 0xFFFF
        command(self.admin, PropertySet(attrib=0, offset=0x14, value=CC(
            en=True, css=0, mps=0, ams=0, shn=0, iosqes=6, iocqes=4).to_int()).to_sqe(
            cid=2).pack())
        command(self.admin, SetFeatures(fid=FeatureId.NUM_QUEUES, value=NumberOfQueues(
            nsqr=queues - 1, ncqr=queues - 1).to_int()).to_sqe(cid=3).pack())
        self.io: list[RawPeer] = []
        for qid in range(1, queues + 1):
            peer = self._queue(qid, DEPTH, self.cntlid)
            self.io.append(peer)
            data = self._connect_data(self.cntlid)
            command(peer, ConnectCommand(recfmt=0, qid=qid, sqsize=DEPTH - 1, cattr=0,
                                         kato=0).to_sqe(
                cid=1, sgl=OffsetSGL(0, len(data))).pack() + data)

    def _queue(self, qid: int, depth: int, cntlid: int) -> RawPeer:
        peer = RawPeer(self.addr, source="127.0.0.2")
        kind, _ = peer.connect_cm(CMConnectRequest(recfmt=0, qid=qid, hrqsize=depth,
                                                   hsqsize=depth - 1, cntlid=cntlid).pack())
        assert kind == Frame.CONN_REP, kind
        return peer

    def _connect_data(self, cntlid: int) -> bytes:
        return ConnectData(hostid=self.hostid, cntlid=cntlid, subnqn=NQN,
                           hostnqn=self.hostnqn).pack()

    def hoard(self, qids: set[int] | None = None) -> None:
        """Every queue (of ``qids``) full of 1 MiB commands, reads on odd queues and writes
        on even ones, in the upper half of the volume (the bystander verifies the lower
        part)."""
        nlb = MiB // BS
        for i, peer in enumerate(self.io):
            if qids is not None and i + 1 not in qids:
                continue
            op = IOOpcode.READ if i % 2 == 0 else IOOpcode.WRITE
            for cid in range(DEPTH - 1):
                slba = (32 * MiB + (cid % 32) * MiB) // BS
                peer.request(Frame.SEND, ReadWrite(op, 1, slba, nlb - 1).to_sqe(
                    cid=cid + 2, sgl=KeyedSGL(0x100000 + cid * MiB, MiB, 0x99)).pack())

    def close(self) -> None:
        for peer in [self.admin, *self.io]:
            peer.close()


def closed_within(peer: RawPeer, timeout: float) -> tuple[bool, int]:
    """(whether the target tore the connection down within ``timeout``, how many non-zero
    bytes its RDMA WRITEs brought).  The hoarder reads only blocks nobody writes, so every
    non-zero byte would be another host's data out of a reused bounce buffer."""
    peer.sock.settimeout(timeout)
    foreign = 0
    try:
        while (frame := peer.recv_frame()) is not None:
            if frame[0] == Frame.WRITE:
                foreign += len(frame[2]) - frame[2].count(0)
    except (TimeoutError, OSError) as exc:
        return not isinstance(exc, TimeoutError), foreign
    return True, foreign


def status(target) -> dict:
    out = subprocess.run([str(BIN / "blockfabric-target"), "status", "--socket", target.socket,
                          "--output-format", "json"], capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def hold_disconnects(target) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{target.metrics}/metrics",
                                  timeout=10).read().decode()
    (line,) = [x for x in text.splitlines()
               if x.startswith("blockfabric_buffer_hold_disconnects_total")]
    return float(line.split()[-1])


@pytest.fixture(params=(1, 2), ids=lambda n: f"{n}r")
def target_reactors(request) -> int:
    return request.param


def _worker_qids(target, hostnqn: str) -> set[int]:
    """The I/O queues of ``hostnqn``'s controller that a worker serves."""
    (ctrl,) = [c for c in status(target)["controllers"] if c["hostnqn"] == hostnqn]
    return {q["qid"] for q in ctrl["queues"] if q["qid"] and q["group"]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"backend": "file", "buffer_hold_timeout": HOLD}],
                         indirect=True)
def test_bounce_buffer_hoarder_gets_its_share_then_is_disconnected(target, bystander,
                                                                   target_reactors):
    probe = TargetProbe(target)
    assert hold_disconnects(target) == 0
    hoarder = Hoarder(target.port)
    qids = None
    if target_reactors > 1:
        qids = _worker_qids(target, HOARDER)
        assert qids, "no queue of the hoarder in the worker"
    try:
        with bystander.attack("bounce buffer hoarding"):
            started = time.monotonic()
            hoarder.hoard(qids)
            # It holds what it may, never more than half while the bystander is active.
            held = []
            while time.monotonic() < started + HOLD * 0.8:
                held.append(control.request(target.socket, "status")["resources"]
                            ["bounce_buffers_by_host"].get(HOARDER, 0))
                time.sleep(0.05)
            # (the share per group; with two groups the hoarding queues are the worker's,
            # whose pool status adds from its counters, sent every 0.5 s)
            assert max(held) == SHARE, held
            # The whole controller goes: every queue of it, the admin queue too.
            for i, peer in enumerate([*hoarder.io, hoarder.admin]):
                closed, foreign = closed_within(peer, HOLD + 5)
                assert closed, f"hoarder queue {i} still connected"
                assert foreign == 0, f"{foreign} foreign bytes reached the hoarder"
            waited = time.monotonic() - started
            assert HOLD * 0.9 <= waited < HOLD + 3, waited
    finally:
        hoarder.close()
    assert target.wait_log("over limits.buffer_hold_timeout)", 2), target.log
    lines = [x for x in target.lines if "held a bounce buffer" in x]
    assert len(lines) == 1, lines                               # logged once
    assert f"hostnqn='{HOARDER}'" in lines[0] and "peer='127.0.0.2:" in lines[0], lines
    assert hold_disconnects(target) == 1
    # (a worker's part of status is as of its last report: sent when a queue ends, and
    # every 0.5 s)
    deadline = time.monotonic() + 2
    while HOARDER in (st := status(target))["resources"]["bounce_buffers_by_host"] \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert st["buffer_hold_disconnects"] == 1, st
    assert HOARDER not in st["resources"]["bounce_buffers_by_host"], st
    assert_undisturbed(bystander.finish(), bystander)
    assert_accepts_new_host(target.port)
    # Every buffer came back once the hoarder's queues were gone.
    deadline = time.monotonic() + 5
    while (st := status(target))["resources"]["bounce_buffers_in_use"] \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert st["resources"]["bounce_buffers_in_use"] == 0, st
    assert st["resources"]["bounce_waiters"] == 0, st
    assert target.alive()
    probe.assert_bounded()
