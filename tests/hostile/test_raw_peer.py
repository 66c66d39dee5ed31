"""A raw peer on the soft provider's wire, with forged keys and lengths, trying one-sided
RDMA into the target's memory (which is registered for local access only): each attempt
gets a remote access error NAK and the connection is torn down; another host's data is
untouched and the target stays up.  Bare connections that never send a Fabrics Connect are
refused past the per-host limit, and dropped after ``limits.connect_timeout``."""

from __future__ import annotations

import random
import time

import pytest

from blockfabric.protocol import CMConnectRequest, CMReject, CMRejectStatus
from blockfabric.rdma import WcStatus
from blockfabric.rdma.soft.wire import Frame

from .conftest import MAX_CONN, assert_undisturbed
from .rawpeer import RawPeer

pytestmark = pytest.mark.needs_transport(
    "rdma", "a raw peer forges the soft provider's frames (rkeys, lengths, bare connections); on "
    "verbs rxe checks rkeys and bounds itself (REM_ACCESS_ERR: the verbs contract suite, "
    "tests/rdma)")

QUEUE_REQ = CMConnectRequest(recfmt=0, qid=0, hrqsize=32, hsqsize=31, cntlid=0).pack()


def attacks(seed: int = 8) -> list[tuple[str, Frame, int, int, int]]:
    """(name, frame, key, addr, length): small keys (soft MR keys count up from a few),
    random ones, addresses where mmaps live, and the largest lengths."""
    rng = random.Random(seed)
    out = []
    for key in (0, 1, 2, 3, 4, 5, 6, 7, rng.getrandbits(32)):
        addr = rng.choice((0, 0x7F0000000000 + rng.getrandbits(32) * 4096, 0x1000))
        out.append((f"write key {key:#x}", Frame.WRITE, key, addr, 4096))
        out.append((f"read key {key:#x}", Frame.READ_REQ, key, addr, 4096))
    out.append(("read 2 GiB", Frame.READ_REQ, 1, 0, 1 << 31))
    out.append(("read 16 MiB - 1", Frame.READ_REQ, 2, 0, (16 << 20) - 1))
    return out


@pytest.mark.timeout(90)
def test_forged_rdma_into_target_memory(target, bystander):
    addr = ("127.0.0.1", target.port)
    for name, ftype, key, raddr, length in attacks():
        peer = RawPeer(addr, source="127.0.0.2")
        try:
            kind, _ = peer.connect_cm(QUEUE_REQ)
            assert kind == Frame.CONN_REP, name
            payload = bytes(length) if ftype == Frame.WRITE else b""
            peer.request(ftype, payload, key=key, addr=raddr,
                         **({} if payload else {"length": length}))
            frame = peer.recv_frame()
            assert frame is not None, f"{name}: closed without a NAK"
            got, fields, _ = frame
            assert (got, fields["key"]) == (Frame.NAK, WcStatus.REM_ACCESS_ERR), (name, frame)
            assert peer.closed_within(5), f"{name}: the queue was not torn down"
        finally:
            peer.close()
    assert target.alive()
    assert_undisturbed(bystander.finish())
    assert "Traceback" not in target.log


@pytest.mark.timeout(60)
def test_connect_flood_is_refused_past_the_per_host_limit(target, bystander):
    """Bare CM connects that never send a Fabrics Connect, from one address: the first
    ``max_connections_per_host`` are accepted, the rest get a CM reject NO_RESOURCES;
    the bystander (another address) keeps working; closing them frees the slots."""
    addr = ("127.0.0.1", target.port)
    peers = []
    try:
        outcomes = []
        for _ in range(MAX_CONN + 4):
            peer = RawPeer(addr, source="127.0.0.2")
            peers.append(peer)
            kind, private = peer.connect_cm(QUEUE_REQ)
            outcomes.append(kind if kind == Frame.CONN_REP
                            else CMReject.unpack_from(private).sts)
        assert outcomes == [Frame.CONN_REP] * MAX_CONN \
            + [CMRejectStatus.NO_RESOURCES] * 4, outcomes
        assert target.wait_log("max_connections_per_host is 6", 2), target.log
    finally:
        for peer in peers:
            peer.close()
    assert_undisturbed(bystander.finish())
    # The slots come back once those connections are gone.
    deadline = time.monotonic() + 5
    while True:
        peer = RawPeer(addr, source="127.0.0.2")
        try:
            kind, _ = peer.connect_cm(QUEUE_REQ)
        finally:
            peer.close()
        if kind == Frame.CONN_REP or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert kind == Frame.CONN_REP


def flood(addr: tuple[str, int], count: int) -> tuple[list[RawPeer], list]:
    """``count`` bare CM connects from 127.0.0.2 (no Fabrics Connect): the peers and, for
    each, Frame.CONN_REP or the CM reject status."""
    peers, outcomes = [], []
    try:
        for _ in range(count):
            peer = RawPeer(addr, source="127.0.0.2")
            peers.append(peer)
            kind, private = peer.connect_cm(QUEUE_REQ)
            outcomes.append(kind if kind == Frame.CONN_REP
                            else CMReject.unpack_from(private).sts)
    except BaseException:
        for peer in peers:
            peer.close()
        raise
    return peers, outcomes


CONNECT_TIMEOUT = 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("target", [{"connect_timeout": CONNECT_TIMEOUT}], indirect=True)
def test_silent_connections_are_dropped_after_connect_timeout(target, bystander):
    """Queues that connect and then say nothing fill the per-host limit; after
    ``limits.connect_timeout`` the target disconnects them (logged at INFO with the peer),
    and the address gets its slots back.  The bystander's queues, which did send Connect,
    outlive the timeout several times over untouched."""
    addr = ("127.0.0.1", target.port)
    started = time.monotonic()
    peers, outcomes = flood(addr, MAX_CONN + 2)
    try:
        assert outcomes == [Frame.CONN_REP] * MAX_CONN \
            + [CMRejectStatus.NO_RESOURCES] * 2, outcomes
        for i, peer in enumerate(peers[:MAX_CONN]):
            assert peer.closed_within(CONNECT_TIMEOUT + 3), f"silent queue {i} was kept"
            if i == 0:
                waited = time.monotonic() - started
                assert CONNECT_TIMEOUT * 0.9 <= waited < CONNECT_TIMEOUT + 3, waited
    finally:
        for peer in peers:
            peer.close()
    deadline = time.monotonic() + 3                 # stderr is read by another thread
    while True:
        dropped = [line for line in target.lines if "no Fabrics Connect within 1 s" in line]
        if len(dropped) >= MAX_CONN or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(dropped) == MAX_CONN, dropped
    assert all(line.startswith("INFO ") for line in dropped), dropped
    assert all("peer 127.0.0.2:" in line for line in dropped), dropped
    # The slots are free again: a full set of new connections is accepted.
    again, outcomes = flood(addr, MAX_CONN)
    for peer in again:
        peer.close()
    assert outcomes == [Frame.CONN_REP] * MAX_CONN, outcomes
    time.sleep(max(0.0, started + 3 * CONNECT_TIMEOUT - time.monotonic()))
    assert_undisturbed(bystander.finish())
    assert target.alive()
