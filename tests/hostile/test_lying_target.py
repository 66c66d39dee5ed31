"""A target that lies to the host (liar_target.py, NVMe/TCP by hand): one bad namespace
costs only that namespace, a reserved event type does not stop the events, a target that
stops answering cannot hold a disconnect, sizes the target gives are bounded before the
host allocates or builds commands from them, and a path error with Do Not Retry reaches
the caller instead of going round the paths for ever."""

from __future__ import annotations

import dataclasses
import struct
import threading
import time

import pytest

from blockfabric.initiator.host import Controller, NvmeError, discover
from blockfabric.initiator.recovery import CtrlState
from blockfabric.protocol import (DiscoveryLogEntry, IdentifyNamespace, LBAFormat,
                                  pack_discovery_log)
from blockfabric.protocol.logpages import AnaGroupDescriptor, AnaState, pack_ana_log

from .liar_target import LiarTarget, connect_opts, word

pytestmark = pytest.mark.needs_transport("tcp", "the lying target speaks NVMe/TCP by hand")


@pytest.fixture
def target():
    t = LiarTarget()
    yield t
    t.close()


def _closes_within(ctrl: Controller, seconds: float) -> bool:
    done = threading.Event()
    threading.Thread(target=lambda: (ctrl.close(), done.set()), daemon=True).start()
    return done.wait(seconds)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("silence", ["the shutdown", "everything"])
def test_a_target_that_stops_answering_cannot_hold_a_disconnect(target, silence):
    """close() (nvme disconnect, an unmount) asks for a normal shutdown and waits for it
    2 s at most: a target that never answers the Property Set, or nothing at all while
    its connection stays up, costs that wait, not a hang."""
    if silence == "the shutdown":
        def on_fabrics(conn, fctype, cid, sqe, data):    # CC.SHN set: never answered
            return fctype == 0x00 and bool(struct.unpack_from("<Q", sqe, 48)[0] >> 14 & 3)
        target.on_fabrics = on_fabrics
    ctrl = Controller(connect_opts(target, keep_alive_tmo=1.0)).connect()
    if silence == "everything":
        target.handle = lambda conn, sqe, data: None
    started = time.monotonic()
    assert _closes_within(ctrl, 15), "Controller.close() still blocked after 15 s"
    assert time.monotonic() - started < 8


@pytest.mark.parametrize("bad", ["Identify refused", "no such LBA format", "1-byte blocks",
                                 "16 GiB blocks", "past a file offset"])
def test_one_unusable_namespace_costs_only_itself(target, bad):
    """Namespace 2 the host cannot use (its Identify answered with an error; an LBA format
    index naming nothing; blocks outside 512 B to 64 KiB, which would send commands whose
    block count overflows or make a 1-byte write allocate a whole block; more bytes than a
    file offset holds): it is skipped, with a warning, and namespace 1 served."""
    lbaf = (LBAFormat(ms=0, ds=9, rp=0),)
    if bad == "Identify refused":
        target.ns_status[2] = word(0x0B, dnr=True)          # Invalid Namespace, DNR
    elif bad == "no such LBA format":
        target.namespaces[2] = IdentifyNamespace(nsze=100, ncap=100, nuse=100, flbas=3,
                                                 lbaf=lbaf)
    else:
        ds, nsze = {"1-byte blocks": (0, 1 << 24), "16 GiB blocks": (34, 4),
                    "past a file offset": (12, (1 << 64) - 1)}[bad]
        target.namespaces[2] = IdentifyNamespace(nsze=nsze, ncap=nsze, nuse=0,
                                                 lbaf=(LBAFormat(ms=0, ds=ds, rp=0),))
    ctrl = Controller(connect_opts(target)).connect()
    try:
        assert set(ctrl.namespaces) == {1}
        assert ctrl.namespaces[1].submit_read(0, 4096).result(5) == bytes(4096)
    finally:
        ctrl.close()


@pytest.mark.timeout(60)
def test_a_namespace_gone_bad_across_a_reconnect_costs_only_itself(target):
    target.namespaces[2] = target.namespaces[1]
    ctrl = Controller(connect_opts(target, ctrl_loss_tmo=30.0)).connect()
    try:
        assert set(ctrl.namespaces) == {1, 2}
        target.ns_status[2] = word(0x0B, dnr=True)
        for c in list(target.conns):            # the connection drops
            c.sock.shutdown(2)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not ctrl.recovery.losses:
            time.sleep(0.02)
        assert ctrl.recovery.losses
        while time.monotonic() < deadline and ctrl.state is not CtrlState.LIVE \
                and ctrl.state is not CtrlState.FAILED:
            time.sleep(0.05)
        assert ctrl.state is CtrlState.LIVE, ctrl.recovery.last_reason
        assert set(ctrl.namespaces) == {1}
    finally:
        ctrl.close()


def test_an_admin_command_never_answered_times_out_and_events_go_on(target):
    """A live target that answers Keep Alive but never an Identify: the rescan a namespace
    notice starts fails after admin_timeout (the Linux host's admin_timeout), instead of
    holding the one worker that handles events for good; the next event is handled."""
    ctrl = Controller(connect_opts(target, admin_timeout=1.0)).connect()
    try:
        def on_admin(conn, opcode, cid, sqe, data):
            if opcode == 0x02 and sqe[40] == 0x04:      # Changed Namespace List: [1]
                conn.data(cid, struct.pack("<I", 1) + bytes(4092))
                conn.respond(cid)
                return True
            return opcode == 0x06                       # Identify: swallowed
        target.on_admin = on_admin
        assert target.complete_aer(0x00040002)      # namespace attribute changed
        assert target.complete_aer(0x00040002), "events stopped behind an unanswered command"
    finally:
        ctrl.close()


def test_an_event_of_a_reserved_type_does_not_stop_the_events(target):
    """An AER completed with a reserved event type (4) is ignored, and the host asks for
    the next event again: a namespace notice after it still arrives."""
    ctrl = Controller(connect_opts(target)).connect()
    try:
        assert target.complete_aer(0x4)
        assert target.complete_aer(0x00040002), "the host stopped asking for events"
    finally:
        ctrl.close()


def test_the_active_namespace_list_ends_at_its_first_zero(target):
    target.namespaces[5] = target.namespaces[1]

    def on_admin(conn, opcode, cid, sqe, data):
        if opcode == 0x06 and sqe[40] == 2:
            conn.data(cid, struct.pack("<3I", 1, 0, 5) + bytes(4096 - 12))
            conn.respond(cid)
            return True
        return False
    target.on_admin = on_admin
    ctrl = Controller(connect_opts(target)).connect()
    try:
        assert set(ctrl.namespaces) == {1}
    finally:
        ctrl.close()


def test_the_targets_in_capsule_size_is_bounded(target):
    """IOCCSZ sizes a buffer per command slot of every I/O queue: 64 MiB of in-capsule data
    offered is taken as 16 KiB."""
    target.ctrl = dataclasses.replace(target.ctrl, ioccsz=(64 + (64 << 20)) // 16)
    ctrl = Controller(connect_opts(target, queue_size=8)).connect()
    try:
        assert ctrl.inline_size == 16 << 10
        assert sum(len(s.view) for s in ctrl.io_queues[0].slots) <= 8 * (64 + (16 << 10))
        data = bytes(range(256)) * 16
        ctrl.namespaces[1].submit_write(0, data).result(5)     # in the capsule
    finally:
        ctrl.close()


@pytest.mark.parametrize("nsids", [2100, 1 << 20])
def test_the_ana_log_is_read_whole_and_checked(target, nsids):
    """An ANA log longer than a fixed read (one group of 2100 namespaces, NN 2100) is read
    whole: the read is sized from NANAGRPID and NN, as the Linux host sizes it.  One that
    claims more NSIDs than it holds (2**20 in one group) is refused as malformed: the
    connect says so, nothing is allocated for them."""
    target.ctrl = dataclasses.replace(target.ctrl, cmic=0x0B, anagrpmax=1, nanagrpid=1,
                                      nn=2100)
    target.namespaces[1] = dataclasses.replace(target.namespaces[1], anagrpid=1)
    group = AnaGroupDescriptor(1, AnaState.OPTIMIZED, 1, tuple(range(1, 2101)))
    target.ana = pack_ana_log(1, [group])
    if nsids != 2100:
        target.ana = target.ana[:16] + struct.pack("<IIQB15x", 1, nsids, 1, 1) + \
            target.ana[48:]
        with pytest.raises(Exception, match="NSIDs do not fit"):
            Controller(connect_opts(target)).connect()
        return
    ctrl = Controller(connect_opts(target)).connect()
    try:
        assert ctrl.ana_log[1][0].nsids == group.nsids
    finally:
        ctrl.close()


def test_a_discovery_log_that_changes_under_the_read_is_read_again(target):
    """The log changes between its header and its entries (GENCTR moves): the entries read
    with the old count would include an all-zero record; the host reads it again, as
    nvme-cli does, and returns what the log holds now."""
    one = DiscoveryLogEntry(trtype=3, subnqn="nqn.2026-12.io.blockfabric:a", traddr="10.0.0.1",
                            trsvcid="4420")
    two = DiscoveryLogEntry(trtype=3, subnqn="nqn.2026-12.io.blockfabric:b", traddr="10.0.0.2",
                            trsvcid="4420")
    reads = [0]

    def on_admin(conn, opcode, cid, sqe, data):
        if opcode == 0x02 and sqe[40] == 0x70:      # Get Log Page, discovery
            numd = (struct.unpack_from("<I", sqe, 40)[0] >> 16) | (
                struct.unpack_from("<I", sqe, 44)[0] & 0xFFFF) << 16
            page = pack_discovery_log(1, [one, two]) if reads[0] == 0 else \
                pack_discovery_log(2, [one])
            reads[0] += 1
            conn.data(cid, (bytes(page) + bytes((numd + 1) * 4))[:(numd + 1) * 4])
            conn.respond(cid)
            return True
        return False
    target.on_admin = on_admin
    entries = discover("127.0.0.1", target.port, transport="tcp", connect_timeout=2.0)
    assert [(e.subnqn, e.traddr) for e in entries] == [(one.subnqn, "10.0.0.1")]
    assert reads[0] == 5            # header, entries, header (it moved); entries, header


@pytest.mark.timeout(60)
def test_a_path_error_with_do_not_retry_reaches_the_caller():
    """Both paths answer every Read 'ANA Inaccessible' with DNR while their ANA logs say
    optimized: the read fails with that status (not re-issued path after path)."""
    targets = [LiarTarget(), LiarTarget()]
    sent = [0]
    for t in targets:
        t.ctrl = dataclasses.replace(t.ctrl, cmic=0x0B, anagrpmax=1, nanagrpid=1)
        t.namespaces[1] = dataclasses.replace(t.namespaces[1], anagrpid=1)
        t.ana = pack_ana_log(1, [AnaGroupDescriptor(1, AnaState.OPTIMIZED, 1, (1,))])

        def io(conn, sqe, data):
            sent[0] += 1
            conn.respond(struct.unpack_from("<H", sqe, 2)[0], word(0x02, sct=3, dnr=True))
        t.io = io
    ctrl = Controller(connect_opts(targets[0], paths=[("127.0.0.1", targets[1].port,
                                                        "tcp")])).connect()
    try:
        with pytest.raises(NvmeError) as info:
            ctrl.namespaces[1].submit_read(0, 4096).result(5)
        assert info.value.sct == 3 and info.value.dnr
        assert sent[0] == 1
    finally:
        ctrl.close()
        for t in targets:
            t.close()
