"""Every allocation a peer can drive is bounded before it is made: half-sent connection
requests (a count cap, a timeout, and shedding instead of spinning when the target is out
of file descriptors), queues before their Fabrics Connect (one receive slot each, and a
cap across all addresses), and lengths in commands (checked against the SGL and MDTS
before anything of that size exists).  Each attack runs beside a bystander host doing
verified I/O."""

from __future__ import annotations

import socket
import time

import pytest

from blockfabric.initiator.host import connect
from blockfabric.protocol import CMConnectRequest, CMReject, CMRejectStatus, KeyedSGL, StatusCode
from blockfabric.protocol.admin import GetLogPage
from blockfabric.protocol.io import DatasetManagement, DSMRange
from blockfabric.protocol.opcodes import LogPageId
from blockfabric.rdma.soft import wire
from blockfabric.rdma.soft.wire import Frame

from .conftest import (HOSTNQN, NQN, TargetProbe, addr_of, assert_accepts_new_host,
                       assert_undisturbed, via, volume_rss)
from .rawpeer import RawPeer

#: the tests whose peers send half or bare soft-provider connection requests by hand
SOFT_WIRE = pytest.mark.needs_transport(
    "rdma", "its peers send half or bare soft-provider connection requests by hand; on verbs "
    "connection requests are rdma_cm's, made by the kernel")

ADMIN_QUEUE_REQ = CMConnectRequest(recfmt=0, qid=0, hrqsize=32, hsqsize=31, cntlid=0).pack()
MiB = 1 << 20
MDTS = MiB              # the target's default limits.mdts
#: the first bytes of a connect request, never the rest
HALF_REQUEST = wire.pack(Frame.CONN_REQ, length=32)[:wire.HEADER_SIZE // 2]


def sources(count: int, subnet: int = 1) -> list[str]:
    """``count`` distinct loopback addresses, none of them the bystander's 127.0.0.1."""
    return [f"127.{subnet}.{i // 250}.{i % 250 + 2}" for i in range(count)]


def half_requests(port: int, addrs: list[str]) -> list[socket.socket]:
    """One TCP connection per address, each sending half a connect request header."""
    socks = []
    for addr in addrs:
        s = socket.socket()
        s.settimeout(2)
        s.bind((addr, 0))
        try:
            s.connect(("127.0.0.1", port))
            s.sendall(HALF_REQUEST)
        except OSError:
            pass                # refused or reset: the target shed it, which is allowed
        socks.append(s)
    return socks


def closed_by_peer(s: socket.socket) -> bool:
    """True once the other end has closed (EOF or reset), without waiting."""
    s.setblocking(False)
    try:
        return s.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def try_connect(port: int, source: str, private: bytes) -> str:
    """A whole CM exchange from ``source``: 'rep', 'rej', or 'dropped' (closed, reset or no
    answer in 2 s); never raises."""
    try:
        peer = RawPeer(("127.0.0.1", port), source=source, timeout=2)
    except OSError:
        return "dropped"
    try:
        peer.send(Frame.CONN_REQ, private, extra=1)
        frame = peer.recv_frame()
    except OSError:
        frame = None
    finally:
        peer.close()
    kind = frame[0] if frame else None
    return {Frame.CONN_REP: "rep", Frame.CONN_REJ: "rej"}.get(kind, "dropped")


def until(sample, done, timeout: float):
    """``sample()`` again every 50 ms until ``done(value)`` or ``timeout`` s; the last."""
    deadline = time.monotonic() + timeout
    while True:
        value = sample()
        if done(value) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def vm(pid: int, key: str) -> int:
    """A size from /proc/PID/status (VmHWM: peak resident, VmSize: virtual), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# -- (a) pending connection requests ---------------------------------------------------------

NOFILE = 160


@pytest.mark.timeout(60)
# descriptors, not the pending cap, run out first
@pytest.mark.parametrize("target", [{"nofile": NOFILE, "max_pending_requests": 4096,
                                     "request_timeout": 60}], indirect=True)
@SOFT_WIRE
def test_fd_exhaustion_by_half_sent_requests_is_shed_not_spun(target, bystander):
    """Half-sent connect requests from 2.5 x RLIMIT_NOFILE source addresses: the target runs
    out of descriptors, sheds (logged once an episode) instead of spinning on EMFILE,
    keeps serving the bystander, and accepts a new host once the attacker has gone."""
    probe = TargetProbe(target)
    with bystander.attack("half-sent requests past RLIMIT_NOFILE"):
        socks = half_requests(target.port, sources(int(NOFILE * 2.5)))
        assert target.wait_log("out of file descriptors", 5), target.log[-2000:]
        # whole requests meanwhile: each accepted, refused or dropped, never a traceback
        outcomes = [try_connect(target.port, addr, ADMIN_QUEUE_REQ)
                    for addr in sources(20, subnet=3)]
        assert set(outcomes) <= {"rep", "rej", "dropped"}, outcomes
        time.sleep(2)                       # the attacker holds them; the target must not spin
        during = len(target.log)
        time.sleep(1)
        assert len(target.log) - during < 1024, target.log[-2000:]
        for s in socks:
            s.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert_accepts_new_host(target.port)
    assert target.wait_log("accepting again after shedding", 5), target.log[-2000:]
    # logged when an episode begins and ends, not per connection (there were 400)
    shedding = [x for x in target.lines if "out of file descriptors (" in x]
    assert 1 <= len(shedding) <= 3, "".join(target.lines[-30:])
    assert "Traceback" not in target.log
    probe.assert_bounded()


PENDING = 8
REQUEST_TIMEOUT = 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"max_pending_requests": PENDING,
                                     "request_timeout": REQUEST_TIMEOUT}], indirect=True)
@SOFT_WIRE
def test_half_sent_requests_are_capped_and_time_out(target, bystander):
    """More half-sent requests than ``limits.max_pending_requests``: the oldest are dropped
    for the newest at once, the rest after ``limits.request_timeout``; a whole request
    still gets through during and after."""
    probe = TargetProbe(target)
    with bystander.attack("half-sent requests past max_pending_requests"):
        socks = half_requests(target.port, sources(3 * PENDING))
        started = time.monotonic()
        dropped = until(lambda: [closed_by_peer(s) for s in socks],
                        lambda d: all(d[:2 * PENDING]), 2)
        assert dropped == [True] * (2 * PENDING) + [False] * PENDING, dropped
        peer = RawPeer(("127.0.0.1", target.port), source="127.0.0.3")
        try:
            kind, _ = peer.connect_cm(ADMIN_QUEUE_REQ)
            assert kind == Frame.CONN_REP
        finally:
            peer.close()
        # the whole request took the place of the oldest still pending; the rest wait
        time.sleep(max(0.0, started + REQUEST_TIMEOUT - 0.5 - time.monotonic()))
        kept = [closed_by_peer(s) for s in socks[2 * PENDING:]]
        assert kept == [True] + [False] * (PENDING - 1), kept
        late = until(lambda: [closed_by_peer(s) for s in socks[2 * PENDING:]], all, 3)
        assert all(late), f"not dropped after request_timeout: {late}"
        for s in socks:
            s.close()
    assert_undisturbed(bystander.finish(), bystander)
    assert_accepts_new_host(target.port)
    probe.assert_bounded()


# -- (c) queues before Fabrics Connect ---------------------------------------------------

UNCONNECTED = 16
IO_QUEUE_REQ = CMConnectRequest(recfmt=0, qid=1, hrqsize=128, hsqsize=127, cntlid=1).pack()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"max_unconnected_queues": UNCONNECTED,
                                     "connect_timeout": 30}], indirect=True)
@SOFT_WIRE
def test_unconnected_queues_are_capped_across_addresses_and_cost_little(target, bystander):
    """Bare CM connects of full-depth I/O queues, one per source address (so the per-host
    limit never applies): ``limits.max_unconnected_queues`` are accepted, each costing
    one receive slot rather than a queue's worth, the rest get NO_RESOURCES (logged once,
    not once each); the bystander's connected queues are untouched."""
    probe = TargetProbe(target)
    size_before = vm(target.proc.pid, "VmSize")
    peers, outcomes = [], []
    with bystander.attack("unconnected queues from many addresses"):
        try:
            for addr in sources(3 * UNCONNECTED, subnet=2):
                peer = RawPeer(("127.0.0.1", target.port), source=addr)
                peers.append(peer)
                kind, private = peer.connect_cm(IO_QUEUE_REQ)
                outcomes.append(kind if kind == Frame.CONN_REP
                                else CMReject.unpack_from(private).sts)
            grew = vm(target.proc.pid, "VmSize") - size_before
            time.sleep(1)                   # held: the bystander goes on meanwhile
        finally:
            for peer in peers:
                peer.close()
    assert outcomes == [Frame.CONN_REP] * UNCONNECTED \
        + [CMRejectStatus.NO_RESOURCES] * (2 * UNCONNECTED), outcomes
    # 128 receive slots of 4 KiB + 64 would be 520 KiB a queue; one slot is 8 KiB mapped
    assert grew < UNCONNECTED * 128 * 1024, f"{grew >> 10} KiB for {UNCONNECTED} queues"
    refusals = [x for x in target.lines if "max_unconnected_queues is" in x]
    assert len(refusals) == 1, refusals
    assert_undisturbed(bystander.finish(), bystander)
    assert_accepts_new_host(target.port)
    probe.assert_bounded()


# -- (b) lengths in commands -----------------------------------------------------------------

def log_page(ctrl, lid: int, length: int, sgl_length: int) -> bytes:
    mr = ctrl.arena.mr
    return GetLogPage(lid=lid, numd=length // 4 - 1).to_sqe(
        sgl=KeyedSGL(mr.addr, sgl_length, mr.rkey)).pack()


def dsm(ctrl, sgl_length: int) -> bytes:
    mr = ctrl.arena.mr
    return DatasetManagement(nsid=1, nr=0, ad=True).to_sqe(
        sgl=KeyedSGL(mr.addr, sgl_length, mr.rkey)).pack()


#: (name, queue, capsule builder, expected status): lengths a host chose
LENGTH_ATTACKS = [
    ("log page NUMD 256 MiB, SGL 4 KiB", "admin",
     lambda c: log_page(c, LogPageId.SMART, 256 * MiB, 4096),
     StatusCode.SGL_DATA_LENGTH_INVALID),
    ("log page NUMD = SGL = 16 MiB - 4", "admin",
     lambda c: log_page(c, LogPageId.SMART, 16 * MiB - 4, 16 * MiB - 4),
     StatusCode.INVALID_FIELD),
    ("DSM one range, SGL 16 MiB - 1", "io", lambda c: dsm(c, 16 * MiB - 1),
     StatusCode.INVALID_FIELD),
]


@pytest.mark.timeout(60)
def test_lengths_are_checked_before_allocation(target, bystander):
    """Get Log Page NUMD and DSM SGL lengths far beyond the data buffer or MDTS get their
    status without the target allocating anything of that size (its peak resident memory
    stays put); a log page read up to MDTS is the page and then zeros, and a DSM with a long
    SGL reads only its ranges."""
    probe = TargetProbe(target)
    pid = target.proc.pid
    peak, volume = vm(pid, "VmHWM"), volume_rss(pid)
    with bystander.attack("lengths beyond SGL and MDTS"), \
            connect(addr_of(), NQN, target.port, **via(), hostnqn=HOSTNQN,
                    nr_io_queues=1) as attacker:
        queues = {"admin": attacker.admin, "io": attacker.io_queues[0]}
        for _ in range(5):
            for name, queue, build, status in LENGTH_ATTACKS:
                cqe = attacker.raw(queues[queue], build(attacker))
                assert (cqe.status, cqe.dnr) == (status, True), (name, cqe)
        # A whole MDTS of SMART log page: 512 bytes of page, then zeros
        arena = attacker.arena.mr.buf
        arena[:MDTS] = b"\xee" * MDTS
        cqe = attacker.raw(attacker.admin, log_page(attacker, LogPageId.SMART, MDTS, MDTS))
        assert cqe.status == StatusCode.SUCCESS, cqe
        assert bytes(arena[512:MDTS]) == bytes(MDTS - 512)
        # DSM with 64 KiB of SGL and one range: only the range is read
        arena[:16] = DSMRange(cattr=0, nlb=8, slba=4096).pack()
        cqe = attacker.raw(queues["io"], dsm(attacker, 64 * 1024))
        assert cqe.status == StatusCode.SUCCESS, cqe
    assert_undisturbed(bystander.finish(), bystander)
    # the peak's growth, less the volume's pages that became resident meanwhile (verbs
    # pins the whole volume when this process serves its first I/O queue)
    grew = vm(pid, "VmHWM") - peak - (volume_rss(pid) - volume)
    assert grew < 64 * MiB, f"the target's peak resident memory grew by {grew >> 20} MiB"
    assert "Traceback" not in target.log
    probe.assert_bounded()
    assert_accepts_new_host(target.port)
